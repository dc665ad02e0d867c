//! Model files and checkpoints.
//!
//! The model file is plain safetensors with PyTorch's names (the seed's `nn.Sequential`,
//! torchvision's ResNet keys), so `model.load_state_dict(safetensors.torch.load_file(path))`
//! works; its metadata (`trainctl.model`, [`ModelInfo`]) says which network it is and names its
//! classes, for `eval` and `predict`. A checkpoint is the same
//! tensors plus the optimizer's momentum and the training position, inside an envelope with a
//! checksum, written atomically: a crash leaves the old checkpoint or the new one, never half of
//! one, and a damaged file is reported, never used.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use kernels::layout::transpose_each;

use crate::data::Normalisation;
use crate::data::cifar::CLASS_NAMES;
use crate::error::{IoContext, Result, TrainError};
use crate::model::resnet::Arch;
use crate::model::{Architecture, Entry, Snapshot};

const MAGIC: &[u8; 16] = b"TRAINCTL-CKPT\0v1";
const HEADER: usize = 16 + 8 + 4;
const MOMENTUM_PREFIX: &str = "optimizer.momentum.";
const MODEL_KEY: &str = "trainctl.model";
const PROGRESS_KEY: &str = "trainctl.progress";

/// What a model file says of its network besides the tensors: enough to rebuild it, feed it
/// images as it was trained on them, and name its predictions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// `seed-cnn`, `resnet18`, ...
    pub architecture: String,
    /// Class names by index.
    pub classes: Vec<String>,
    /// Side of the square images it takes.
    pub image_size: usize,
    pub normalisation: Normalisation,
}

impl ModelInfo {
    pub fn architecture(&self) -> Result<Architecture, String> {
        Architecture::parse(&self.architecture).ok_or_else(|| {
            format!(
                "names the network {:?}, which this trainctl does not know ({})",
                self.architecture,
                Architecture::CHOICES
            )
        })
    }

    /// The seed CNN on CIFAR-10, as files from before models were described are.
    pub fn seed_cifar() -> ModelInfo {
        ModelInfo {
            architecture: Architecture::SeedCnn.name().into(),
            classes: CLASS_NAMES.iter().map(|c| c.to_string()).collect(),
            image_size: 32,
            normalisation: Normalisation::Cifar,
        }
    }

    /// Checks what a file's metadata says against the network's limits and the file's own
    /// tensors, before anything is sized from it: the network is known, its image size is one
    /// it takes, and it has as many classes as its classifier's bias has entries.
    fn check(&self, tensors: &safetensors::SafeTensors) -> Result<(), String> {
        let arch = self.architecture()?;
        arch.check_image_size(self.image_size)
            .map_err(|e| format!("{MODEL_KEY} says image_size {}: {e}", self.image_size))?;
        let n = self.classes.len();
        if n == 0 || n > crate::model::MAX_CLASSES {
            return Err(format!(
                "{MODEL_KEY} names {n} classes; a model has 1 to {}",
                crate::model::MAX_CLASSES
            ));
        }
        let bias = match arch {
            Architecture::SeedCnn => "network.21.bias",
            Architecture::ResNet(_) => "fc.bias",
        };
        let have = tensors
            .tensor(bias)
            .ok()
            .map(|t| t.shape().iter().product::<usize>());
        match have {
            Some(have) if have == n => Ok(()),
            Some(have) => Err(format!(
                "{MODEL_KEY} names {n} classes but its classifier ({bias}) has {have} outputs"
            )),
            None => Err(format!(
                "{MODEL_KEY} describes a {arch} but the file has no {bias}"
            )),
        }
    }

