//! The command line of a training pod, typed: `trainctl run FLAGS... train ARGS...` (the
//! built-in trainer) or `trainctl run FLAGS... -- PROGRAM ARGS...` (the user's program).
//! deploy builds these and renders them with `to_argv`; the CLI's parsers read them back (a
//! round-trip test in the CLI parses every variant and compares field by field).

use crate::choices::{HealthCheck, Model, Precision, Stragglers};

/// One flag of `trainctl run` that a pod sets. The order of a [`RunArgs`]'s flags is the order
/// they are written in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunFlag {
    /// `N`, or `MIN:MAX` for an elastic job.
    Nnodes(String),
    NprocPerNode(u32),
    RdzvBackend(crate::rdzv::Backend),
    /// `HOST:PORT`.
    RdzvEndpoint(String),
    RdzvId(String),
    MaxRestarts(u32),
    MetricsPort(u16),
    /// Seconds the workers get between SIGTERM and SIGKILL.
    GracePeriod(u64),
    /// An `s3://` prefix copied next to the workers before they start (repeatable).
    Fetch(String),
    FetchDir(String),
    /// Where the launcher writes a failure's root cause (Kubernetes' `terminationMessagePath`).
    TerminationLog(String),
    /// Seconds without progress (a line of output or CPU time) after which the workers are hung.
    HangTimeout(u32),
    /// What the job does about a node its ranks find slow.
    Stragglers(Stragglers),
    /// What a node far below the others in its health check does.
    HealthCheck(HealthCheck),
}

impl RunFlag {
    /// The flag as `trainctl run` spells it.
    pub fn flag(&self) -> &'static str {
        match self {
            RunFlag::Nnodes(_) => "--nnodes",
            RunFlag::NprocPerNode(_) => "--nproc-per-node",
            RunFlag::RdzvBackend(_) => "--rdzv-backend",
            RunFlag::RdzvEndpoint(_) => "--rdzv-endpoint",
            RunFlag::RdzvId(_) => "--rdzv-id",
            RunFlag::MaxRestarts(_) => "--max-restarts",
            RunFlag::MetricsPort(_) => "--metrics-port",
            RunFlag::GracePeriod(_) => "--grace-period",
            RunFlag::Fetch(_) => "--fetch",
            RunFlag::FetchDir(_) => "--fetch-dir",
            RunFlag::TerminationLog(_) => "--termination-log",
            RunFlag::HangTimeout(_) => "--hang-timeout",
            RunFlag::Stragglers(_) => "--stragglers",
            RunFlag::HealthCheck(_) => "--health-check",
        }
    }

    pub fn value(&self) -> String {
        match self {
            RunFlag::RdzvBackend(b) => b.to_string(),
            RunFlag::Nnodes(s)
            | RunFlag::RdzvEndpoint(s)
            | RunFlag::RdzvId(s)
            | RunFlag::Fetch(s)
            | RunFlag::FetchDir(s)
            | RunFlag::TerminationLog(s) => s.clone(),
            RunFlag::Stragglers(s) => s.to_string(),
            RunFlag::HealthCheck(h) => h.to_string(),
            RunFlag::NprocPerNode(n) | RunFlag::MaxRestarts(n) | RunFlag::HangTimeout(n) => {
                n.to_string()
            }
            RunFlag::MetricsPort(p) => p.to_string(),
            RunFlag::GracePeriod(s) => s.to_string(),
        }
    }
}

/// What `trainctl run` starts on each node.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// `trainctl train ...`.
    Train(TrainArgs),
    /// The user's program and its arguments, after `--`.
    Program(Vec<String>),
}

/// `trainctl run FLAGS... TARGET`.
#[derive(Debug, Clone, PartialEq)]
pub struct RunArgs {
    pub flags: Vec<RunFlag>,
    pub target: Target,
}

impl RunArgs {
    /// The arguments after the binary's name: `run`, the flags in order, then `train ...` or
    /// `-- PROGRAM ...`.
    pub fn to_argv(&self) -> Vec<String> {
        let mut argv = vec!["run".to_string()];
        for flag in &self.flags {
            argv.extend([flag.flag().to_string(), flag.value()]);
        }
        match &self.target {
            Target::Train(train) => argv.extend(train.to_argv()),
            Target::Program(program) => {
                argv.push("--".into());
                argv.extend(program.iter().cloned());
            }
        }
        argv
    }
}

/// The `trainctl train` arguments a job's pods run with; the rest keep the CLI's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainArgs {
    /// The default (the seed CNN) is not written.
    pub model: Model,
    pub data: String,
    pub out: String,
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
    /// Fail instead of downloading when the data is missing (a job's data job stages it).
    pub no_download: bool,
    /// `s3://` prefix the model, checkpoint and run files go to when training ends.
    pub upload: Option<String>,
    /// Not written when the default (fp32).
    pub precision: Precision,
    /// `--train-again`: a checkpoint holding a finished run is trained again from scratch
    /// instead of refused.
    pub train_again: bool,
}

impl TrainArgs {
    /// `train` and its flags.
    pub fn to_argv(&self) -> Vec<String> {
        let mut argv = vec!["train".to_string()];
        if self.model != Model::default() {
            argv.extend(["--model".into(), self.model.to_string()]);
        }
        argv.extend([
            "--data".into(),
            self.data.clone(),
            "--out".into(),
            self.out.clone(),
            "--epochs".into(),
            self.epochs.to_string(),
            "--batch-size".into(),
            self.batch_size.to_string(),
            "--lr".into(),
            self.learning_rate.to_string(),
        ]);
        if self.no_download {
            argv.push("--no-download".into());
        }
        if let Some(upload) = &self.upload {
            argv.extend(["--upload".into(), upload.clone()]);
        }
        if self.precision != Precision::default() {
            argv.extend(["--precision".into(), self.precision.to_string()]);
        }
        if self.train_again {
            argv.push("--train-again".into());
        }
        argv
    }
}
