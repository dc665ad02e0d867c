//! Entry points for the fuzz targets (`fuzz/`): the decoders of what the trainer reads from
//! files, over bytes, as the crate uses them. Not an API.

use std::path::{Path, PathBuf};

use crate::checkpoint;
use crate::data::Split;
use crate::data::folder::{self, Layout};

/// A model file's bytes (safetensors header, `trainctl.model` metadata, tensors): the network
/// and class count they describe, or why they are refused.
pub fn model_file(bytes: &[u8]) -> Result<(String, usize), String> {
    checkpoint::describe_model(bytes).map(|info| (info.architecture, info.classes.len()))
}

/// A checkpoint file's bytes, read against the network it describes: its global step.
pub fn checkpoint(bytes: &[u8]) -> Result<u64, String> {
    checkpoint::parse_checkpoint(bytes, None).map(|c| c.progress.global_step)
}

/// `payload` in a checkpoint's envelope with a correct length and checksum, so that a fuzzer
/// reaches the safetensors and metadata inside.
pub fn checkpoint_envelope(payload: &[u8]) -> Vec<u8> {
    checkpoint::envelope(payload)
}

/// tiny-imagenet's `val_annotations.txt`: (file, WNID) for each line.
pub fn val_annotations(text: &str) -> Result<Vec<(String, String)>, String> {
    Ok(folder::parse_annotations(text)?
        .into_iter()
        .map(|a| (a.file.to_string(), a.id.to_string()))
        .collect())
}

/// tiny-imagenet's `words.txt`: how many classes it names.
pub fn words(text: &str) -> usize {
    folder::parse_words(text).len()
}

/// The data set found in `dir` (an image folder or tiny-imagenet-200), both splits scanned:
/// every image file it would read.
pub fn image_folder(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let layout = Layout::locate(dir).ok_or_else(|| "no data set there".to_string())?;
    let mut files = Vec::new();
    for split in [Split::Train, Split::Eval] {
        let (_, images) = layout.scan(split, 8, 0).map_err(|e| e.to_string())?;
        files.extend((0..images.len()).map(|i| images.path(i).to_path_buf()));
    }
    Ok(files)
}
