//! S3 for the commands: a client from the environment, models read from `s3://`, staging with
//! progress, and the uploads at the end of a training run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use objects::{Client, S3Uri, Settings, StageProgress, StageSummary};

/// A client configured by the `AWS_*` environment (credentials, region, `AWS_ENDPOINT_URL`).
pub(crate) fn client() -> anyhow::Result<Client> {
    Ok(Client::from_env(Settings::default())?)
}

/// `text` as an S3 URI, the flag named in the error.
pub(crate) fn parse_uri(flag: &str, text: &str) -> anyhow::Result<S3Uri> {
    text.parse()
        .with_context(|| format!("{flag} {text:?}: expected s3://BUCKET/KEY"))
}

/// A model file given as a path or an `s3://` URI; a downloaded one lives in a temporary
/// folder for as long as this value does.
pub(crate) struct ModelFile {
    pub path: PathBuf,
    _downloaded: Option<tempfile::TempDir>,
}

pub(crate) fn model_file(spec: &Path) -> anyhow::Result<ModelFile> {
    let text = spec.to_string_lossy();
    if !S3Uri::is_s3(&text) {
        return Ok(ModelFile {
            path: spec.to_path_buf(),
            _downloaded: None,
        });
    }
    let uri = parse_uri("--model", &text)?;
    let dir = tempfile::Builder::new()
        .prefix("trainctl-model-")
        .tempdir()
        .context("cannot create a temporary folder for the model")?;
    let path = dir
        .path()
        .join(uri.file_name().unwrap_or("model.safetensors"));
    client()?.download(&uri, &path)?;
    Ok(ModelFile {
        path,
        _downloaded: Some(dir),
    })
}

/// Stages `from` into `dir`, printing progress to stderr (at most about ten lines).
pub(crate) fn stage(client: &Client, from: &S3Uri, dir: &Path) -> anyhow::Result<StageSummary> {
    let mut reported = None;
    let summary = client.stage(from, dir, &mut |p: &StageProgress| {
        let tenth = (p.files_done * 10).checked_div(p.files_total).unwrap_or(10);
        if reported != Some(tenth) && p.files_done > p.skipped {
            reported = Some(tenth);
            crate::output::stage_progress(p);
        }
    })?;
    Ok(summary)
}

/// What `trainctl train --upload` sends: the model, the checkpoint, and the run's report,
/// metrics and TensorBoard events, each under its own name below the prefix.
pub(crate) fn run_files(
    run_dir: &Path,
    model_file: &Path,
    checkpoint_file: &Path,
) -> Vec<(PathBuf, String)> {
    // The model first: it is what the run was for.
    let mut files = Vec::new();
    for file in [model_file, checkpoint_file] {
        if let Some(name) = file.file_name().filter(|_| file.is_file()) {
            files.push((file.to_path_buf(), name.to_string_lossy().into_owned()));
        }
    }
    let first = files.len();
    for folder in ["report", "metrics", "tensorboard"] {
        let mut stack = vec![run_dir.join(folder)];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Ok(relative) = path.strip_prefix(run_dir) {
                    let name = relative.to_string_lossy().replace('\\', "/");
                    files.push((path, name));
                }
            }
        }
    }
    files[first..].sort_by(|a, b| a.1.cmp(&b.1));
    files
}

/// What `upload_all` could not do.
#[derive(Default)]
pub(crate) struct NotUploaded {
    pub failed: Vec<(PathBuf, S3Uri, objects::Error)>,
    /// Files not tried after a refusal that would refuse them too (access denied, a missing
    /// bucket, bad credentials).
    pub not_tried: Vec<PathBuf>,
}

/// Uploads `files` under `to`. Each failed upload is tried again (twice, after 1 and 4 s)
/// unless the error is one waiting will not fix, which also stops the rest. What was not
/// uploaded is returned, never raised: training has succeeded and the local copies stay.
pub(crate) fn upload_all(client: &Client, files: &[(PathBuf, String)], to: &S3Uri) -> NotUploaded {
    let mut not_uploaded = NotUploaded::default();
    for (i, (path, name)) in files.iter().enumerate() {
        let uri = to.join(name);
        let mut attempt = 0;
        loop {
            match client.upload(path, &uri) {
                Ok(transfer) => {
                    crate::output::uploaded(path, &uri, transfer.bytes);
                    break;
                }
                Err(err) if attempt < 2 && transient(&err) => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_secs(4u64.pow(attempt - 1)));
                }
                Err(err) => {
                    let stop = !transient(&err);
                    not_uploaded.failed.push((path.clone(), uri, err));
                    if stop {
                        not_uploaded.not_tried =
                            files[i + 1..].iter().map(|f| f.0.clone()).collect();
                        return not_uploaded;
                    }
                    break;
                }
            }
        }
    }
    not_uploaded
}

/// Errors another attempt may not repeat (the store's, after its own retries),
/// as opposed to a refusal that will stand.
fn transient(err: &objects::Error) -> bool {
    matches!(
        err,
        objects::Error::Store { .. } | objects::Error::Truncated { .. }
    )
}
