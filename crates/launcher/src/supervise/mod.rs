//! Spawning, watching and stopping the workers of one node: [`Group`] is one attempt's
//! workers (`spawn`, `poll`, the control channels), its stops and their reports live in
//! `stop`, one worker's process in `worker`, and what a launch keeps across attempts (the stop
//! signals, the outputs, torchrun's static restart loop) in `launch`.

mod cpu;
mod launch;
mod stop;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use collective::control::{ToAgent, ToWorker};

use crate::error_file::{self, WorkerError};
use crate::output::Activity;
use crate::report::{ExitKind, Failure};
use crate::{LaunchError, LaunchEvent, LaunchSpec, Started, worker_env};
use cpu::CpuClock;

pub(crate) use launch::{Launch, Outputs, with_timer};
pub use launch::{launch, record_stop_signals, stop_signal};
pub use worker::agent_without_huge_pages;
use worker::{Files, Worker, spawn, stop_all};

/// What a group of workers is doing.
pub(crate) enum Status {
    Running,
    Succeeded,
    Trouble(Trouble),
}

/// Why a group must stop.
pub(crate) enum Trouble {
    /// The first worker that failed.
    Failed(Box<Failure>),
    /// No worker wrote a line for this long (`--hang-timeout`).
    Hung(Duration),
    /// A worker asked to regroup has not answered for this long.
    Unanswered(Duration),
}

/// This node's workers of one attempt.
pub(crate) struct Group {
    workers: Vec<Worker>,
    start: Instant,
    start_wall: SystemTime,
    /// When the workers not yet exited were last seen running.
    last_poll: SystemTime,
    restart_count: u32,
    node_rank: u32,
    /// The folder of the workers' error files when there is no log folder to keep them in,
    /// removed with the group.
    scratch: Option<PathBuf>,
    /// The attempt's log folder, where a hang's stacks go (else beside the scratch folder).
    logs: Option<PathBuf>,
    /// When the workers last wrote a line.
    activity: Arc<Activity>,
    /// When the workers last used the CPU as working processes do.
    cpu: CpuClock,
    hang_timeout: Option<Duration>,
    /// How long a worker asked to regroup may take to answer.
    regroup_timeout: Duration,
    /// Since when a worker has exited as a lost peer's consequence (exit 75) while no local
    /// failure explains it yet.
    consequence_since: Option<Instant>,
    /// What the workers said that [`Group::read_messages`] read and [`Group::messages`] has not
    /// handed over yet.
    said: Vec<(u32, ToAgent)>,
}

/// How long a worker's exit 75 (its peer vanished) waits for a local worker's own failure to
/// show before it is reported: a worker that fails closes its links (and so makes its peers
/// exit 75) a moment before it exits itself.
const CONSEQUENCE_WINDOW: Duration = Duration::from_secs(1);

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(dir) = &self.scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A failure a worker recorded in its error file, and when (the file's modification time: to
/// the nanosecond, where the file's own timestamp has whole seconds).
struct Recorded {
    at: SystemTime,
    error: Result<WorkerError, String>,
}

fn recorded(path: &Path) -> Option<Recorded> {
    let error = match error_file::read(path) {
        Ok(None) => return None,
        Ok(Some(e)) => Ok(e),
        Err(problem) => Err(problem),
    };
    let at = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .or_else(|| {
            let secs = error.as_ref().ok()?.timestamp?;
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        })
        .unwrap_or_else(SystemTime::now);
    Some(Recorded { at, error })
}

/// How a group's workers start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// With the round's environment, no control channel: restarted when the group changes.
    Plain,
    /// With the round's environment and a control channel over which each may offer to
    /// regroup in place.
    InPlace,
    /// Before the node has a place in the job: a control channel, no round's environment
    /// (`contract::env::WARM_START`); each says it is ready, then waits for an assignment.
    Warm,
}

