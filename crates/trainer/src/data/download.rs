//! One archive's download over HTTP: into a part file that a download cut off leaves for the
//! next one to resume (HTTP ranges), with a stall timeout (no byte for so long is an error that
//! says so) and retries with backoff, each resuming where the last one stopped.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use reqwest::StatusCode;
use reqwest::blocking::{Client, Response};
use reqwest::header::{CONTENT_RANGE, RANGE};

use crate::error::{IoContext, Result, TrainError};

/// How long a download may go without a byte before the try is given up (and retried).
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct DownloadOptions {
    pub enabled: bool,
    pub url: String,
    /// Expected MD5 of the archive, lower-case hex.
    pub md5: String,
    /// Expected size of the archive in bytes, when known (the official archives').
    pub size: Option<u64>,
    /// No byte from the server for this long ends a try of the download (see
    /// [`download`]): `--download-stall-timeout`.
    pub stall_timeout: Duration,
    /// How the command at hand turns downloads on, for the hint when they are off and no
    /// data set is there: `drop --no-download` (train), `pass --download` (eval); `None`
    /// where it cannot (a worker re-reading what its node's local rank 0 fetched).
    pub turn_on: Option<&'static str>,
}

impl DownloadOptions {
    /// Whether `url` is a data set's official address (not a mirror the user gave).
    pub(crate) fn official_url(&self) -> bool {
        super::DatasetName::ALL
            .iter()
            .any(|d| d.contract().url == self.url)
    }
}

impl Default for DownloadOptions {
    fn default() -> Self {
        super::DatasetName::Cifar10.official()
    }
}

/// How far a download or an extraction has come, in bytes of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataProgress {
    /// `total` is the server's Content-Length, when it sent one.
    Downloading {
        done: u64,
        total: Option<u64>,
    },
    /// A try of the download failed (`problem`, naming the URL); the next one starts `after`
    /// this wait, from byte `from`. The download gives up after `tries_left` more tries that
    /// bring no new byte.
    Retrying {
        problem: String,
        after: Duration,
        from: u64,
        tries_left: u32,
    },
    Extracting {
        done: u64,
        total: u64,
    },
    /// A download starts: `what` (CIFAR-10, tiny-imagenet-200) from `url` into `dir`, which
    /// did not exist and was made for it when `created` (a mistyped `--data`, perhaps).
    Fetching {
        what: &'static str,
        url: String,
        dir: std::path::PathBuf,
        created: bool,
    },
    /// This worker waits for its node's local rank 0 (`rank`) to get the data set.
    Waiting {
        rank: u32,
    },
    /// The download (or extraction) ended, well or not.
    Done,
}

