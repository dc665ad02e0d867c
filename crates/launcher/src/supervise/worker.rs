//! One worker process: started in its own process group with torchrun's environment, its
//! output pumped line by line, its control channel and telemetry pipe inherited; stopped with
//! SIGTERM, a grace period, then SIGKILL.

use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use collective::control::Channel;

use super::{Outputs, Start};
use crate::output::{Prefix, Tail, pump};
use crate::report::ExitKind;
use crate::telemetry::TelemetryPipe;
use crate::{LaunchError, LaunchSpec, worker_env};

pub(super) struct Worker {
    pub(super) rank: u32,
    pub(super) local_rank: u32,
    pub(super) child: Child,
    pub(super) exited: Option<ExitKind>,
    pub(super) pumps: Vec<JoinHandle<()>>,
    pub(super) tail: Tail,
    pub(super) stderr_log: Option<PathBuf>,
    /// Where its `@record` writes the exception that ends it (`TORCHELASTIC_ERROR_FILE`).
    pub(super) error_file: PathBuf,
    /// The earliest it may have exited: when it was last seen running (wall clock, to be
    /// ordered against error files and other nodes' failures).
    pub(super) exited_at: Option<SystemTime>,
    /// The agent's end of its control channel, when its group may regroup in place.
    pub(super) control: Option<Channel>,
    /// It said it regroups in place (the built-in trainer does; other programs restart).
    pub(super) ready: bool,
    /// Assignments sent to it.
    pub(super) assignments: u64,
    /// Since when it owes an answer to an abort or an assignment (`Lost`, `Regrouped`).
    pub(super) owes_since: Option<Instant>,
    /// The rank its output lines are prefixed with (its rank in the latest round).
    pub(super) prefix: Prefix,
}

impl Worker {
    pub(super) fn pgid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Whether it has exited, and how; `seen_running` is when it was last known to run.
    pub(super) fn poll(&mut self, seen_running: SystemTime) -> Option<&ExitKind> {
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

    pub(super) fn signal_group(&self, signal: Signal) {
        // The group outlives its leader while grandchildren live; ESRCH just means it is gone.
        let _ = killpg(self.pgid(), signal);
    }
}

/// The folders of an attempt's files: its logs (when kept), and its error files (the log
/// folder, or a scratch folder), one sub-folder per rank.
#[derive(Clone, Copy)]
pub(super) struct Files<'a> {
    pub(super) logs: Option<&'a Path>,
    pub(super) errors: &'a Path,
}

/// Whether transparent huge pages were off for this process before
/// [`crate::agent_without_huge_pages`]: what its workers get back.
static THP_DISABLED_BEFORE: AtomicBool = AtomicBool::new(false);

/// Turns transparent huge pages off for the launcher's own process. The agent allocates little,
/// from many threads (the rendezvous' heartbeat and watch, HTTP clients, one output pump per
/// worker), and mimalloc asks for huge pages: each thread's first heap page was a 2 MiB page the
/// kernel zeroed, the largest cost of 256 agents starting together on this 2-core machine
/// (bench/rdzv_scale.py, perf). Workers inherit the setting across exec, so each gets back what
/// this process had (training's large activations like huge pages).
pub fn agent_without_huge_pages() {
    let before = nix::sys::prctl::get_thp_disable().unwrap_or(false);
    THP_DISABLED_BEFORE.store(before, Ordering::Relaxed);
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::debug!(error = %e, "cannot turn transparent huge pages off for the agent");
    }
}

fn rank_dir(dir: &Path, rank: u32) -> Result<PathBuf, LaunchError> {
    let dir = dir.join(rank.to_string());
    std::fs::create_dir_all(&dir).map_err(|source| LaunchError::LogDir {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

pub(super) fn spawn(
    spec: &LaunchSpec,
    local_rank: u32,
    restart_count: u32,
    how: Start,
    files: Files,
    outputs: Outputs,
) -> Result<Worker, LaunchError> {
    // A warm worker has no rank yet: its files go under its local rank, its lines say it is
    // warm, until its assignment.
    let warm = how == Start::Warm;
    let rank = if warm {
        local_rank
    } else {
        spec.rank_offset + local_rank
    };
    // torchrun's name; a file left by an earlier launch into the same folder is not this one's.
    let error_file = rank_dir(files.errors, rank)?.join("error.json");
    let _ = std::fs::remove_file(&error_file);
    let (mut cmd, program) = command(spec, local_rank, restart_count, &error_file, warm);
    let telemetry_fd = outputs.telemetry.and_then(TelemetryPipe::fd);
    if let Some(fd) = telemetry_fd {
        cmd.env(contract::env::TELEMETRY_FD, fd.to_string());
    }
    // The worker's end stays open in this process only until the worker has it.
    let (control, worker_end) = control_channel(how != Start::Plain, rank)?;
    let control_fd = worker_end.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    if let Some(fd) = control_fd {
        cmd.env(contract::env::CONTROL_FD, fd.to_string());
    }
    before_exec(&mut cmd, telemetry_fd, control_fd);
    let (stdout_log, stderr_log) = match files.logs {
        Some(dir) => open_logs(dir, rank)?,
        None => (None, None),
    };
    let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        rank,
        program: program.to_string_lossy().into_owned(),
        source,
    })?;
    drop(worker_end);
    let tail: Tail = Arc::new(Mutex::new(Default::default()));
    let prefix: Prefix = Arc::new(std::sync::atomic::AtomicU32::new(if warm {
        crate::output::WARM | local_rank
    } else {
        rank
    }));
    let stderr_path = stderr_log.as_ref().map(|l| l.1.clone());
    let pumps = start_pumps(
        &mut child,
        rank,
        &prefix,
        &tail,
        outputs,
        stdout_log.map(|l| l.0),
        stderr_log.map(|l| l.0),
    )?;
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
        prefix,
    })
}

