//! The workers' metrics records, passed up to the caller: one pipe per launch, whose write end
//! every worker inherits (its number in `TRAINCTL_TELEMETRY_FD`); a thread reads whole lines
//! and hands them to the caller's [`Telemetry`] sink. Lines are short (a record each, written in
//! one `write` below PIPE_BUF), so lines of different workers never interleave.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::output::Activity;
use std::time::{Duration, Instant};

/// Where the workers' records go: called with each line (newline stripped), on a thread of
/// the launcher's.
#[derive(Clone)]
pub struct Telemetry(pub Arc<LineSink>);

pub(crate) type LineSink = dyn Fn(&[u8]) + Send + Sync;

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry(..)")
    }
}

/// Longest line passed on; a longer one is not a record and is dropped.
const MAX_LINE: usize = 64 * 1024;

pub(crate) struct TelemetryPipe {
    writer: Option<std::io::PipeWriter>,
    reader: Option<JoinHandle<()>>,
}

impl TelemetryPipe {
    /// The pipe, whose every record also counts as the workers' activity (`--hang-timeout`:
    /// the built-in trainer records every step).
    pub(crate) fn open(sink: &Telemetry, activity: &Arc<Activity>) -> std::io::Result<Self> {
        let (reader, writer) = std::io::pipe()?;
        let sink = sink.clone();
        let activity = activity.clone();
        let thread = std::thread::Builder::new()
            .name("telemetry".into())
            .spawn(move || {
                let mut reader = BufReader::new(reader);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    match (&mut reader)
                        .take(MAX_LINE as u64 + 1)
                        .read_until(b'\n', &mut line)
                    {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    if line.last() != Some(&b'\n') {
                        // Too long: skip to the end of this line.
                        let mut rest = Vec::new();
                        if reader.read_until(b'\n', &mut rest).unwrap_or(0) == 0 {
                            break;
                        }
                        continue;
                    }
                    line.pop();
                    activity.touch();
                    (sink.0)(&line);
                }
            })?;
        Ok(TelemetryPipe {
            writer: Some(writer),
            reader: Some(thread),
        })
    }

    /// The pipe for `spec`'s workers, if it asks for telemetry.
    pub(crate) fn open_for(
        spec: &crate::LaunchSpec,
        activity: &Arc<Activity>,
    ) -> Result<Option<Self>, crate::LaunchError> {
        spec.telemetry
            .as_ref()
            .map(|sink| {
                Self::open(sink, activity).map_err(|source| crate::LaunchError::Spawn {
                    rank: spec.rank_offset,
                    program: "telemetry pipe".into(),
                    source,
                })
            })
            .transpose()
    }

    /// The descriptor workers inherit.
    pub(crate) fn fd(&self) -> Option<RawFd> {
        self.writer.as_ref().map(|w| w.as_raw_fd())
    }
}

impl Drop for TelemetryPipe {
    fn drop(&mut self) {
        // The reader ends when the last write end closes: ours now, the workers' as they exit.
        // A grandchild holding one must not hold the launcher, so wait only briefly.
        drop(self.writer.take());
        let deadline = Instant::now() + Duration::from_secs(2);
        if let Some(reader) = self.reader.take() {
            while !reader.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if reader.is_finished() {
                let _ = reader.join();
            }
        }
    }
}