    /// What a file without trainctl's metadata holds, told from its tensor names: the seed's
    /// `network.N` keys, or a torchvision ResNet (which one from its blocks).
    fn infer(tensors: &safetensors::SafeTensors) -> Result<ModelInfo, String> {
        let names = tensors.names();
        let has = |n: &str| names.contains(&n);
        // The class count sizes a list of names: bounded before anything is allocated.
        let classes_of = |bias: &str| {
            tensors
                .tensor(bias)
                .ok()
                .and_then(|t| t.shape().first().copied())
                .filter(|&n| n <= crate::model::MAX_CLASSES)
        };
        if has("network.0.weight") {
            let n = classes_of("network.21.bias").ok_or(
                "has network.0.weight but no network.21.bias (or one of too many classes)",
            )?;
            let mut info = ModelInfo::seed_cifar();
            if n != CLASS_NAMES.len() {
                info.classes = (0..n).map(|i| format!("class {i}")).collect();
            }
            return Ok(info);
        }
        if has("conv1.weight") && has("fc.bias") {
            let bottleneck = has("layer1.0.conv3.weight");
            let stage3 = (0..64)
                .take_while(|i| has(&format!("layer3.{i}.conv1.weight")))
                .count();
            let arch = match (bottleneck, stage3) {
                (false, 2) => Arch::ResNet18,
                (false, 6) => Arch::ResNet34,
                (true, 6) => Arch::ResNet50,
                (true, 23) => Arch::ResNet101,
                _ => {
                    return Err(format!(
                        "looks like a ResNet but has {stage3} blocks in layer3 (bottleneck: {bottleneck}); trainctl knows {}",
                        Architecture::CHOICES
                    ));
                }
            };
            let n =
                classes_of("fc.bias").ok_or("fc.bias has no shape, or one of too many classes")?;
            return Ok(ModelInfo {
                architecture: arch.name().into(),
                classes: (0..n).map(|i| format!("class {i}")).collect(),
                // torchvision's ImageNet recipe.
                image_size: 224,
                normalisation: Normalisation::ImageNet,
            });
        }
        Err(format!(
            "has no {MODEL_KEY} metadata and its tensors are neither the seed CNN's (network.0.weight, ...) nor a torchvision ResNet's (conv1.weight, ..., fc.bias)"
        ))
    }
}

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

/// PyTorch's layout of one tensor: linear weights transposed to `[out, in]`, convolution
/// weights from the flat buffers' `[c_out][kh][kw][c_in]` to `[c_out][c_in][kh][kw]`.
fn to_torch(entry: &Entry, values: &[f32]) -> (Vec<usize>, Vec<f32>) {
    if entry.is_linear_weight() {
        (
            entry.torch_shape(),
            transpose(values, entry.shape[0], entry.shape[1]),
        )
    } else if entry.is_conv_weight() {
        let (c_in, taps) = (entry.shape[1], entry.shape[2] * entry.shape[3]);
        (entry.shape.clone(), transpose_each(values, taps, c_in))
    } else {
        (entry.shape.clone(), values.to_vec())
    }
}

/// The flat buffers' layout of one tensor from PyTorch's: the inverse of [`to_torch`].
fn from_torch(entry: &Entry, values: &[f32]) -> Vec<f32> {
    if entry.is_linear_weight() {
        transpose(values, entry.shape[1], entry.shape[0])
    } else if entry.is_conv_weight() {
        let (c_in, taps) = (entry.shape[1], entry.shape[2] * entry.shape[3]);
        transpose_each(values, c_in, taps)
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
        let name = entry.torch_name.clone();
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
        let name = format!("{prefix}{}", entry.torch_name);
        let view = tensors.tensor(&name).map_err(|_| {
            format!("has no tensor {name} (a model of another network or class count?)")
        })?;
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

fn to_json<T: Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| TrainError::Config(e.to_string()))
}

/// Saves the final model as PyTorch-named safetensors, described by `info`.
pub fn save_model(
    path: &Path,
    snapshot: &Snapshot,
    batches_tracked: u64,
    info: &ModelInfo,
) -> Result<()> {
    let meta = HashMap::from([(MODEL_KEY.to_string(), to_json(info)?)]);
    write_atomic(path, &encode(snapshot, None, batches_tracked, Some(meta))?)
}

/// A model file read and described, its tensors not yet checked against a network.
pub struct ModelFile {
    pub info: ModelInfo,
    bytes: Vec<u8>,
    path: std::path::PathBuf,
}

/// Reads a model file written by [`save_model`], by PyTorch from the seed's model or by
/// torchvision from a ResNet, and says what network it holds.
pub fn read_model(path: &Path) -> Result<ModelFile> {
    let bytes = std::fs::read(path).at(path)?;
    if bytes.starts_with(MAGIC) {
        let beside = path.with_file_name(contract::run_files::MODEL);
        return Err(TrainError::BadModel {
            path: path.to_path_buf(),
            problem: format!(
                "a training checkpoint (what a run resumes from), not a model file: pass the model a run writes{}",
                if beside.is_file() {
                    format!(", {}", beside.display())
                } else {
                    format!(" ({} in its run's folder)", contract::run_files::MODEL)
                }
            ),
        });
    }
    let info = describe_model(&bytes).map_err(|problem| TrainError::BadModel {
        path: path.to_path_buf(),
        problem,
    })?;
    Ok(ModelFile {
        info,
        bytes,
        path: path.to_path_buf(),
    })
}

/// What network a model file's bytes hold: its `trainctl.model` metadata, or what its tensor
/// names say, checked against the network's limits and the tensors before anything is sized
/// from it.
pub(crate) fn describe_model(bytes: &[u8]) -> Result<ModelInfo, String> {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| format!("not a safetensors file ({e})"))?;
    let tensors = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a safetensors file ({e})"))?;
    let info = match meta.metadata().as_ref().and_then(|m| m.get(MODEL_KEY)) {
        Some(json) => serde_json::from_str::<ModelInfo>(json)
            .map_err(|e| format!("{MODEL_KEY} metadata: {e}"))?,
        None => ModelInfo::infer(&tensors)?,
    };
    info.check(&tensors)?;
    Ok(info)
}

