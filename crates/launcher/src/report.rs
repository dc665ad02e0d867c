//! What happened to a launch, for the user.

use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitKind {
    Code(i32),
    Signal(i32),
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitKind::Code(c) => write!(f, "exit code {c}"),
            ExitKind::Signal(s) => {
                let name = nix::sys::signal::Signal::try_from(*s).map_or("unknown", |s| s.as_str());
                write!(f, "signal {s} ({name})")
            }
        }
    }
}

/// The first worker to fail: the root cause.
#[derive(Debug, Clone)]
pub struct Failure {
    pub rank: u32,
    pub local_rank: u32,
    pub node_rank: u32,
    pub pid: u32,
    pub exit: ExitKind,
    /// Since this attempt started.
    pub after: Duration,
    /// Restarts before the attempt this failure ended.
    pub restart_count: u32,
    pub stderr_tail: Vec<String>,
    pub log_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone)]
pub enum Outcome {
    Succeeded,
    Failed(Failure),
    /// Stopped by a signal to the launcher (Ctrl-C, SIGTERM); `checkpointed` when a worker saved
    /// a checkpoint before it exited (exit code `contract::exit::PREEMPTED`).
    Interrupted {
        signal: i32,
        checkpointed: bool,
    },
    /// The elastic job failed; the root cause as the first failing node reported it.
    JobFailed(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "worker failed; the other workers were stopped")?;
        writeln!(f, "root cause (first failure):")?;
        writeln!(
            f,
            "  rank       : {} (local rank {}, node {})",
            self.rank, self.local_rank, self.node_rank
        )?;
        writeln!(f, "  pid        : {}", self.pid)?;
        writeln!(f, "  exit       : {}", self.exit)?;
        writeln!(
            f,
            "  after      : {:.1} s (restart count {})",
            self.after.as_secs_f64(),
            self.restart_count
        )?;
        if let Some(log) = &self.log_file {
            writeln!(f, "  log        : {}", log.display())?;
        }
        if self.stderr_tail.is_empty() {
            writeln!(f, "  stderr     : (empty)")?;
        } else {
            writeln!(f, "  last lines of stderr:")?;
            for line in &self.stderr_tail {
                writeln!(f, "    {line}")?;
            }
        }
        Ok(())
    }
}
