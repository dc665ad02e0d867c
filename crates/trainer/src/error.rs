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
    /// The node's local rank 0 (rank `leader`), which gets the data set for the node's
    /// workers, failed (its own error says so too) or went silent.
    #[error("no data set for this worker: rank {leader}, which gets it for this node, {problem}")]
    NodeData { leader: u32, problem: String },
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
    #[error("stopped on request after step {global_step} (epoch {epoch}); the checkpoint holds it")]
    Preempted { global_step: u64, epoch: usize },
    /// Its node was asked to go (SIGTERM) and the others train on without it: this worker left
    /// after the step every rank paused at, holding nothing they lack.
    #[error(
        "left the job after step {global_step} (epoch {epoch}): this node was asked to go, and the others train on without it"
    )]
    Left { global_step: u64, epoch: usize },
    /// The checkpoint holds a run that finished (trained, saved, evaluated): nothing to
    /// resume, and training it again must be asked for.
    #[error(
        "{path} holds a finished run ({epochs} epochs, step {global_step}; its model is {model}): nothing to resume. To train again from scratch pass --train-again (both files are replaced), to train on from it raise --epochs, or give the new run another --out or run id"
    )]
    Finished {
        path: PathBuf,
        epochs: usize,
        global_step: u64,
        model: PathBuf,
    },
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