impl Group {
    /// Starts every local worker of `spec` as `how` says; `attempt` names the log folder.
    pub(crate) fn spawn(
        spec: &LaunchSpec,
        restart_count: u32,
        attempt: u64,
        how: Start,
        outputs: Outputs,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> Result<Group, LaunchError> {
        let attempt_dir = spec
            .log_dir
            .as_ref()
            .map(|d| d.join(&spec.run_id).join(format!("attempt_{attempt}")));
        // Without a log folder the error files go to a folder of this attempt's own.
        let scratch = attempt_dir.is_none().then(|| {
            std::env::temp_dir().join(format!(
                "trainctl-{}-{}-attempt_{attempt}",
                spec.run_id,
                std::process::id()
            ))
        });
        let now = SystemTime::now();
        // A new attempt's silence counts from its start.
        outputs.activity.restart();
        let mut group = Group {
            workers: Vec::new(),
            start: Instant::now(),
            start_wall: now,
            last_poll: now,
            restart_count,
            node_rank: spec.node_rank,
            scratch: scratch.clone(),
            logs: attempt_dir.clone(),
            activity: outputs.activity.clone(),
            cpu: CpuClock::new(Vec::new()),
            hang_timeout: spec.hang_timeout,
            regroup_timeout: spec.regroup_timeout,
            consequence_since: None,
            said: Vec::new(),
        };
        let files = Files {
            logs: attempt_dir.as_deref(),
            errors: attempt_dir
                .as_deref()
                .or(scratch.as_deref())
                .unwrap_or(Path::new(".")),
        };
        for local_rank in 0..spec.nproc_per_node {
            match spawn(spec, local_rank, restart_count, how, files, outputs) {
                Ok(w) => {
                    events(LaunchEvent::Started(Started {
                        rank: w.rank,
                        local_rank: w.local_rank,
                        pid: w.child.id(),
                        warm: how == Start::Warm,
                    }));
                    group.workers.push(w);
                }
                Err(e) => {
                    stop_all(&mut group.workers, spec.grace);
                    return Err(e);
                }
            }
        }
        if let Some(timers) = outputs.timers {
            timers.workers(group.workers.iter().map(|w| (w.child.id(), w.rank)));
        }
        // Each worker leads a process group of its own.
        group.cpu = CpuClock::new(group.workers.iter().map(|w| w.child.id() as i32).collect());
        Ok(group)
    }

    /// What the workers said on their control channels since the last call: (local rank,
    /// message). Reports of leaving a group sent before the worker read its latest assignment
    /// are about a group already replaced, and left out. A channel that fails is left alone:
    /// its worker's exit shows in [`Group::poll`].
    pub(crate) fn messages(&mut self) -> Vec<(u32, ToAgent)> {
        self.read_messages();
        std::mem::take(&mut self.said)
    }

    /// Reads what the workers said so far, keeping it for the next [`Group::messages`]: a
    /// worker's word that it regroups counts at once, so that a decision taken before the
    /// messages are acted on (a SIGTERM's: leave, or stop the whole job) knows every worker
    /// that has said it.
    pub(crate) fn read_messages(&mut self) {
        let said = &mut self.said;
        for w in &mut self.workers {
            let Some(channel) = w.control.as_mut() else {
                continue;
            };
            while let Ok(Some(message)) = channel.recv::<ToAgent>(Duration::ZERO) {
                match &message {
                    ToAgent::Ready => w.ready = true,
                    // It is not hung, but it still owes an answer about the latest round.
                    ToAgent::Lost { assignments, .. } | ToAgent::Paused { assignments, .. }
                        if *assignments < w.assignments =>
                    {
                        w.owes_since = Some(Instant::now());
                        continue;
                    }
                    // Left its group for the assignment: the answer is still to come.
                    ToAgent::Paused { .. } => {}
                    ToAgent::Lost { .. } | ToAgent::Regrouped(_) => w.owes_since = None,
                    ToAgent::Straggler { .. } | ToAgent::Finished => {}
                }
                said.push((w.local_rank, message));
            }
        }
    }

    /// How many rounds the workers were handed in place (local rank 0's count; all alike).
    pub(crate) fn assignments(&self) -> u64 {
        self.workers.first().map_or(0, |w| w.assignments)
    }

    /// Whether every worker is running and has said it regroups in place.
    pub(crate) fn can_regroup(&self) -> bool {
        !self.workers.is_empty() && self.workers.iter().all(|w| w.ready && w.exited.is_none())
    }

    /// Whether the workers are still starting: started less than `within` ago, none has
    /// exited, and not all have said they regroup in place yet.
    pub(crate) fn starting(&self, within: Duration) -> bool {
        self.start.elapsed() < within
            && self.workers.iter().all(|w| w.exited.is_none())
            && !self.can_regroup()
    }

    /// Asks every worker to leave its group now, dropping the step in flight (a node of the
    /// group is gone), and wait for [`Group::assign`].
    pub(crate) fn abort(&mut self) {
        for w in &mut self.workers {
            if let Some(channel) = w.control.as_mut() {
                // A worker that is gone shows in the next poll.
                let _ = channel.send(&ToWorker::Abort);
                w.owes_since.get_or_insert_with(Instant::now);
            }
        }
    }

    /// Asks every worker to leave the job after the step under way (this node goes); they
    /// exit once every rank has finished that step.
    pub(crate) fn leave(&mut self) {
        for w in &mut self.workers {
            if let Some(channel) = w.control.as_mut() {
                // A worker that is gone shows in the next poll.
                let _ = channel.send(&ToWorker::Leave);
            }
        }
    }

    /// Waits up to `wait` for every worker to exit: `Some(true)` when all exited 0 (the job
    /// ended), `Some(false)` when all exited otherwise, `None` when one still runs.
    pub(crate) fn wait_exited(&mut self, wait: Duration) -> Option<bool> {
        let deadline = Instant::now() + wait;
        loop {
            let now = SystemTime::now();
            let mut running = 0;
            for w in &mut self.workers {
                running += w.poll(now).is_none() as usize;
            }
            if running == 0 {
                return Some(
                    self.workers
                        .iter()
                        .all(|w| w.exited == Some(ExitKind::Code(0))),
                );
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Hands every worker its place in the round `spec` describes (the environment it would
    /// be started with); one still training takes it after the step under way, all ranks the
    /// same one (the pause rides the step's all-reduce). False when one could not be told (it
    /// exited): the group must then be started again.
    pub(crate) fn assign(&mut self, spec: &LaunchSpec, restart_count: u32) -> bool {
        if !self.can_regroup() {
            return false;
        }
        self.restart_count = restart_count;
        self.node_rank = spec.node_rank;
        let omp = collective::world::is_set("OMP_NUM_THREADS");
        for w in &mut self.workers {
            let env = worker_env(spec, w.local_rank, restart_count, omp, &w.error_file, false);
            let told = w
                .control
                .as_mut()
                .is_some_and(|c| c.send(&ToWorker::Assign(env)).is_ok());
            if !told {
                return false;
            }
            w.assignments += 1;
            w.owes_since.get_or_insert_with(Instant::now);
            w.rank = spec.rank_offset + w.local_rank;
            // Its next lines carry its new rank (the line that reports the regroup included).
            w.prefix.store(w.rank, std::sync::atomic::Ordering::Relaxed);
        }
        true
    }

    pub(crate) fn poll(&mut self) -> Status {
        let seen_running = self.last_poll;
        self.last_poll = SystemTime::now();
        let mut running = 0;
        // A worker that exited because its peer vanished (contract::exit::PEER_LOST) is a consequence:
        // when the peer's own failure is seen in the same poll, that one is the root cause.
        let mut failed: Option<&Worker> = None;
        for w in self.workers.iter_mut() {
            match w.poll(seen_running) {
                None => running += 1,
                Some(ExitKind::Code(0)) => {}
                Some(exit) => {
                    let consequence = *exit == ExitKind::Code(contract::exit::PEER_LOST);
                    let better = failed.is_none_or(|f| {
                        f.exited == Some(ExitKind::Code(contract::exit::PEER_LOST)) && !consequence
                    });
                    if better {
                        failed = Some(w);
                    }
                }
            }
        }
        // Only consequences so far, others still running: the failure they are a consequence of
        // may be a local worker that closed its links before it exited. Give it a moment to
        // show, so that the report names it and not the bystander.
        let only_consequences =
            failed.is_some_and(|f| f.exited == Some(ExitKind::Code(contract::exit::PEER_LOST)));
        if only_consequences && running > 0 {
            let since = *self.consequence_since.get_or_insert_with(Instant::now);
            if since.elapsed() < CONSEQUENCE_WINDOW {
                return Status::Running;
            }
        }
        if let Some(w) = failed {
            return Status::Trouble(Trouble::Failed(Box::new(Failure {
                rank: w.rank,
                local_rank: w.local_rank,
                node_rank: self.node_rank,
                pid: w.child.id(),
                exit: w.exited.clone().expect("a failed worker has exited"),
                after: self.start.elapsed(),
                at: w.exited_at.unwrap_or(seen_running),
                restart_count: self.restart_count,
                error: None,
                error_file_problem: None,
                stderr_tail: Vec::new(),
                log_file: w.stderr_log.clone(),
                stuck: Vec::new(),
                stacks_file: None,
                timer: None,
            })));
        }
        if running == 0 {
            return Status::Succeeded;
        }
        // Hung: no sign of progress for the timeout, neither a line nor CPU time (a start,
        // importing torch or loading a model, works however silent; a wait in a collective or
        // a sleep does not, however early).
        if self.hang_timeout.is_some() {
            self.cpu.sample();
        }
        let silent = self.activity.silent_for().min(self.cpu.idle_for());
        if self.hang_timeout.is_some_and(|l| silent >= l) {
            return Status::Trouble(Trouble::Hung(silent));
        }
        let owed = self.workers.iter().filter_map(|w| w.owes_since).min();
        if let Some(waited) = owed.map(|since| since.elapsed())
            && waited >= self.regroup_timeout
        {
            return Status::Trouble(Trouble::Unanswered(waited));
        }
        Status::Running
    }
}
