//! What happened to a launch, for the user.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::error_file::WorkerError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitKind {
    Code(i32),
    Signal(i32),
    /// Stopped by the launcher: no worker of the node wrote a line for this long
    /// (`--hang-timeout`).
    Hung(Duration),
    /// Stopped by the elastic agent: asked to regroup, the worker did not answer for this long
    /// (it waits in a collective, or is stopped).
    Unanswered(Duration),
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitKind::Code(c) => write!(f, "exit code {c}"),
            ExitKind::Signal(s) => {
                let name = nix::sys::signal::Signal::try_from(*s).map_or("unknown", |s| s.as_str());
                write!(f, "signal {s} ({name})")
            }
            ExitKind::Hung(silent) => write!(
                f,
                "stopped after {:.0} s without a line of output or CPU time (--hang-timeout)",
                silent.as_secs_f64()
            ),
            ExitKind::Unanswered(waited) => write!(
                f,
                "stopped after not answering its agent's regroup for {:.0} s",
                waited.as_secs_f64()
            ),
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
    /// When it failed (wall clock, so that nodes' failures can be ordered): when its `@record`
    /// wrote the error file, else when the launcher last saw it running.
    pub at: SystemTime,
    /// Restarts before the attempt this failure ended.
    pub restart_count: u32,
    /// What its error file says (`TORCHELASTIC_ERROR_FILE`), when it wrote one.
    pub error: Option<WorkerError>,
    /// Why its error file could not be used, when it could not.
    pub error_file_problem: Option<String>,
    pub stderr_tail: Vec<String>,
    pub log_file: Option<std::path::PathBuf>,
    /// For a hang: where each of the node's workers was, from its stack.
    pub stuck: Vec<Stuck>,
    /// For a hang: every worker's whole stacks.
    pub stacks_file: Option<std::path::PathBuf>,
    /// The file-based timer that expired for it, when one did.
    pub timer: Option<crate::timer::Expired>,
}

/// Where a hung worker was when its stack was taken.
#[derive(Debug, Clone)]
pub struct Stuck {
    pub rank: u32,
    pub pid: u32,
    /// Its main thread's innermost frames (`file:line in function: source`), or why none.
    pub at: String,
}

impl Failure {
    /// Whether no retry can fix it: the program said so (`contract::exit::UNRECOVERABLE`, or
    /// its error file marked so).
    pub fn unrecoverable(&self) -> bool {
        self.exit == ExitKind::Code(contract::exit::UNRECOVERABLE)
            || self.error.as_ref().is_some_and(|e| e.unrecoverable)
    }

    /// How it bears on an elastic job: a lost peer is another node's failure, a preempted
    /// worker saved its work (neither counted), and an unrecoverable one ends the job.
    pub fn kind(&self) -> rendezvous::FailureKind {
        let consequence = [contract::exit::PEER_LOST, contract::exit::PREEMPTED]
            .iter()
            .any(|code| self.exit == ExitKind::Code(*code));
        if self.unrecoverable() {
            rendezvous::FailureKind::Unrecoverable
        } else if consequence {
            rendezvous::FailureKind::Uncounted
        } else {
            rendezvous::FailureKind::Counted
        }
    }