impl ModelFile {
    /// The tensors laid out like `template` (parameters, buffers), every name and shape checked.
    pub fn tensors(&self, template: &Snapshot) -> Result<(Vec<f32>, Vec<f32>)> {
        let bad = |problem: String| TrainError::BadModel {
            path: self.path.clone(),
            problem,
        };
        let tensors = safetensors::SafeTensors::deserialize(&self.bytes)
            .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
        decode(&tensors, &template.entries, "", false).map_err(bad)
    }
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{SeedCnn, snapshot};

    /// A mid-run position, for tests that need one.
    pub(crate) fn progress() -> Progress {
        Progress {
            epoch: 3,
            position: 1280,
            global_step: 77,
            samples_seen: 9_000,
            epoch_digest: 0x0123_4567_89AB_CDEF,
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
        let snap = snapshot(&SeedCnn::new(10, &crate::device::inference_device()));
        let momentum: Vec<f32> = (0..snap.params.len()).map(|i| i as f32 * 1e-3).collect();
        (snap, momentum)
    }

    /// A seed-CNN checkpoint written to `path` by [`save_checkpoint`]: its network and bytes.
    fn saved_at(path: &Path) -> (Snapshot, Vec<u8>) {
        let (snap, momentum) = model_state();
        save_checkpoint(
            path,
            &snap,
            &momentum,
            &progress(),
            &ModelInfo::seed_cifar(),
        )
        .unwrap();
        let bytes = std::fs::read(path).unwrap();
        (snap, bytes)
    }

    /// A real checkpoint's payload (safetensors with progress, model metadata and momentum).
    fn real_payload() -> &'static (Snapshot, Vec<u8>) {
        static PAYLOAD: std::sync::OnceLock<(Snapshot, Vec<u8>)> = std::sync::OnceLock::new();
        PAYLOAD.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let (snap, bytes) = saved_at(&dir.path().join("ckpt"));
            (snap, bytes[HEADER..].to_vec())
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        /// A damaged payload behind a valid checksum (the fuzz target's ground, in CI): a byte
        /// of the safetensors header or metadata changed, or the payload cut short, is
        /// refused with a reason or read whole, never a panic, read as a checkpoint or as a
        /// model file.
        #[test]
        fn damaged_payloads_behind_a_valid_checksum_never_panic(
            at in 0usize..2048,
            byte in proptest::prelude::any::<u8>(),
            cut in proptest::prelude::prop_oneof![proptest::strategy::Just(0usize), 1usize..4096],
        ) {
            let (snap, payload) = real_payload();
            let mut damaged = payload.clone();
            let header = 8 + u64::from_le_bytes(payload[..8].try_into().unwrap()) as usize;
            damaged[at % header] = byte;
            damaged.truncate(damaged.len().saturating_sub(cut));
            let bytes = envelope(&damaged);
            if let Ok(c) = parse_checkpoint(&bytes, Some(snap)) {
                proptest::prop_assert_eq!(c.params.len(), snap.params.len());
            }
            let _ = parse_checkpoint(&bytes, None);
            let _ = describe_model(&damaged);
        }
    }

    #[test]
    fn checkpoint_round_trips() {
        let (snap, momentum) = model_state();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt");
        save_checkpoint(
            &path,
            &snap,
            &momentum,
            &progress(),
            &ModelInfo::seed_cifar(),
        )
        .unwrap();
        let back = load_checkpoint(&path, Some(&snap)).unwrap().unwrap();
        assert_eq!(back.progress, progress());
        assert_eq!(back.info, ModelInfo::seed_cifar());
        let described = load_checkpoint(&path, None).unwrap().unwrap();
        assert_eq!(
            described.params, snap.params,
            "the network it names is rebuilt"
        );
        assert_eq!(back.params, snap.params);
        assert_eq!(back.buffers, snap.buffers);
        assert_eq!(back.momentum, momentum);
        assert!(
            load_checkpoint(&dir.path().join("none"), Some(&snap))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn corruption_and_truncation_are_detected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt");
        let (snap, good) = saved_at(&path);

        let mut flipped = good.clone();
        let middle = flipped.len() / 2;
        flipped[middle] ^= 0x40;
        std::fs::write(&path, &flipped).unwrap();
        let err = load_checkpoint(&path, Some(&snap))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("checksum mismatch") && err.contains("not used"),
            "{err}"
        );

        std::fs::write(&path, &good[..good.len() - 100]).unwrap();
        let err = load_checkpoint(&path, Some(&snap))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("truncated"), "{err}");

