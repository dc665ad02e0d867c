//! Training checkpoints: the model's tensors, the optimizer's momentum and [`Progress`] inside
//! an envelope (magic, length, CRC-32), written atomically and verified whole before use.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{IoContext, Result, TrainError};
use crate::model::Snapshot;

use super::atomic::write_atomic;
use super::info::{MODEL_KEY, ModelInfo};
use super::tensors::{MOMENTUM_PREFIX, decode, encode, to_json};

pub(super) const MAGIC: &[u8; 16] = b"TRAINCTL-CKPT\0v1";
pub(super) const HEADER: usize = 16 + 8 + 4;
const PROGRESS_KEY: &str = "trainctl.progress";

/// Where training stands, and how it was configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// The epoch in progress (0-based); `epochs` once training is complete.
    pub epoch: usize,
    /// Samples of that epoch already consumed, across all ranks.
    pub position: usize,
    /// Optimizer steps taken since the start of training.
    pub global_step: u64,
    /// Samples trained on since the start of training, across all ranks and restarts (each
    /// restart goes back to the checkpoint, this count with it): `epochs × data-set size` at
    /// the end exactly when no sample was skipped or trained twice.
    #[serde(default)]
    pub samples_seen: u64,
    /// The [`digest`](crate::sampler::digest) of the samples trained so far in the epoch in
    /// progress, over all ranks (0 in checkpoints written before it was kept).
    #[serde(default)]
    pub epoch_digest: u64,
    pub seed: u64,
    pub world_size: usize,
    pub dataset_len: usize,
    pub batch_size: usize,
    pub learning_rate: f64,
    pub momentum: f64,
    pub weight_decay: f64,
}

pub struct Checkpoint {
    pub progress: Progress,
    pub info: ModelInfo,
    pub params: Vec<f32>,
    pub buffers: Vec<f32>,
    pub momentum: Vec<f32>,
}

pub fn save_checkpoint(
    path: &Path,
    snapshot: &Snapshot,
    momentum: &[f32],
    progress: &Progress,
    info: &ModelInfo,
) -> Result<()> {
    let payload = encode(
        snapshot,
        Some(momentum),
        progress.global_step,
        Some(HashMap::from([
            (PROGRESS_KEY.to_string(), to_json(progress)?),
            (MODEL_KEY.to_string(), to_json(info)?),
        ])),
    )?;
    write_atomic(path, &envelope(&payload))
}

/// As [`save_checkpoint`], only when the file at `path` holds an earlier global step than
/// `progress` (or none that can be read), decided and written under an exclusive lock on a file
/// beside it (`PATH.lock`), so that of several ranks writing at once the furthest wins.
/// Returns whether it wrote.
pub fn save_checkpoint_if_newer(
    path: &Path,
    snapshot: &Snapshot,
    momentum: &[f32],
    progress: &Progress,
    info: &ModelInfo,
) -> Result<bool> {
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = std::path::PathBuf::from(lock_path);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&lock_path)
        .at(&lock_path)?;
    lock.lock().at(&lock_path)?;
    if checkpoint_step(path).is_some_and(|held| held >= progress.global_step) {
        return Ok(false);
    }
    save_checkpoint(path, snapshot, momentum, progress, info)?;
    Ok(true)
}

/// The global step the checkpoint at `path` holds, read from its header alone (not verified:
/// only [`save_checkpoint_if_newer`] asks), or `None` when there is none that can be read.
pub fn checkpoint_step(path: &Path) -> Option<u64> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut head = [0u8; HEADER + 8];
    f.read_exact(&mut head).ok()?;
    if &head[..16] != MAGIC {
        return None;
    }
    let n = u64::from_le_bytes(head[HEADER..].try_into().ok()?);
    // The safetensors header: JSON, its metadata holding the progress record.
    let mut json = vec![0u8; usize::try_from(n).ok().filter(|&n| n <= 1 << 24)?];
    f.read_exact(&mut json).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&json).ok()?;
    let progress = header.get("__metadata__")?.get(PROGRESS_KEY)?.as_str()?;
    serde_json::from_str::<Progress>(progress)
        .ok()
        .map(|p| p.global_step)
}

/// Reads and verifies a checkpoint. `Ok(None)` when there is none; an error, naming what is
/// wrong, when the file is damaged or belongs to another model. `template` is the network
/// being trained, or `None` to take the one the checkpoint describes.
pub fn load_checkpoint(path: &Path, template: Option<&Snapshot>) -> Result<Option<Checkpoint>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).at(path),
    };
    parse_checkpoint(&bytes, template)
        .map(Some)
        .map_err(|problem| TrainError::BadCheckpoint {
            path: path.to_path_buf(),
            problem: format!(
                "{problem}; it was not used: move it away to start from scratch, or restore a good copy"
            ),
        })
}

/// A checkpoint's bytes verified (envelope, length, checksum, metadata, every tensor's name
/// and shape against `template` or the network the checkpoint describes) and read.
pub(crate) fn parse_checkpoint(
    bytes: &[u8],
    template: Option<&Snapshot>,
) -> Result<Checkpoint, String> {
    if bytes.len() < HEADER || &bytes[..16] != MAGIC {
        return Err("not a trainctl checkpoint (bad magic bytes)".into());
    }
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(bytes[24..28].try_into().unwrap_or_default());
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != len {
        return Err(format!(
            "truncated: {} payload bytes, the header says {len}",
            payload.len()
        ));
    }
    let actual = crc32fast::hash(payload);
    if actual != crc {
        return Err(format!(
            "checksum mismatch (stored {crc:08x}, computed {actual:08x}): the file is corrupt"
        ));
    }
    let tensors = safetensors::SafeTensors::deserialize(payload).map_err(|e| e.to_string())?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(payload).map_err(|e| e.to_string())?;
    let metadata = meta.metadata().as_ref();
    let progress = metadata
        .and_then(|m| m.get(PROGRESS_KEY))
        .ok_or_else(|| "no training progress recorded".to_string())?;
    let progress: Progress =
        serde_json::from_str(progress).map_err(|e| format!("progress record: {e}"))?;
    let info = match metadata.and_then(|m| m.get(MODEL_KEY)) {
        Some(json) => serde_json::from_str(json).map_err(|e| format!("{MODEL_KEY} record: {e}"))?,
        // Checkpoints from before models were described are the seed CNN's.
        None => ModelInfo::seed_cifar(),
    };
    info.check(&tensors)?;
    let own;
    let template = match template {
        Some(t) => t,
        None => {
            let arch = info.architecture()?;
            let model = crate::model::Model::new(
                arch,
                info.classes.len(),
                &crate::device::inference_device(),
            );
            own = crate::model::snapshot(&model);
            &own
        }
    };
    let (params, buffers) = decode(&tensors, &template.entries, "", false)?;
    let (momentum, _) = decode(&tensors, &template.entries, MOMENTUM_PREFIX, true)?;
    Ok(Checkpoint {
        progress,
        info,
        params,
        buffers,
        momentum,
    })
}

/// The checkpoint envelope around `payload` (safetensors bytes): magic, length, CRC-32.
pub(crate) fn envelope(payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// Reads and verifies a checkpoint (envelope, checksum, tensor names and shapes of the
/// network it describes) and returns where its training stands.
pub fn inspect_checkpoint(path: &Path) -> Result<Progress> {
    match load_checkpoint(path, None)? {
        Some(ckpt) => Ok(ckpt.progress),
        None => Err(TrainError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no checkpoint there"),
        }),
    }
}
