//! Model files and checkpoints.
//!
//! The model file is plain safetensors with PyTorch's names for the seed's `nn.Sequential`, so
//! `model.load_state_dict(safetensors.torch.load_file(path))` works. A checkpoint is the same
//! tensors plus the optimizer's momentum and the training position, inside an envelope with a
//! checksum, written atomically: a crash leaves the old checkpoint or the new one, never half of
//! one, and a damaged file is reported, never used.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::{IoContext, Result, TrainError};
use crate::model::{Entry, Snapshot};

const MAGIC: &[u8; 16] = b"TRAINCTL-CKPT\0v1";
const HEADER: usize = 16 + 8 + 4;
const MOMENTUM_PREFIX: &str = "optimizer.momentum.";

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
    pub params: Vec<f32>,
    pub buffers: Vec<f32>,
    pub momentum: Vec<f32>,
}

/// Writes `bytes` to `path` so that a crash at any moment leaves either the old file or the new
/// one: temporary file in the same directory, fsync, rename, fsync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).at(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.at(path)
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `values` as a `rows × cols` row-major matrix, transposed.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = values[r * cols + c];
        }
    }
    t
}

/// PyTorch's layout of one tensor: linear weights transposed to `[out, in]`.
fn to_torch(entry: &Entry, values: &[f32]) -> (Vec<usize>, Vec<f32>) {
    if entry.is_linear_weight() {
        (
            entry.torch_shape(),
            transpose(values, entry.shape[0], entry.shape[1]),
        )
    } else {
        (entry.shape.clone(), values.to_vec())
    }
}

fn from_torch(entry: &Entry, values: &[f32]) -> Vec<f32> {
    if entry.is_linear_weight() {
        transpose(values, entry.shape[1], entry.shape[0])
    } else {
        values.to_vec()
    }
}

/// Serialises the model (and optionally the optimizer's momentum) as safetensors with PyTorch
/// names. `batches_tracked` fills BatchNorm's `num_batches_tracked`.
fn encode(
    snapshot: &Snapshot,
    momentum: Option<&[f32]>,
    batches_tracked: u64,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut offset = 0;
    for (entry, values) in snapshot.tensors() {
        let (shape, data) = to_torch(entry, values);
        let name = entry.torch_name();
        if let (Some(m), true) = (momentum, entry.trainable) {
            let (_, m) = to_torch(entry, &m[offset..offset + values.len()]);
            tensors.push((
                format!("{MOMENTUM_PREFIX}{name}"),
                Dtype::F32,
                shape.clone(),
                f32_bytes(&m),
            ));
        }
        if entry.trainable {
            offset += values.len();
        }
        if entry.path.ends_with("running_var") {
            let counter = name.replace("running_var", "num_batches_tracked");
            tensors.push((
                counter,
                Dtype::I64,
                vec![],
                (batches_tracked as i64).to_le_bytes().to_vec(),
            ));
        }
        tensors.push((name, Dtype::F32, shape, f32_bytes(&data)));
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TrainError::Config(format!("cannot lay out tensors: {e}")))?;
    safetensors::serialize(views, metadata)
        .map_err(|e| TrainError::Config(format!("cannot serialise tensors: {e}")))
}

