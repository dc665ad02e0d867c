use std::path::PathBuf;

/// Everything that can stop a training, evaluation or prediction run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {problem}")]
    BadData { path: PathBuf, problem: String },
    #[error("checkpoint {path}: {problem}")]
    BadCheckpoint { path: PathBuf, problem: String },
    #[error("model file {path}: {problem}")]
    BadModel { path: PathBuf, problem: String },
    #[error("download of {url} failed: {problem}")]
    Download { url: String, problem: String },
    #[error(
        "loss is {value} at epoch {epoch}, step {step} (global step {global_step}): training diverged; lower --learning-rate or check the data"
    )]
    NonFiniteLoss {
        value: f32,
        epoch: usize,
        step: usize,
        global_step: u64,
    },
    #[error("invalid setting: {0}")]
    Config(String),
    /// Asked to stop (SIGTERM): the step in progress was finished and checkpointed.
    #[error(
        "stopped on request after step {global_step} (epoch {epoch}); the checkpoint holds it: run the same command again to resume there"
    )]
    Preempted { global_step: u64, epoch: usize },
    /// Asked to stop (SIGTERM) before this worker trained a step: nothing of its to save.
    #[error("stopped on request {0}")]
    Stopped(String),
    #[error(transparent)]
    Collective(#[from] collective::CollectiveError),
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// Attaches the path to an I/O error.
pub(crate) trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}