    /// `at` in milliseconds since the Unix epoch (what the rendezvous record compares).
    pub fn at_millis(&self) -> u64 {
        self.at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// One line: which rank failed and why, for the first line of the report and the reason
    /// other nodes are given for a new round.
    pub fn summary(&self) -> String {
        if let ExitKind::Hung(silent) | ExitKind::Unanswered(silent) = self.exit {
            let what = match self.exit {
                ExitKind::Hung(_) => "no line of output or CPU time",
                _ => "no answer to a regroup",
            };
            let ranks: Vec<String> = self.stuck.iter().map(|s| s.rank.to_string()).collect();
            let ranks = match ranks.len() {
                1 => format!("rank {}", ranks[0]),
                _ => format!("ranks {}", ranks.join(", ")),
            };
            return format!(
                "{ranks} hung: {what} for {:.0} s; rank {} at {}",
                silent.as_secs_f64(),
                self.rank,
                self.stuck
                    .iter()
                    .find(|s| s.rank == self.rank)
                    .map_or("?", |s| s.at.as_str())
            );
        }
        if let Some(t) = &self.timer {
            return format!("rank {} (pid {}) failed: its {t}", self.rank, self.pid);
        }
        match &self.error {
            Some(e) => {
                let place = e
                    .frames
                    .last()
                    .map(|f| format!(" at {}:{} in {}", f.file, f.line, f.function))
                    .unwrap_or_default();
                format!(
                    "rank {} (pid {}) failed: {}{place}",
                    self.rank, self.pid, e.message
                )
            }
            None => format!(
                "rank {} (pid {}) failed with {}",
                self.rank, self.pid, self.exit
            ),
        }
    }
}

#[derive(Debug, Clone)]
pub enum Outcome {
    Succeeded,
    Failed(Box<Failure>),
    /// Stopped by a signal to the launcher (Ctrl-C, SIGTERM); `checkpointed` when a worker saved
    /// a checkpoint before it exited (exit code `contract::exit::PREEMPTED`).
    Interrupted {
        signal: i32,
        checkpointed: bool,
    },
    /// The elastic job failed; the root cause as the first failing node reported it.
    JobFailed(String),
    /// This node was asked to go (`signal`, SIGTERM) and left the job at a step boundary;
    /// the others train on without it.
    Left {
        signal: i32,
    },
    /// This node was a straggler and left the job (`--stragglers evict`) at a step boundary;
    /// the others train on without it. `report` says how slow it was and why.
    Evicted {
        report: String,
    },
    /// This node's health check was far below the other nodes' (`report`, with the figures):
    /// it did not join (`--health-check refuse`).
    Refused {
        report: String,
    },
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stopped = match self.exit {
            ExitKind::Hung(_) | ExitKind::Unanswered(_) => {
                "its stacks were taken and the workers stopped"
            }
            _ => "the other workers were stopped",
        };
        writeln!(f, "{}; {stopped}", self.summary())?;
        if self.unrecoverable() {
            writeln!(
                f,
                "not retried: the program found it cannot train right (exit {}), and would fail \
                 the same way again",
                contract::exit::UNRECOVERABLE
            )?;
        }
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
        if let Some(e) = &self.error {
            writeln!(f, "  error      : {}", e.message)?;
            for line in &e.more {
                writeln!(f, "               {line}")?;
            }
            if !e.frames.is_empty() {
                writeln!(f, "  traceback  : (innermost last)")?;
                for frame in &e.frames {
                    writeln!(f, "    {frame}")?;
                }
            }
        }
        if let Some(t) = &self.timer {
            writeln!(f, "  timer      : {t}")?;
        }
        if !self.stuck.is_empty() {
            writeln!(f, "  stuck      : (innermost frames first)")?;
            for s in &self.stuck {
                writeln!(f, "    rank {} (pid {}): {}", s.rank, s.pid, s.at)?;
            }
        }
        if let Some(stacks) = &self.stacks_file {
            writeln!(f, "  stacks     : {}", stacks.display())?;
        }
        if let Some(problem) = &self.error_file_problem {
            writeln!(f, "  error file : {problem}")?;
        }
        if let Some(log) = &self.log_file {
            writeln!(f, "  log        : {}", log.display())?;
        }
        // The error file (or the stacks of a hang) says why; without one, the last lines of
        // stderr are the best clue.
        if self.error.is_none() && self.stuck.is_empty() {
            if self.stderr_tail.is_empty() {
                writeln!(f, "  stderr     : (empty)")?;
            } else {
                writeln!(f, "  last lines of stderr:")?;
                for line in &self.stderr_tail {
                    writeln!(f, "    {line}")?;
                }
            }
        }
        Ok(())
    }
}