/// Reads tensors named like `template`'s entries (prefixed by `prefix`) out of safetensors
/// bytes, checking every name and shape. Returns (trainable values, buffer values).
fn decode(
    tensors: &safetensors::SafeTensors,
    template: &[Entry],
    prefix: &str,
    trainable_only: bool,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let (mut params, mut buffers) = (Vec::new(), Vec::new());
    for entry in template.iter().filter(|e| e.trainable || !trainable_only) {
        let name = format!("{prefix}{}", entry.torch_name());
        let view = tensors
            .tensor(&name)
            .map_err(|_| format!("has no tensor {name} (not a seed-CNN model?)"))?;
        let expected = entry.torch_shape();
        if view.dtype() != Dtype::F32 || view.shape() != expected {
            return Err(format!(
                "tensor {name} is {:?} {:?}, expected F32 {expected:?}",
                view.dtype(),
                view.shape()
            ));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let values = from_torch(entry, &values);
        if entry.trainable {
            params.extend(values)
        } else {
            buffers.extend(values)
        }
    }
    Ok((params, buffers))
}

/// Saves the final model as PyTorch-named safetensors.
pub fn save_model(path: &Path, snapshot: &Snapshot, batches_tracked: u64) -> Result<()> {
    write_atomic(path, &encode(snapshot, None, batches_tracked, None)?)
}

/// Loads a model file written by [`save_model`] (or by PyTorch from the seed's model) into
/// buffers laid out like `template`.
pub fn load_model(path: &Path, template: &Snapshot) -> Result<(Vec<f32>, Vec<f32>)> {
    let bytes = std::fs::read(path).at(path)?;
    let bad = |problem: String| TrainError::BadModel {
        path: path.to_path_buf(),
        problem,
    };
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    decode(&tensors, &template.entries, "", false).map_err(bad)
}

pub fn save_checkpoint(
    path: &Path,
    snapshot: &Snapshot,
    momentum: &[f32],
    progress: &Progress,
) -> Result<()> {
    let meta = serde_json::to_string(progress).map_err(|e| TrainError::Config(e.to_string()))?;
    let payload = encode(
        snapshot,
        Some(momentum),
        progress.global_step,
        Some(HashMap::from([("trainctl.progress".to_string(), meta)])),
    )?;
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    write_atomic(path, &bytes)
}

/// Reads and verifies a checkpoint. `Ok(None)` when there is none; an error, naming what is
/// wrong, when the file is damaged or belongs to another model.
pub fn load_checkpoint(path: &Path, template: &Snapshot) -> Result<Option<Checkpoint>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).at(path),
    };
    let bad = |problem: String| TrainError::BadCheckpoint {
        path: path.to_path_buf(),
        problem: format!(
            "{problem}; it was not used: move it away to start from scratch, or restore a good copy"
        ),
    };
    if bytes.len() < HEADER || &bytes[..16] != MAGIC {
        return Err(bad("not a trainctl checkpoint (bad magic bytes)".into()));
    }
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(bytes[24..28].try_into().unwrap_or_default());
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != len {
        return Err(bad(format!(
            "truncated: {} payload bytes, the header says {len}",
            payload.len()
        )));
    }
    let actual = crc32fast::hash(payload);
    if actual != crc {
        return Err(bad(format!(
            "checksum mismatch (stored {crc:08x}, computed {actual:08x}): the file is corrupt"
        )));
    }
    let tensors = safetensors::SafeTensors::deserialize(payload).map_err(|e| bad(e.to_string()))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(payload).map_err(|e| bad(e.to_string()))?;
    let progress = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("trainctl.progress"))
        .ok_or_else(|| bad("no training progress recorded".into()))?;
    let progress: Progress =
        serde_json::from_str(progress).map_err(|e| bad(format!("progress record: {e}")))?;
    let (params, buffers) = decode(&tensors, &template.entries, "", false).map_err(&bad)?;
    let (momentum, _) = decode(&tensors, &template.entries, MOMENTUM_PREFIX, true).map_err(&bad)?;
    Ok(Some(Checkpoint {
        progress,
        params,
        buffers,
        momentum,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{SeedCnn, snapshot};

    fn progress() -> Progress {
        Progress {
            epoch: 3,
            position: 1280,
            global_step: 77,
            samples_seen: 9_000,
            seed: 5,
            world_size: 2,
            dataset_len: 50_000,
            batch_size: 128,
            learning_rate: 1e-3,
            momentum: 0.9,
            weight_decay: 1e-4,
        }
    }

    fn model_state() -> (Snapshot, Vec<f32>) {
        let snap = snapshot(&SeedCnn::new(&crate::device::inference_device()));
        let momentum: Vec<f32> = (0..snap.params.len()).map(|i| i as f32 * 1e-3).collect();
        (snap, momentum)
    }

    #[test]
    fn checkpoint_round_trips() {
        let (snap, momentum) = model_state();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt");
        save_checkpoint(&path, &snap, &momentum, &progress()).unwrap();
        let back = load_checkpoint(&path, &snap).unwrap().unwrap();
        assert_eq!(back.progress, progress());
        assert_eq!(back.params, snap.params);
        assert_eq!(back.buffers, snap.buffers);
        assert_eq!(back.momentum, momentum);
        assert!(
            load_checkpoint(&dir.path().join("none"), &snap)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn corruption_and_truncation_are_detected() {
        let (snap, momentum) = model_state();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt");
        save_checkpoint(&path, &snap, &momentum, &progress()).unwrap();
        let good = std::fs::read(&path).unwrap();

        let mut flipped = good.clone();
        let middle = flipped.len() / 2;
        flipped[middle] ^= 0x40;
        std::fs::write(&path, &flipped).unwrap();
        let err = load_checkpoint(&path, &snap).err().unwrap().to_string();
        assert!(
            err.contains("checksum mismatch") && err.contains("not used"),
            "{err}"
        );

        std::fs::write(&path, &good[..good.len() - 100]).unwrap();
        let err = load_checkpoint(&path, &snap).err().unwrap().to_string();
        assert!(err.contains("truncated"), "{err}");

        std::fs::write(&path, b"hello").unwrap();
        let err = load_checkpoint(&path, &snap).err().unwrap().to_string();
        assert!(err.contains("not a trainctl checkpoint"), "{err}");
    }

    #[test]
    fn model_file_uses_pytorch_names_and_layout() {
        let (snap, _) = model_state();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save_model(&path, &snap, 9).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
        names.sort();
        for expected in [
            "network.0.weight",
            "network.0.bias",
            "network.5.weight",
            "network.5.bias",
            "network.5.running_mean",
            "network.5.running_var",
            "network.5.num_batches_tracked",
            "network.19.weight",
            "network.21.bias",
        ] {
            assert!(
                names.iter().any(|n| n == expected),
                "{expected} missing from {names:?}"
            );
        }
        assert_eq!(names.len(), 6 * 2 + 3 * 5 + 2 * 2);
        assert_eq!(st.tensor("network.19.weight").unwrap().shape(), [512, 4096]);
        assert_eq!(
            st.tensor("network.0.weight").unwrap().shape(),
            [32, 3, 3, 3]
        );
        let (params, buffers) = load_model(&path, &snap).unwrap();
        assert_eq!(
            (params, buffers),
            (snap.params.clone(), snap.buffers.clone())
        );
    }
}
