//! Spawning, watching and stopping the workers of one node.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::output::{Sink, Tail, pump};
use crate::report::{ExitKind, Failure, Outcome};
use crate::telemetry::TelemetryPipe;
use crate::{LaunchError, LaunchEvent, LaunchSpec, Started, worker_env};

struct Worker {
    rank: u32,
    local_rank: u32,
    child: Child,
    exited: Option<ExitKind>,
    pumps: Vec<JoinHandle<()>>,
    tail: Tail,
    stderr_log: Option<std::path::PathBuf>,
}

impl Worker {
    fn pgid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    fn poll(&mut self) -> Option<&ExitKind> {
        if self.exited.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
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
    let signals = StopSignals::install()?;
    let telemetry = TelemetryPipe::open_for(spec)?;
    let mut restart_count = 0;
    loop {
        let mut group = Group::spawn(
            spec,
            restart_count,
            restart_count.into(),
            (&stdout, &stderr, telemetry.as_ref()),
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
                Status::Failed(f) => break group.stop_failed(spec.grace, f),
            }
        };
        if restart_count >= spec.max_restarts || signals.received().is_some() {
            return Ok(Outcome::Failed(failure));
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
    /// The first worker that failed.
    Failed(Failure),
}

/// This node's workers of one attempt.
pub(crate) struct Group {
    workers: Vec<Worker>,
    start: Instant,
    restart_count: u32,
    node_rank: u32,
}

impl Group {
    /// Starts every local worker of `spec`; `attempt` names the log folder.
    pub(crate) fn spawn(
        spec: &LaunchSpec,
        restart_count: u32,
        attempt: u64,
        outputs: Outputs,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> Result<Group, LaunchError> {
        let attempt_dir = spec
            .log_dir
            .as_ref()
            .map(|d| d.join(&spec.run_id).join(format!("attempt_{attempt}")));
        let mut group = Group {
            workers: Vec::new(),
            start: Instant::now(),
            restart_count,
            node_rank: spec.node_rank,
        };
        for local_rank in 0..spec.nproc_per_node {
            match spawn(
                spec,
                local_rank,
                restart_count,
                attempt_dir.as_deref(),
                outputs,
            ) {
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
        Ok(group)
    }

    pub(crate) fn poll(&mut self) -> Status {
        let mut running = 0;
        // A worker that exited because its peer vanished (contract::exit::PEER_LOST) is a consequence:
        // when the peer's own failure is seen in the same poll, that one is the root cause.
        let mut failed: Option<&Worker> = None;
        for w in self.workers.iter_mut() {
            match w.poll() {
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
            return Status::Failed(Failure {
                rank: w.rank,
                local_rank: w.local_rank,
                node_rank: self.node_rank,
                pid: w.child.id(),
                exit: w.exited.clone().expect("a failed worker has exited"),
                after: self.start.elapsed(),
                restart_count: self.restart_count,
                stderr_tail: Vec::new(),
                log_file: w.stderr_log.clone(),
            });
        }
        if running == 0 {
            Status::Succeeded
        } else {
            Status::Running
        }
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

    /// [`Group::stop`] after `failure`, whose report gets the worker's last lines of stderr.
    pub(crate) fn stop_failed(mut self, grace: Duration, mut failure: Failure) -> Failure {
        self.halt(grace);
        if let Some(w) = self.workers.iter().find(|w| w.rank == failure.rank) {
            failure.stderr_tail = w
                .tail
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect();
        }
        failure
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
pub(crate) type Outputs<'a> = (&'a Sink, &'a Sink, Option<&'a TelemetryPipe>);

fn spawn(
    spec: &LaunchSpec,
    local_rank: u32,
    restart_count: u32,
    attempt_dir: Option<&std::path::Path>,
    (stdout, stderr, telemetry): Outputs,
) -> Result<Worker, LaunchError> {
    let rank = spec.rank_offset + local_rank;
    let program = spec.program.first().cloned().unwrap_or_default();
    let mut cmd = Command::new(&program);
    cmd.args(&spec.program[1..])
        .envs(worker_env(
            spec,
            local_rank,
            restart_count,
            collective::world::is_set("OMP_NUM_THREADS"),
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
    // SAFETY: prctl and fcntl are async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            if let Some(fd) = telemetry_fd {
                // The pipe is close-on-exec for everyone else; this worker keeps it.
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
    let (stdout_log, stderr_log) = match attempt_dir {
        Some(dir) => {
            let dir = dir.join(rank.to_string());
            std::fs::create_dir_all(&dir).map_err(|source| LaunchError::LogDir {
                path: dir.clone(),
                source,
            })?;
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
    })
}

/// SIGTERM to every worker's group, up to `grace` to exit, then SIGKILL; reaps everything.
fn stop_all(workers: &mut [Worker], grace: Duration) {
    for w in workers.iter_mut() {
        if w.poll().is_none() {
            w.signal_group(Signal::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    while workers.iter_mut().any(|w| w.poll().is_none()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for w in workers.iter_mut() {
        // Also reaches grandchildren left in the group after the worker itself exited.
        w.signal_group(Signal::SIGKILL);
        if w.exited.is_none() {
            let _ = w.child.wait();
            w.poll();
        }
    }
}
