//! Worker output: each line prefixed with `[rank]:` and written whole, so lines of different
//! workers never interleave mid-line; optionally teed to a per-rank log file.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub type Sink = Arc<Mutex<dyn Write + Send>>;

/// Lines of stderr kept per worker for the failure report.
pub(crate) const TAIL_LINES: usize = 20;

pub(crate) type Tail = Arc<Mutex<VecDeque<String>>>;

/// When a group's workers last wrote a line: what `--hang-timeout` watches, with their CPU
/// time. One relaxed atomic store per line, so watching costs a worker nothing it would
/// notice.
#[derive(Debug)]
pub struct Activity {
    start: Instant,
    /// Milliseconds after `start` of the last line.
    last: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            start: Instant::now(),
            last: AtomicU64::new(0),
        }
    }
}

impl Activity {
    /// A line was written now.
    pub fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.last.fetch_max(now, Ordering::Relaxed);
    }

    /// New workers start now: their silence counts from here.
    pub fn restart(&self) {
        self.touch();
    }

    /// How long since the last line (or since the start, before any).
    pub(crate) fn silent_for(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// The rank a worker's lines are prefixed with: the worker's current one, which changes when
/// it regroups in place; [`WARM`] and its local rank while it has none (`[warm 0]:`).
pub(crate) type Prefix = Arc<std::sync::atomic::AtomicU32>;

/// A [`Prefix`] bit: the worker started warm and has no rank yet.
pub(crate) const WARM: u32 = 1 << 31;

/// Copies `from` to `sink` line by line with `[RANK]:` (`prefix`'s rank as each line comes), keeping the last lines in `tail` and
/// noting each line in `activity`.
pub fn pump(
    from: impl Read + Send + 'static,
    prefix: Prefix,
    sink: Sink,
    mut log: Option<std::fs::File>,
    tail: Option<Tail>,
    activity: Arc<Activity>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!(
            "output [{}]",
            prefix.load(std::sync::atomic::Ordering::Relaxed)
        ))
        .spawn(move || {
            let mut reader = BufReader::new(from);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                activity.touch();
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                if let Some(log) = log.as_mut() {
                    let _ = log.write_all(&line);
                }
                {
                    let mut out = sink.lock().unwrap_or_else(|p| p.into_inner());
                    let rank = prefix.load(std::sync::atomic::Ordering::Relaxed);
                    let _ = if rank & WARM != 0 {
                        write!(out, "[warm {}]:", rank & !WARM)
                    } else {
                        write!(out, "[{rank}]:")
                    };
                    let _ = out.write_all(&line);
                    let _ = out.flush();
                }
                if let Some(tail) = &tail {
                    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == TAIL_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(String::from_utf8_lossy(&line).trim_end().to_string());
                }
            }
        })
}
