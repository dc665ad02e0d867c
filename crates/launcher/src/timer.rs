//! torchrun's file-based expiration timers (`torch.distributed.elastic.timer`): with
//! `TORCHELASTIC_ENABLE_FILE_TIMER=1`, workers get `TORCHELASTIC_TIMER_FILE`, a named pipe to
//! which PyTorch's `FileTimerClient` writes one JSON request a line: `{"version": 1, "pid":
//! P, "scope_id": "S", "expiration_time": T, "signal": N}` to acquire (T in seconds since the
//! Unix epoch), a negative T to release. A timer that expires has its worker killed with the
//! signal it asked for (none for 0 or less), and the failure report names the scope.
//!
//! Nothing on the pipe is trusted: a line longer than PIPE_BUF or that is not such a request
//! is skipped and counted, and only processes of this launcher's own workers (their process
//! groups) are ever signalled.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

/// The longest request a client may write (PIPE_BUF, which FileTimerClient also enforces).
pub(crate) const MAX_REQUEST: usize = 4096;

/// One request from a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub pid: u32,
    pub scope: String,
    /// Seconds since the Unix epoch; negative: release.
    pub expiration: f64,
    pub signal: i32,
}

/// A request line's bytes.
pub fn parse(line: &[u8]) -> Result<Request, String> {
    let v: serde_json::Value = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    if v["version"].as_i64() != Some(1) {
        return Err(format!("version {} (1 is known)", v["version"]));
    }
    let pid = v["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p > 0)
        .ok_or("no pid")?;
    let scope = v["scope_id"].as_str().ok_or("no scope_id")?;
    let expiration = v["expiration_time"]
        .as_f64()
        .filter(|t| t.is_finite())
        .ok_or("no expiration_time")?;
    let signal = v["signal"]
        .as_i64()
        .and_then(|s| i32::try_from(s).ok())
        .ok_or("no signal")?;
    Ok(Request {
        pid,
        scope: scope.chars().take(200).collect(),
        expiration,
        signal,
    })
}

/// A timer that expired, for the failure report.
#[derive(Debug, Clone, PartialEq)]
pub struct Expired {
    pub scope: String,
    /// The signal sent, or `None` when the timer asked for none.
    pub signal: Option<i32>,
}

impl std::fmt::Display for Expired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.signal {
            Some(s) => {
                let name = nix::sys::signal::Signal::try_from(s).map_or("?", |s| s.as_str());
                write!(
                    f,
                    "timer {:?} expired; the launcher sent {name}",
                    self.scope
                )
            }
            None => write!(f, "timer {:?} expired (it asked for no signal)", self.scope),
        }
    }
}

#[derive(Default)]
struct State {
    /// The running workers' process groups (their pids) and ranks.
    workers: HashMap<u32, u32>,
    /// Armed timers: (pid, scope) -> (expiration, signal).
    timers: HashMap<(u32, String), (f64, i32)>,
    /// By rank: the timer that expired for that worker.
    expired: HashMap<u32, Expired>,
    /// Lines that were not requests.
    rejected: u64,
}

