//! Model files: the final model as PyTorch-named safetensors described by [`ModelInfo`],
//! written by a run and read by `eval` and `predict` (also when PyTorch or torchvision wrote
//! them).

use std::collections::HashMap;
use std::path::Path;

use crate::error::{IoContext, Result, TrainError};
use crate::model::Snapshot;

use super::atomic::write_atomic;
use super::info::{MODEL_KEY, ModelInfo};
use super::tensors::{decode, encode, to_json};
use super::training::MAGIC;

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
