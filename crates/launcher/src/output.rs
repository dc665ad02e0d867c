//! Worker output: each line prefixed with `[rank]:` and written whole, so lines of different
//! workers never interleave mid-line; optionally teed to a per-rank log file.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub type Sink = Arc<Mutex<dyn Write + Send>>;

/// Lines of stderr kept per worker for the failure report.
pub const TAIL_LINES: usize = 20;

pub type Tail = Arc<Mutex<VecDeque<String>>>;

/// Copies `from` to `sink` line by line with `prefix`, keeping the last lines in `tail`.
pub fn pump(
    from: impl Read + Send + 'static,
    prefix: String,
    sink: Sink,
    mut log: Option<std::fs::File>,
    tail: Option<Tail>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("output {prefix}"))
        .spawn(move || {
            let mut reader = BufReader::new(from);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                if let Some(log) = log.as_mut() {
                    let _ = log.write_all(&line);
                }
                {
                    let mut out = sink.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = out.write_all(prefix.as_bytes());
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
