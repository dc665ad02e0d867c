//! Spawning, watching and stopping the workers of one node.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use collective::control::{Channel, ToAgent, ToWorker};

use crate::error_file::{self, WorkerError};
use crate::output::{Activity, Sink, Tail, pump};
use crate::report::{ExitKind, Failure, Outcome, Stuck};
use crate::stacks;
use crate::telemetry::TelemetryPipe;
use crate::timer::TimerServer;
use crate::{LaunchError, LaunchEvent, LaunchSpec, Started, worker_env};

struct Worker {
    rank: u32,
    local_rank: u32,
    child: Child,
    exited: Option<ExitKind>,
    pumps: Vec<JoinHandle<()>>,
    tail: Tail,
    stderr_log: Option<PathBuf>,
    /// Where its `@record` writes the exception that ends it (`TORCHELASTIC_ERROR_FILE`).
    error_file: PathBuf,
    /// The earliest it may have exited: when it was last seen running (wall clock, to be
    /// ordered against error files and other nodes' failures).
    exited_at: Option<SystemTime>,
    /// The agent's end of its control channel, when its group may regroup in place.
    control: Option<Channel>,
    /// It said it regroups in place (the built-in trainer does; other programs restart).
    ready: bool,
    /// Assignments sent to it.
    assignments: u64,
    /// Since when it owes an answer to an abort or an assignment (`Lost`, `Regrouped`).
    owes_since: Option<Instant>,
}

impl Worker {
    fn pgid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Whether it has exited, and how; `seen_running` is when it was last known to run.
    fn poll(&mut self, seen_running: SystemTime) -> Option<&ExitKind> {
        if self.exited.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            self.exited_at = Some(seen_running);
            use std::os::unix::process::ExitStatusExt;
            self.exited = Some(match (status.code(), status.signal()) {
                (Some(code), _) => ExitKind::Code(code),
                (None, Some(sig)) => ExitKind::Signal(sig),
                (None, None) => ExitKind::Code(-1),
            });
        }
        self.exited.as_ref()
    }

    fn signal_group(&self, signal: Signal) {
        // The group outlives its leader while grandchildren live; ESRCH just means it is gone.
        let _ = killpg(self.pgid(), signal);
    }
}

/// Signals that stop the whole launch; the handler only records the signal number.
const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];

/// SIGINT, SIGTERM and SIGHUP, recorded instead of obeyed while installed.
pub(crate) struct StopSignals {
    received: Arc<AtomicUsize>,
    handlers: Vec<signal_hook::SigId>,
}

impl StopSignals {
    pub(crate) fn install() -> Result<Self, LaunchError> {
        let received = Arc::new(AtomicUsize::new(0));
        let mut handlers = Vec::new();
        for sig in STOP_SIGNALS {
            let received = received.clone();
            // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
            let id = unsafe {
                signal_hook::low_level::register(sig, move || {
                    received.store(sig as usize, Ordering::SeqCst)
                })
            }
            .map_err(LaunchError::Signals)?;
            handlers.push(id);
        }
        Ok(StopSignals { received, handlers })
    }

