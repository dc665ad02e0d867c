//! Entry points for the fuzz targets (`fuzz/`): the decoders of what staging reads from S3 and
//! from the destination folder, as the crate uses them. Not an API.

use std::path::{Path, PathBuf};

/// The stage journal's text: how many lines it keeps (by key).
pub fn journal(text: &str) -> usize {
    super::stage::parse_journal(text).len()
}

/// Where an object of the staged prefix would land under `dir` (S3 keys come from the
/// listing: network input), or why it is refused.
pub fn stage_path(dir: &Path, relative: &str) -> Result<PathBuf, String> {
    super::stage::local_path(dir, relative)
}