/// The timer server of one launch: the named pipe and the thread that reads and enforces it.
pub(crate) struct TimerServer {
    path: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl TimerServer {
    /// Makes the named pipe at `path` (replacing what is there) and serves it.
    pub(crate) fn start(path: &Path) -> std::io::Result<TimerServer> {
        let _ = std::fs::remove_file(path);
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
        // Read and write: the pipe never reports end-of-file when a client closes, and opening
        // it does not wait for a first client.
        let pipe = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::Builder::new()
                .name("file timers".into())
                .spawn(move || serve(pipe, &state, &stop))?
        };
        Ok(TimerServer {
            path: path.to_path_buf(),
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// The server `spec` asks for, if any.
    pub(crate) fn open_for(spec: &crate::LaunchSpec) -> Result<Option<Self>, crate::LaunchError> {
        spec.file_timer
            .as_deref()
            .map(|path| {
                Self::start(path).map_err(|source| crate::LaunchError::Spawn {
                    rank: spec.rank_offset,
                    program: format!("file timer server at {}", path.display()),
                    source,
                })
            })
            .transpose()
    }

    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The workers of a new attempt: only their process groups can be signalled.
    pub(crate) fn workers(&self, workers: impl IntoIterator<Item = (u32, u32)>) {
        let mut s = lock(&self.state);
        s.workers = workers.into_iter().collect();
        s.timers.clear();
        s.expired.clear();
    }

    /// The timer that expired for the worker of `rank`, if one did.
    pub(crate) fn expired(&self, rank: u32) -> Option<Expired> {
        lock(&self.state).expired.get(&rank).cloned()
    }

    /// Lines on the pipe that were not requests.
    #[cfg(test)]
    fn rejected(&self) -> u64 {
        lock(&self.state).rejected
    }
}

impl Drop for TimerServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How often expirations are checked (torch's server: every 0.1 s at most).
const TICK: Duration = Duration::from_millis(50);

fn serve(mut pipe: std::fs::File, state: &Mutex<State>, stop: &AtomicBool) {
    let mut pending: Vec<u8> = Vec::new();
    let mut skipping = false;
    let mut buf = [0u8; 8192];
    while !stop.load(Ordering::SeqCst) {
        let mut fds = [nix::poll::PollFd::new(
            pipe.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let ready = nix::poll::poll(
            &mut fds,
            nix::poll::PollTimeout::from(TICK.as_millis() as u16),
        )
        .unwrap_or(0);
        if ready > 0 {
            let n = pipe.read(&mut buf).unwrap_or(0);
            for &b in &buf[..n] {
                if b != b'\n' {
                    if !skipping {
                        pending.push(b);
                        if pending.len() > MAX_REQUEST {
                            pending.clear();
                            skipping = true;
                        }
                    }
                    continue;
                }
                let mut s = lock(state);
                if skipping {
                    s.rejected += 1;
                    skipping = false;
                } else {
                    match parse(&pending) {
                        Ok(r) => apply(&mut s, r),
                        Err(e) => {
                            s.rejected += 1;
                            tracing::warn!(problem = %e, "not a file-timer request; skipped");
                        }
                    }
                }
                pending.clear();
            }
        }
        enforce(&mut lock(state), SystemTime::now());
    }
}

fn apply(s: &mut State, r: Request) {
    if r.expiration < 0.0 {
        s.timers.remove(&(r.pid, r.scope));
    } else {
        s.timers.insert((r.pid, r.scope), (r.expiration, r.signal));
    }
}

/// Fires the timers that expired by `now`: the worker is signalled (if it is one of ours and
/// asked for a signal) and its rank's report will name the scope.
fn enforce(s: &mut State, now: SystemTime) {
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let due: Vec<(u32, String, i32)> = s
        .timers
        .iter()
        .filter(|(_, (at, _))| *at <= now)
        .map(|((pid, scope), (_, signal))| (*pid, scope.clone(), *signal))
        .collect();
    for (pid, scope, signal) in due {
        s.timers.retain(|(p, _), _| *p != pid);
        let group = crate::stacks::process_group(pid);
        let Some(&rank) = group.and_then(|g| s.workers.get(&g)) else {
            tracing::warn!(
                pid,
                scope,
                "a timer of a process that is not this launcher's worker expired; not signalled"
            );
            continue;
        };
        let sent = nix::sys::signal::Signal::try_from(signal)
            .ok()
            .filter(|_| signal > 0);
        if let Some(sig) = sent {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
        }
        s.expired.entry(rank).or_insert(Expired {
            scope,
            signal: sent.map(|s| s as i32),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn requests_are_read_as_torch_writes_them() {
        let r = parse(br#"{"version": 1, "pid": 42, "scope_id": "step", "expiration_time": 1700000000.5, "signal": 9}"#).unwrap();
        assert_eq!(
            r,
            Request {
                pid: 42,
                scope: "step".into(),
                expiration: 1_700_000_000.5,
                signal: 9
            }
        );
        for bad in [
            &br#"{"version": 2, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 9}"#[..],
            br#"{"version": 1, "pid": 0, "scope_id": "s", "expiration_time": 1, "signal": 9}"#,
            br#"{"version": 1, "pid": 1, "expiration_time": 1, "signal": 9}"#,
            br#"{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": "soon", "signal": 9}"#,
            b"garbage",
            b"",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// A child that arms a timer and lets it expire is killed with the signal it asked for;
    /// garbage and an over-long line before it are skipped; a released timer never fires.
    #[test]
    fn an_expired_timer_kills_its_worker_and_garbage_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let server = TimerServer::start(&dir.path().join("timers")).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        // Both are in the test's process group, which stands for the worker's here.
        let group = crate::stacks::process_group(child.id()).unwrap();
        server.workers([(group, 3)]);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let mut pipe = std::fs::OpenOptions::new()
            .write(true)
            .open(server.path())
            .unwrap();
        let request = |pid: u32, scope: &str, at: f64, signal: i32| {
            format!(
                "{{\"version\": 1, \"pid\": {pid}, \"scope_id\": \"{scope}\", \"expiration_time\": {at}, \"signal\": {signal}}}\n"
            )
        };
        pipe.write_all(b"not json\n").unwrap();
        pipe.write_all(&[b'x'; MAX_REQUEST + 10]).unwrap();
        pipe.write_all(b"\n").unwrap();
        pipe.write_all(request(other.id(), "released", now + 0.2, 9).as_bytes())
            .unwrap();
        pipe.write_all(request(other.id(), "released", -1.0, 0).as_bytes())
            .unwrap();
        pipe.write_all(request(child.id(), "step", now + 0.2, 15).as_bytes())
            .unwrap();
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(15));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while server.expired(3).is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let expired = server.expired(3).unwrap();
        assert_eq!(
            expired.to_string(),
            "timer \"step\" expired; the launcher sent SIGTERM"
        );
        assert_eq!(server.rejected(), 2);
        assert_eq!(
            other.try_wait().unwrap(),
            None,
            "a released timer never fires"
        );
        let _ = other.kill();
        let _ = other.wait();
    }
}