/// A hidden name of this process's own in a folder other nodes may share: process ids repeat
/// across pods (each container numbers its own), so a random part goes with the id.
pub(super) fn private_name(stem: &str) -> String {
    format!(
        ".{stem}.{}.{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Tries in a row that bring no new byte before a download gives up (the first and its
/// retries).
pub(crate) const TRIES: u32 = 4;
/// The wait before the first retry, doubled for each next one.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Progress is reported at every MiB, and at least this often while bytes arrive.
const REPORT_EVERY: u64 = 1 << 20;
const REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// A private part file untouched for this long, and locked by nobody, was abandoned.
const ABANDONED_AFTER: Duration = Duration::from_secs(60);

/// Where a download writes. Normally `DIR/.ARCHIVE.part`: a download that fails on the network
/// (or a process killed mid-way) leaves it, and the next download resumes from its bytes.
/// While another process holds that one (a node downloading into the same shared folder), a
/// private `DIR/.ARCHIVE.part.PID.RANDOM`, removed whatever happens. Each is locked (`flock`)
/// while its download runs, which is how a download tells a part in use from one abandoned.
pub(crate) struct Part {
    pub(crate) path: PathBuf,
    file: File,
    resumable: bool,
}

impl Part {
    /// Takes the resumable part of `archive_file` in `dir` (removing the private parts that
    /// killed downloads left there), or a private one while another process holds it.
    pub(crate) fn take(dir: &Path, archive_file: &str) -> Result<Part> {
        let shared = dir.join(format!(".{archive_file}.part"));
        // Only a holder that removed the file between our open and our lock makes this go
        // round again.
        for _ in 0..3 {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&shared)
                .at(&shared)?;
            match file.try_lock() {
                Ok(()) if same_file(&file, &shared) => {
                    remove_abandoned(dir, archive_file);
                    return Ok(Part {
                        path: shared,
                        file,
                        resumable: true,
                    });
                }
                Ok(()) => continue,
                // In use, or a filesystem without locks: this download keeps to itself.
                Err(TryLockError::WouldBlock | TryLockError::Error(_)) => break,
            }
        }
        let path = dir.join(private_name(&format!("{archive_file}.part")));
        let file = File::create_new(&path).at(&path)?;
        // Tells other downloads it is in use (where locks exist at all).
        let _ = file.try_lock();
        Ok(Part {
            path,
            file,
            resumable: false,
        })
    }

    pub(crate) fn len(&self) -> Result<u64> {
        Ok(self.file.metadata().at(&self.path)?.len())
    }

    fn restart(&self) -> Result<()> {
        self.file.set_len(0).at(&self.path)
    }

    /// MD5 (lower-case hex) and size of what the part holds.
    pub(crate) fn md5(&self) -> Result<(String, u64)> {
        use md5::{Digest, Md5};
        let mut file = &self.file;
        file.seek(SeekFrom::Start(0)).at(&self.path)?;
        let mut md5 = Md5::new();
        let size = std::io::copy(&mut file, &mut md5).at(&self.path)?;
        Ok((format!("{:x}", md5.finalize()), size))
    }

    /// Removes the part (still holding its lock, so nobody takes it meanwhile).
    pub(crate) fn discard(self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// After the download itself failed: keeps a resumable part that holds bytes for the next
    /// download (and says so in `e`), removes any other.
    pub(crate) fn end_after(self, e: TrainError) -> TrainError {
        let have = self.len().unwrap_or(0);
        if !self.resumable || have == 0 {
            self.discard();
            return e;
        }
        match e {
            TrainError::Download { url, problem } => TrainError::Download {
                url,
                problem: format!(
                    "{problem}; the {have} bytes received are kept in {}, and the next download resumes from them",
                    self.path.display()
                ),
            },
            other => other,
        }
    }
}

fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Removes the private parts of `archive_file` in `dir` that no download holds and that have
/// not been written to for a while: what killed downloads (and trainctl before resumable
/// downloads) left behind.
fn remove_abandoned(dir: &Path, archive_file: &str) {
    let prefix = format!(".{archive_file}.part.");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        let idle = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|idle| idle >= ABANDONED_AFTER);
        if idle && file.try_lock().is_ok() {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Why a try of the download failed: worth another try (no byte for the stall timeout, or
/// what else went wrong), or not.
enum Failed {
    Stalled,
    Again(String),
    Fatal(TrainError),
}

/// Downloads `opts.url` into `part`, resuming from what it holds when the server serves
/// ranges, and returns its size. A try that fails on the network, stalls (no byte for
/// `opts.stall_timeout`) or is cut short is retried after a backoff, resuming; the download
/// fails after [`TRIES`] tries in a row that brought no new byte.
pub(crate) fn download(
    opts: &DownloadOptions,
    part: &Part,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<u64> {
    let fail = |problem: String| TrainError::Download {
        url: opts.url.clone(),
        problem,
    };
    let client = Client::builder()
        // The blocking client applies this to the wait for the answer and to each read of the
        // body, each on its own: a stall, not the whole download, which may take hours.
        .timeout(opts.stall_timeout)
        .connect_timeout(opts.stall_timeout)
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let mut furthest = part.len()?;
    // Failed tries in a row that brought no new byte.
    let mut barren = 0;
    loop {
        let (problem, stalled) = match attempt(&client, opts, part, progress) {
            Ok(size) => return Ok(size),
            Err(Failed::Fatal(e)) => return Err(e),
            Err(Failed::Stalled) => (stalled_for(opts), true),
            Err(Failed::Again(problem)) => (problem, false),
        };
        let have = part.len()?;
        barren = if have > furthest { 0 } else { barren + 1 };
        furthest = furthest.max(have);
        if barren >= TRIES {
            let mirror = if opts.official_url() {
                "pass --download-url to use a mirror"
            } else {
                "check the mirror's address (--download-url)"
            };
            return Err(fail(format!(
                "{problem} ({TRIES} tries in a row brought no new byte); check the network and the server, {mirror}{}",
                if stalled {
                    ", or pass --download-stall-timeout to wait longer"
                } else {
                    ""
                }
            )));
        }
        let after = FIRST_BACKOFF * 2u32.pow(barren.saturating_sub(1));
        progress(DataProgress::Retrying {
            problem,
            after,
            from: have,
            tries_left: TRIES - barren,
        });
        std::thread::sleep(after);
    }
}

/// `no data from URL for N s`.
fn stalled_for(opts: &DownloadOptions) -> String {
    format!(
        "no data from {} for {} s",
        opts.url,
        seconds(opts.stall_timeout)
    )
}

/// `60`, `1.5`.
pub(crate) fn seconds(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        d.as_secs().to_string()
    } else {
        format!("{:.1}", d.as_secs_f64())
    }
}

/// One try: asks for what `part` lacks and writes what comes.
fn attempt(
    client: &Client,
    opts: &DownloadOptions,
    part: &Part,
    progress: &mut dyn FnMut(DataProgress),
) -> std::result::Result<u64, Failed> {
    let fatal = Failed::Fatal;
    let have = part.len().map_err(fatal)?;
    let mut request = client.get(&opts.url);
    if have > 0 {
        request = request.header(RANGE, format!("bytes={have}-"));
    }
    let mut response = request.send().map_err(|e| {
        if e.is_timeout() {
            Failed::Stalled
        } else {
            Failed::Again(format!("{e} (no network?)"))
        }
    })?;
    let status = response.status();
    let (start, total) = match status {
        StatusCode::PARTIAL_CONTENT if have > 0 => match content_range(&response) {
            Some((Some(first), total)) if first == have => {
                (have, total.or(response.content_length().map(|n| have + n)))
            }
            _ => {
                part.restart().map_err(fatal)?;
                return Err(Failed::Again(format!(
                    "the server answered the range from byte {have} with {:?}; starting again from zero",
                    response.headers().get(CONTENT_RANGE)
                )));
            }
        },
        StatusCode::RANGE_NOT_SATISFIABLE if have > 0 => {
            // An earlier download got every byte and stopped before it was checked.
            if matches!(content_range(&response), Some((None, Some(total))) if total == have) {
                return Ok(have);
            }
            part.restart().map_err(fatal)?;
            return Err(Failed::Again(format!(
                "the server has nothing from byte {have} on; starting again from zero"
            )));
        }
        s if s.is_success() => {
            // A server that ignores ranges sends the whole file.
            if have > 0 {
                part.restart().map_err(fatal)?;
            }
            (0, response.content_length())
        }
        s if s.is_server_error()
            || s == StatusCode::REQUEST_TIMEOUT
            || s == StatusCode::TOO_MANY_REQUESTS =>
        {
            return Err(Failed::Again(format!("the server answered {s}")));
        }
        s => {
            return Err(fatal(TrainError::Download {
                url: opts.url.clone(),
                problem: format!("the server answered {s}; check --download-url"),
            }));
        }
    };
    receive(&mut response, opts, part, start, total, progress)
}

/// Writes the body of `response` into `part` from byte `start`.
fn receive(
    response: &mut Response,
    opts: &DownloadOptions,
    part: &Part,
    start: u64,
    total: Option<u64>,
    progress: &mut dyn FnMut(DataProgress),
) -> std::result::Result<u64, Failed> {
    let fatal = Failed::Fatal;
    let mut file = &part.file;
    file.seek(SeekFrom::Start(start))
        .at(&part.path)
        .map_err(fatal)?;
    progress(DataProgress::Downloading { done: start, total });
    let mut buf = vec![0u8; 256 * 1024];
    let mut done = start;
    let (mut reported, mut reported_at) = (start, Instant::now());
    loop {
        let asked = Instant::now();
        let n = match response.read(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                let timed_out = e
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<reqwest::Error>())
                    .is_some_and(reqwest::Error::is_timeout)
                    || e.kind() == std::io::ErrorKind::TimedOut
                    || asked.elapsed() >= opts.stall_timeout;
                return Err(if timed_out {
                    Failed::Stalled
                } else {
                    Failed::Again(format!("the connection broke after {done} bytes: {e}"))
                });
            }
        };
        if n == 0 {
            break;
        }
        file.write_all(&buf[..n]).at(&part.path).map_err(fatal)?;
        done += n as u64;
        if done / REPORT_EVERY != reported / REPORT_EVERY
            || reported_at.elapsed() >= REPORT_INTERVAL
        {
            progress(DataProgress::Downloading { done, total });
            (reported, reported_at) = (done, Instant::now());
        }
    }
    file.sync_all().at(&part.path).map_err(fatal)?;
    progress(DataProgress::Downloading { done, total });
    match total {
        Some(total) if total != done => Err(Failed::Again(format!(
            "the connection ended after {done} of {total} bytes"
        ))),
        _ => Ok(done),
    }
}

/// `Content-Range: bytes FIRST-LAST/TOTAL` (or `bytes */TOTAL`) as (FIRST, TOTAL).
fn content_range(response: &Response) -> Option<(Option<u64>, Option<u64>)> {
    parse_content_range(response.headers().get(CONTENT_RANGE)?.to_str().ok()?)
}

fn parse_content_range(value: &str) -> Option<(Option<u64>, Option<u64>)> {
    let (range, total) = value.trim().strip_prefix("bytes ")?.split_once('/')?;
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    let first = match range.trim() {
        "*" => None,
        r => Some(r.split_once('-')?.0.trim().parse().ok()?),
    };
    Some((first, total))
}

#[cfg(test)]
#[path = "download_tests.rs"]
mod tests;