/// The worker's command line with torchrun's environment, in its own process group, its
/// output piped and its stdin empty; and the program's name.
fn command(
    spec: &LaunchSpec,
    local_rank: u32,
    restart_count: u32,
    error_file: &Path,
    warm: bool,
) -> (Command, std::ffi::OsString) {
    let program = spec.program.first().cloned().unwrap_or_default();
    let mut cmd = Command::new(&program);
    cmd.args(&spec.program[1..])
        .envs(worker_env(
            spec,
            local_rank,
            restart_count,
            collective::world::is_set("OMP_NUM_THREADS"),
            error_file,
            warm,
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(dir) = &spec.working_dir {
        cmd.current_dir(dir);
    }
    (cmd, program)
}

/// The control channel's two ends (the agent's, the worker's) when the group may regroup in
/// place.
fn control_channel(
    regroup: bool,
    rank: u32,
) -> Result<(Option<Channel>, Option<std::os::fd::OwnedFd>), LaunchError> {
    if !regroup {
        return Ok((None, None));
    }
    let (agent_end, worker_end) = Channel::pair().map_err(|source| LaunchError::Spawn {
        rank,
        program: "control channel".into(),
        source,
    })?;
    Ok((Some(agent_end), Some(worker_end)))
}

/// What the child does between fork and exec: dies with the agent, gets back the agent's
/// transparent huge pages setting, and keeps the telemetry pipe and the control socket open.
fn before_exec(cmd: &mut Command, telemetry_fd: Option<RawFd>, control_fd: Option<RawFd>) {
    let thp_disabled = THP_DISABLED_BEFORE.load(Ordering::Relaxed);
    // SAFETY: prctl and fcntl are async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            // Best effort: a worker without huge pages still works.
            let _ = nix::sys::prctl::set_thp_disable(thp_disabled);
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
}

/// A log file and its path.
type Log = (std::fs::File, PathBuf);

/// Creates the rank's `stdout.log` and `stderr.log` under `dir`.
fn open_logs(dir: &Path, rank: u32) -> Result<(Option<Log>, Option<Log>), LaunchError> {
    let dir = rank_dir(dir, rank)?;
    let open = |name: &str| {
        let path = dir.join(name);
        std::fs::File::create(&path)
            .map(|f| (f, path.clone()))
            .map_err(|source| LaunchError::LogDir { path, source })
    };
    Ok((Some(open("stdout.log")?), Some(open("stderr.log")?)))
}

/// One thread per output stream of `child`, copying its lines (prefixed with the rank) to the
/// launch's sinks and the logs; stderr's last lines kept in `tail`.
fn start_pumps(
    child: &mut Child,
    rank: u32,
    prefix: &Prefix,
    tail: &Tail,
    outputs: Outputs,
    stdout_log: Option<std::fs::File>,
    stderr_log: Option<std::fs::File>,
) -> Result<Vec<JoinHandle<()>>, LaunchError> {
    let Outputs {
        stdout,
        stderr,
        activity,
        ..
    } = outputs;
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
                Arc::clone(prefix),
                stdout.clone(),
                stdout_log,
                None,
                activity.clone(),
            )
            .map_err(pump_error)?,
        );
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(
            pump(
                err,
                Arc::clone(prefix),
                stderr.clone(),
                stderr_log,
                Some(tail.clone()),
                activity.clone(),
            )
            .map_err(pump_error)?,
        );
    }
    Ok(pumps)
}

/// SIGTERM to every worker's group, up to `grace` to exit, then SIGKILL; reaps everything.
pub(super) fn stop_all(workers: &mut [Worker], grace: Duration) {
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