        std::fs::write(&path, b"hello").unwrap();
        let err = load_checkpoint(&path, Some(&snap))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not a trainctl checkpoint"), "{err}");
    }

    /// A file without trainctl's metadata (saved by PyTorch) is told by its keys.
    #[test]
    fn files_without_metadata_are_recognised_by_their_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let device = crate::device::inference_device();
        for (arch, classes) in [("resnet18", 7), ("resnet50", 3)] {
            let model =
                crate::model::Model::new(Architecture::parse(arch).unwrap(), classes, &device);
            let snap = snapshot(&model);
            let path = dir.path().join(arch);
            std::fs::write(&path, encode(&snap, None, 0, None).unwrap()).unwrap();
            let file = read_model(&path).unwrap();
            assert_eq!(file.info.architecture, arch);
            assert_eq!(file.info.classes.len(), classes);
            assert_eq!(file.info.normalisation, Normalisation::ImageNet);
            assert_eq!(file.tensors(&snap).unwrap().0, snap.params);
        }
        let (seed, _) = model_state();
        let path = dir.path().join("seed");
        std::fs::write(&path, encode(&seed, None, 0, None).unwrap()).unwrap();
        assert_eq!(read_model(&path).unwrap().info, ModelInfo::seed_cifar());
        std::fs::write(
            &path,
            safetensors::serialize(Vec::<(String, TensorView)>::new(), None).unwrap(),
        )
        .unwrap();
        let err = read_model(&path).err().unwrap().to_string();
        assert!(err.contains("neither the seed CNN's"), "{err}");
    }

    /// Sizes in a file's metadata are checked before anything is built from them: a seed CNN
    /// file claiming a 1,000,000-pixel image (which once made `predict` take all the machine's
    /// memory), a ResNet past the largest size, more classes than the classifier has, or none.
    #[test]
    fn metadata_sizes_are_checked_against_the_network_and_the_tensors() {
        let (snap, momentum) = model_state();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let refused = |info: ModelInfo| {
            save_model(&path, &snap, 0, &info).unwrap();
            let model = read_model(&path).err().unwrap().to_string();
            let ckpt = dir.path().join("ckpt");
            save_checkpoint(&ckpt, &snap, &momentum, &progress(), &info).unwrap();
            let checkpoint = load_checkpoint(&ckpt, None).err().unwrap().to_string();
            (model, checkpoint)
        };
        let huge = ModelInfo {
            image_size: 1_000_000,
            ..ModelInfo::seed_cifar()
        };
        let (model, checkpoint) = refused(huge);
        for e in [&model, &checkpoint] {
            assert!(
                e.contains("trainctl.model says image_size 1000000: the seed CNN takes 32×32"),
                "{e}"
            );
        }
        let (model, _) = refused(ModelInfo {
            classes: (0..11).map(|i| i.to_string()).collect(),
            ..ModelInfo::seed_cifar()
        });
        assert!(
            model.contains("names 11 classes but its classifier (network.21.bias) has 10 outputs"),
            "{model}"
        );
        let (model, _) = refused(ModelInfo {
            classes: vec![],
            ..ModelInfo::seed_cifar()
        });
        assert!(
            model.contains("names 0 classes; a model has 1 to 100000"),
            "{model}"
        );
        // A ResNet file past the largest image size.
        let device = crate::device::inference_device();
        let resnet = snapshot(&crate::model::Model::new(
            Architecture::parse("resnet18").unwrap(),
            3,
            &device,
        ));
        let info = ModelInfo {
            architecture: "resnet18".into(),
            classes: vec!["a".into(), "b".into(), "c".into()],
            image_size: 4096,
            normalisation: Normalisation::ImageNet,
        };
        save_model(&path, &resnet, 0, &info).unwrap();
        let e = read_model(&path).err().unwrap().to_string();
        assert!(e.contains("at most 1024×1024 pixels"), "{e}");
        save_model(
            &path,
            &resnet,
            0,
            &ModelInfo {
                image_size: 64,
                ..info
            },
        )
        .unwrap();
        assert_eq!(read_model(&path).unwrap().info.image_size, 64);
    }

    #[test]
    fn model_file_uses_pytorch_names_and_layout() {
        let (snap, _) = model_state();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save_model(&path, &snap, 9, &ModelInfo::seed_cifar()).unwrap();
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
        let file = read_model(&path).unwrap();
        assert_eq!(file.info, ModelInfo::seed_cifar());
        let (params, buffers) = file.tensors(&snap).unwrap();
        assert_eq!(
            (params, buffers),
            (snap.params.clone(), snap.buffers.clone())
        );
    }
}
