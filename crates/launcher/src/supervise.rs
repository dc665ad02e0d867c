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

/// Runs the workers of this node to completion and says how it ended; `events` hears of each
/// worker started and of each restart. A failed group is restarted whole, with
/// TORCHELASTIC_RESTART_COUNT one higher, up to `spec.max_restarts` times.
pub fn launch(
    spec: &LaunchSpec,
    stdout: Sink,
    stderr: Sink,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
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
    let mut restart_count = 0;
    let result = loop {
        match run_workers(
            spec,
            restart_count,
            stdout.clone(),
            stderr.clone(),
            &received,
            events,
        ) {
            Ok(Outcome::Failed(failure))
                if restart_count < spec.max_restarts && received.load(Ordering::SeqCst) == 0 =>
            {
                restart_count += 1;
                events(LaunchEvent::Restarting {
                    failure,
                    restart_count,
                });
            }
            other => break other,
        }
    };
    for id in handlers {
        signal_hook::low_level::unregister(id);
    }
    result
}

fn run_workers(
    spec: &LaunchSpec,
    restart_count: u32,
    stdout: Sink,
    stderr: Sink,
    received: &AtomicUsize,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let start = Instant::now();
    let attempt_dir = spec.log_dir.as_ref().map(|d| {
        d.join(&spec.run_id)
            .join(format!("attempt_{restart_count}"))
    });
    let mut workers: Vec<Worker> = Vec::new();
    for local_rank in 0..spec.nproc_per_node {
        match spawn(
            spec,
            local_rank,
            restart_count,
            attempt_dir.as_deref(),
            &stdout,
            &stderr,
        ) {
            Ok(w) => {
                events(LaunchEvent::Started(Started {
                    rank: w.rank,
                    local_rank: w.local_rank,
                    pid: w.child.id(),
                }));
                workers.push(w);
            }
            Err(e) => {
                stop_all(&mut workers, spec.grace);
                return Err(e);
            }
        }
    }

    let mut first_failure: Option<Failure> = None;
    let outcome = loop {
        let sig = received.load(Ordering::SeqCst);
        if sig != 0 {
            break Outcome::Interrupted(sig as i32);
        }
        let mut running = 0;
        for w in workers.iter_mut() {
            match w.poll().cloned() {
                None => running += 1,
                Some(ExitKind::Code(0)) => {}
                Some(exit) if first_failure.is_none() => {
                    first_failure = Some(Failure {
                        rank: w.rank,
                        local_rank: w.local_rank,
                        node_rank: spec.node_rank,
                        pid: w.child.id(),
                        exit,
                        after: start.elapsed(),
                        restart_count,
                        stderr_tail: Vec::new(),
                        log_file: w.stderr_log.clone(),
                    });
                }
                Some(_) => {}
            }
        }
        if let Some(failure) = first_failure.take() {
            break Outcome::Failed(failure);
        }
        if running == 0 {
            break Outcome::Succeeded;
        }
        std::thread::sleep(spec.monitor_interval);
    };
    stop_all(&mut workers, spec.grace);
    // Output pumps end when the pipes close; a grandchild that keeps a pipe open must not hold
    // the launcher, so wait for them only briefly.
    let deadline = Instant::now() + Duration::from_secs(2);
    for w in workers.iter_mut() {
        for pump in std::mem::take(&mut w.pumps) {
            while !pump.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if pump.is_finished() {
                let _ = pump.join();
            }
        }
    }
    Ok(match outcome {
        Outcome::Failed(mut failure) => {
            if let Some(w) = workers.iter().find(|w| w.rank == failure.rank) {
                failure.stderr_tail = w
                    .tail
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .cloned()
                    .collect();
            }
            Outcome::Failed(failure)
        }
        other => other,
    })
}

fn spawn(
    spec: &LaunchSpec,
    local_rank: u32,
    restart_count: u32,
    attempt_dir: Option<&std::path::Path>,
    stdout: &Sink,
    stderr: &Sink,
) -> Result<Worker, LaunchError> {
    let rank = spec.node_rank * spec.nproc_per_node + local_rank;
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
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
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