    /// The signal received, if any.
    pub(crate) fn received(&self) -> Option<i32> {
        match self.received.load(Ordering::SeqCst) {
            0 => None,
            sig => Some(sig as i32),
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Runs the workers of this node to completion and says how it ended; `events` hears of each
/// worker started and of each restart. A failed group is restarted whole, with
/// TORCHELASTIC_RESTART_COUNT one higher, up to `spec.max_restarts` times.
pub fn launch(
    spec: &LaunchSpec,
    stdout: Sink,
    stderr: Sink,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let launch = Launch::open(spec)?;
    let (signals, timers) = (&launch.signals, launch.timers.as_ref());
    let mut restart_count = 0;
    loop {
        let mut group = Group::spawn(
            spec,
            restart_count,
            restart_count.into(),
            false,
            launch.outputs(&stdout, &stderr),
            events,
        )?;
        let failure = loop {
            if let Some(signal) = signals.received() {
                let checkpointed = group.stop_interrupted(spec.grace);
                return Ok(Outcome::Interrupted {
                    signal,
                    checkpointed,
                });
            }
            match group.poll() {
                Status::Running => std::thread::sleep(spec.monitor_interval),
                Status::Succeeded => {
                    group.stop(spec.grace);
                    return Ok(Outcome::Succeeded);
                }
                Status::Trouble(t) => {
                    break with_timer(group.stop_troubled(spec.grace, t), timers);
                }
            }
        };
        if restart_count >= spec.max_restarts || signals.received().is_some() {
            return Ok(Outcome::Failed(Box::new(failure)));
        }
        restart_count += 1;
        events(LaunchEvent::Restarting {
            failure,
            restart_count,
        });
    }
}

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
    hang_timeout: Option<Duration>,
    /// How long a worker asked to regroup may take to answer.
    regroup_timeout: Duration,
}

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

impl Group {
    /// Starts every local worker of `spec`; `attempt` names the log folder. With `regroup`,
    /// each gets a control channel over which it may offer to regroup in place.
    pub(crate) fn spawn(
        spec: &LaunchSpec,
        restart_count: u32,
        attempt: u64,
        regroup: bool,
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
        outputs.activity.touch();
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
            hang_timeout: spec.hang_timeout,
            regroup_timeout: spec.regroup_timeout,
        };
        let files = Files {
            logs: attempt_dir.as_deref(),
            errors: attempt_dir
                .as_deref()
                .or(scratch.as_deref())
                .unwrap_or(Path::new(".")),
        };
        for local_rank in 0..spec.nproc_per_node {
            match spawn(spec, local_rank, restart_count, regroup, files, outputs) {
                Ok(w) => {
                    events(LaunchEvent::Started(Started {
                        rank: w.rank,
                        local_rank: w.local_rank,
                        pid: w.child.id(),
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
        Ok(group)
    }

    /// What the workers said on their control channels since the last call: (local rank,
    /// message). Reports of leaving a group sent before the worker read its latest assignment
    /// are about a group already replaced, and left out. A channel that fails is left alone:
    /// its worker's exit shows in [`Group::poll`].
    pub(crate) fn messages(&mut self) -> Vec<(u32, ToAgent)> {
        let mut said = Vec::new();
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
                }
                said.push((w.local_rank, message));
            }
        }
        said
    }

    /// Whether every worker is running and has said it regroups in place.
    pub(crate) fn can_regroup(&self) -> bool {
        !self.workers.is_empty() && self.workers.iter().all(|w| w.ready && w.exited.is_none())
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
            let env = worker_env(spec, w.local_rank, restart_count, omp, &w.error_file);
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
        let silent = self.activity.silent_for();
        if self.hang_timeout.is_some_and(|limit| silent >= limit) {
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

    /// Stops the group for `trouble`; returns the root cause.
    pub(crate) fn stop_troubled(self, grace: Duration, trouble: Trouble) -> Failure {
        match trouble {
            Trouble::Failed(f) => self.stop_failed(grace, *f),
            Trouble::Hung(silent) => self.stop_hung(grace, silent, ExitKind::Hung(silent)),
            Trouble::Unanswered(waited) => {
                self.stop_hung(grace, waited, ExitKind::Unanswered(waited))
            }
        }
    }

    /// A hang: every running worker's stack is taken (and written whole beside the logs) before
    /// the group is stopped. The report names where each was; the rank it leads with is one
    /// that is not waiting in a collective, when there is one (the others wait for it).
    fn stop_hung(mut self, grace: Duration, silent: Duration, exit: ExitKind) -> Failure {
        let seen_running = self.last_poll;
        let dumps: Vec<(u32, u32, stacks::Dump)> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.poll(seen_running).is_none().then_some(w))
            .map(|w| (w.rank, w.child.id(), stacks::dump(w.child.id())))
            .collect();
        let stacks_file = self.write_stacks(silent, &dumps);
        let stuck: Vec<Stuck> = dumps
            .iter()
            .map(|(rank, pid, d)| Stuck {
                rank: *rank,
                pid: *pid,
                at: d.innermost(),
            })
            .collect();
        let lead = stuck
            .iter()
            .find(|s| !stacks::in_collective(&s.at))
            .or(stuck.first())
            .map(|s| (s.rank, s.pid));
        // Every worker may have exited since the poll: then the report leads with the first.
        let (rank, pid) = lead
            .or_else(|| self.workers.first().map(|w| (w.rank, w.child.id())))
            .unwrap_or_default();
        let worker = self.workers.iter().find(|w| w.rank == rank);
        let failure = Failure {
            rank,
            local_rank: worker.map_or(0, |w| w.local_rank),
            node_rank: self.node_rank,
            pid,
            exit,
            after: self.start.elapsed(),
            at: SystemTime::now() - silent,
            restart_count: self.restart_count,
            error: None,
            error_file_problem: None,
            stderr_tail: Vec::new(),
            log_file: worker.and_then(|w| w.stderr_log.clone()),
            stuck,
            stacks_file,
            timer: None,
        };
        self.halt(grace);
        failure
    }

    /// Every dump, whole, in `stacks.txt` of the attempt's log folder (or a file beside the
    /// scratch folder, kept): the report has only the innermost frames.
    fn write_stacks(
        &self,
        silent: Duration,
        dumps: &[(u32, u32, stacks::Dump)],
    ) -> Option<PathBuf> {
        let path = match (&self.logs, &self.scratch) {
            (Some(dir), _) => dir.join("stacks.txt"),
            // Beside the scratch folder, which goes with the group (a run id may hold dots, so
            // the name is extended, not its extension replaced).
            (None, Some(scratch)) => {
                let mut name = scratch.file_name()?.to_os_string();
                name.push(".stacks.txt");
                scratch.with_file_name(name)
            }
            (None, None) => return None,
        };
        let mut text = format!(
            "no line of output for {:.1} s; the stacks of node {}'s workers:\n",
            silent.as_secs_f64(),
            self.node_rank
        );
        for (rank, _, dump) in dumps {
            text.push_str(&format!("\nrank {rank}: {dump}"));
        }
        std::fs::write(&path, text).ok().map(|()| path)
    }

    /// Stops every worker still running and collects their output.
    pub(crate) fn stop(mut self, grace: Duration) {
        self.halt(grace);
    }

    /// [`Group::stop`] because the launcher was told to stop; whether a worker saved a checkpoint
    /// on its way out (it exited with `contract::exit::PREEMPTED`).
    pub(crate) fn stop_interrupted(mut self, grace: Duration) -> bool {
        self.halt(grace);
        self.workers
            .iter()
            .any(|w| w.exited == Some(ExitKind::Code(contract::exit::PREEMPTED)))
    }

    /// [`Group::stop`] after `failure`, the first failure this launcher saw; returns the root
    /// cause. That is the earliest failure: what a worker's `@record` wrote, by when it wrote it
    /// (even if that worker was still cleaning up when another exited), or the failure seen.
    /// The report gets the worker's error file, or its last lines of stderr.
    pub(crate) fn stop_failed(mut self, grace: Duration, failure: Failure) -> Failure {
        self.halt(grace);
        let mut root = failure;
        let mut root_recorded = None;
        for w in &self.workers {
            let Some(rec) = recorded(&w.error_file) else {
                continue;
            };
            let earlier = rec.at < root.at;
            if w.rank == root.rank || earlier {
                if w.rank != root.rank {
                    root = Failure {
                        rank: w.rank,
                        local_rank: w.local_rank,
                        pid: w.child.id(),
                        exit: w.exited.clone().unwrap_or(ExitKind::Code(-1)),
                        log_file: w.stderr_log.clone(),
                        ..root
                    };
                }
                root.at = rec.at;
                root_recorded = Some(rec);
            }
        }
        if let Some(rec) = root_recorded {
            root.after = rec.at.duration_since(self.start_wall).unwrap_or(root.after);
            match rec.error {
                Ok(e) => root.error = Some(e),
                Err(problem) => root.error_file_problem = Some(problem),
            }
        }
        if let Some(w) = self.workers.iter().find(|w| w.rank == root.rank) {
            root.stderr_tail = w
                .tail
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect();
        }
        root
    }

    fn halt(&mut self, grace: Duration) {
        stop_all(&mut self.workers, grace);
        // Output pumps end when the pipes close; a grandchild that keeps a pipe open must not
        // hold the launcher, so wait for them only briefly.
        let deadline = Instant::now() + Duration::from_secs(2);
        for w in self.workers.iter_mut() {
            for pump in std::mem::take(&mut w.pumps) {
                while !pump.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if pump.is_finished() {
                    let _ = pump.join();
                }
            }
        }
    }
}

/// Where a group's workers write: their stdout and stderr sinks, and the telemetry pipe.
/// What a launch keeps across its attempts (both `launch` and the elastic agent): the stop
/// signals, the workers' activity clock, the telemetry pipe and the file-timer server.
pub(crate) struct Launch {
    pub signals: StopSignals,
    activity: Arc<Activity>,
    telemetry: Option<TelemetryPipe>,
    pub timers: Option<TimerServer>,
}

impl Launch {
    pub(crate) fn open(spec: &LaunchSpec) -> Result<Launch, LaunchError> {
        let signals = StopSignals::install()?;
        let activity = Arc::new(Activity::default());
        let telemetry = TelemetryPipe::open_for(spec, &activity)?;
        let timers = TimerServer::open_for(spec)?;
        Ok(Launch {
            signals,
            activity,
            telemetry,
            timers,
        })
    }

    /// What an attempt's workers write to, with `stdout` and `stderr`.
    pub(crate) fn outputs<'a>(&'a self, stdout: &'a Sink, stderr: &'a Sink) -> Outputs<'a> {
        Outputs {
            stdout,
            stderr,
            telemetry: self.telemetry.as_ref(),
            timers: self.timers.as_ref(),
            activity: &self.activity,
        }
    }
}

/// What a launch's groups share: where the workers write (stdout and stderr sinks, the
/// telemetry pipe), the file-timer server, and the clock of their last line.
#[derive(Clone, Copy)]
pub(crate) struct Outputs<'a> {
    pub stdout: &'a Sink,
    pub stderr: &'a Sink,
    pub telemetry: Option<&'a TelemetryPipe>,
    pub timers: Option<&'a TimerServer>,
    pub activity: &'a Arc<Activity>,
}

/// `failure` with the file-based timer that expired for its worker, if one did.
pub(crate) fn with_timer(mut failure: Failure, timers: Option<&TimerServer>) -> Failure {
    failure.timer = timers.and_then(|t| t.expired(failure.rank));
    failure
}

/// The folders of an attempt's files: its logs (when kept), and its error files (the log
/// folder, or a scratch folder), one sub-folder per rank.
#[derive(Clone, Copy)]
struct Files<'a> {
    logs: Option<&'a Path>,
    errors: &'a Path,
}

fn rank_dir(dir: &Path, rank: u32) -> Result<PathBuf, LaunchError> {
    let dir = dir.join(rank.to_string());
    std::fs::create_dir_all(&dir).map_err(|source| LaunchError::LogDir {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

fn spawn(
    spec: &LaunchSpec,
    local_rank: u32,
    restart_count: u32,
    regroup: bool,
    files: Files,
    outputs: Outputs,
) -> Result<Worker, LaunchError> {
    let Outputs {
        stdout,
        stderr,
        telemetry,
        activity,
        ..
    } = outputs;
    let rank = spec.rank_offset + local_rank;
    // torchrun's name; a file left by an earlier launch into the same folder is not this one's.
    let error_file = rank_dir(files.errors, rank)?.join("error.json");
    let _ = std::fs::remove_file(&error_file);
    let program = spec.program.first().cloned().unwrap_or_default();
    let mut cmd = Command::new(&program);
    cmd.args(&spec.program[1..])
        .envs(worker_env(
            spec,
            local_rank,
            restart_count,
            collective::world::is_set("OMP_NUM_THREADS"),
            &error_file,
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(dir) = &spec.working_dir {
        cmd.current_dir(dir);
    }
    let telemetry_fd = telemetry.and_then(TelemetryPipe::fd);
    if let Some(fd) = telemetry_fd {
        cmd.env(contract::env::TELEMETRY_FD, fd.to_string());
    }
    // The worker's end stays open in this process only until the worker has it.
    let (control, worker_end) = if regroup {
        let (agent_end, worker_end) = Channel::pair().map_err(|source| LaunchError::Spawn {
            rank,
            program: "control channel".into(),
            source,
        })?;
        (Some(agent_end), Some(worker_end))
    } else {
        (None, None)
    };
    let control_fd = worker_end.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    if let Some(fd) = control_fd {
        cmd.env(contract::env::CONTROL_FD, fd.to_string());
    }
    // SAFETY: prctl and fcntl are async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            // The pipe and the socket are close-on-exec for everyone else; this worker keeps
            // them.
            for fd in [telemetry_fd, control_fd].into_iter().flatten() {
                let fd = std::os::fd::BorrowedFd::borrow_raw(fd);
                nix::fcntl::fcntl(
                    fd,
                    nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
                )
                .map_err(std::io::Error::from)?;
            }
            Ok(())
        });
    }
    let (stdout_log, stderr_log) = match files.logs {
        Some(dir) => {
            let dir = rank_dir(dir, rank)?;
            let open = |name: &str| {
                let path = dir.join(name);
                std::fs::File::create(&path)
                    .map(|f| (f, path.clone()))
                    .map_err(|source| LaunchError::LogDir { path, source })
            };
            (Some(open("stdout.log")?), Some(open("stderr.log")?))
        }
        None => (None, None),
    };
    let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        rank,
        program: program.to_string_lossy().into_owned(),
        source,
    })?;
    drop(worker_end);
    let tail: Tail = Arc::new(Mutex::new(Default::default()));
    let prefix = format!("[{rank}]:");
    let mut pumps = Vec::new();
    let pump_error = |source| LaunchError::Spawn {
        rank,
        program: "output thread".into(),
        source,
    };
    if let Some(out) = child.stdout.take() {
        pumps.push(
            pump(
                out,
                prefix.clone(),
                stdout.clone(),
                stdout_log.map(|l| l.0),
                None,
                activity.clone(),
            )
            .map_err(pump_error)?,
        );
    }
    let stderr_path = stderr_log.as_ref().map(|l| l.1.clone());
    if let Some(err) = child.stderr.take() {
        pumps.push(
            pump(
                err,
                prefix,
                stderr.clone(),
                stderr_log.map(|l| l.0),
                Some(tail.clone()),
                activity.clone(),
            )
            .map_err(pump_error)?,
        );
    }
    Ok(Worker {
        rank,
        local_rank,
        child,
        exited: None,
        pumps,
        tail,
        stderr_log: stderr_path,
        error_file,
        exited_at: None,
        control,
        ready: false,
        assignments: 0,
        owes_since: None,
    })
}

/// SIGTERM to every worker's group, up to `grace` to exit, then SIGKILL; reaps everything.
fn stop_all(workers: &mut [Worker], grace: Duration) {
    for w in workers.iter_mut() {
        if w.poll(SystemTime::now()).is_none() {
            w.signal_group(Signal::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    while workers
        .iter_mut()
        .any(|w| w.poll(SystemTime::now()).is_none())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for w in workers.iter_mut() {
        // Also reaches grandchildren left in the group after the worker itself exited.
        w.signal_group(Signal::SIGKILL);
        if w.exited.is_none() {
            let _ = w.child.wait();
            w.poll(SystemTime::now());
        }
    }
}
