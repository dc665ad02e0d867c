//! Every data set's archive: downloading it (checked against its size and MD5; the transfer
//! itself is [`super::download`]), taking one already in the data directory, and extracting it
//! (`.tar.gz`, `.zip`), safely beside other nodes sharing the folder.

use std::io::Read;
use std::path::Path;

use md5::{Digest, Md5};

use super::download::{DataProgress, DownloadOptions, Part, download, private_name};
use crate::error::{IoContext, Result, TrainError};

/// Bytes between two progress reports of an extraction.
const REPORT_EVERY: u64 = 1 << 20;

/// Unpacks an archive (first path) into a new folder (second), saying how far it got.
pub(crate) type Unpack = fn(&Path, &Path, &mut dyn FnMut(DataProgress)) -> Result<()>;

/// An official archive: what it holds (for messages), its file name, the one folder it
/// extracts to, how to unpack it, and how to tell its data set is in a directory.
pub(crate) struct Archive {
    pub what: &'static str,
    pub file: &'static str,
    pub folder: &'static str,
    /// Unpacks the archive at the first path into the (new) folder at the second.
    pub unpack: Unpack,
    pub present: fn(&Path) -> bool,
}

/// Downloads and checks `archive` into `dir` and extracts it there ([`extract`]), telling
/// `progress` how far it has come. Safe against concurrent callers sharing `dir` (nodes on a
/// shared volume): each downloads into a part file of its own ([`Part`]) and extracts into a
/// staging folder of its own, and the final rename is atomic. A download that failed on the
/// network leaves its bytes for the next one to resume; nothing else is kept.
pub(crate) fn fetch_into(
    dir: &Path,
    opts: &DownloadOptions,
    archive: &Archive,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<()> {
    let created = !dir.exists();
    std::fs::create_dir_all(dir).at(dir)?;
    progress(DataProgress::Fetching {
        what: archive.what,
        url: opts.url.clone(),
        dir: dir.to_path_buf(),
        created,
    });
    let part = Part::take(dir, archive.file)?;
    let size = match download(opts, &part, progress) {
        Ok(size) => size,
        Err(e) => {
            progress(DataProgress::Done);
            return Err(part.end_after(e));
        }
    };
    let result = check_download(opts, &part, size, archive.what)
        .and_then(|()| extract(&part.path, dir, archive, progress));
    progress(DataProgress::Done);
    part.discard();
    result
}

/// Unpacks the archive file at `path` into a staging folder of `dir`, then renames its one
/// folder into `dir` (or finds that another node did so first).
pub(crate) fn extract(
    path: &Path,
    dir: &Path,
    archive: &Archive,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<()> {
    let staging = dir.join(private_name("extract"));
    let _ = std::fs::remove_dir_all(&staging);
    let moved = (archive.unpack)(path, &staging, progress).and_then(|()| {
        match std::fs::rename(staging.join(archive.folder), dir.join(archive.folder)) {
            Ok(()) => Ok(()),
            // Another node on the same volume finished first.
            Err(_) if (archive.present)(dir) => Ok(()),
            Err(e) => Err(TrainError::BadData {
                path: path.to_path_buf(),
                problem: format!("archive has no {}/ folder ({e})", archive.folder),
            }),
        }
    });
    let _ = std::fs::remove_dir_all(&staging);
    moved
}

/// Checks the downloaded archive's size (when known) and MD5.
fn check_download(opts: &DownloadOptions, part: &Part, size: u64, what: &str) -> Result<()> {
    let (md5, written) = part.md5()?;
    let problem = if written != size {
        Some(format!(
            "the part file {} holds {written} bytes, {size} were downloaded: was it changed meanwhile?",
            part.path.display()
        ))
    } else {
        archive_problem(opts, what, &md5, written)
    };
    match problem {
        Some(problem) => Err(TrainError::Download {
            url: opts.url.clone(),
            problem: format!("{problem}; the partial file was removed, try again"),
        }),
        None => Ok(()),
    }
}

/// What is wrong with an archive of `size` bytes and this MD5, if anything.
fn archive_problem(opts: &DownloadOptions, what: &str, md5: &str, size: u64) -> Option<String> {
    match opts.size {
        Some(expected) if expected != size => Some(format!(
            "the archive is {size} bytes, expected {expected}: the file is corrupt or not {what}"
        )),
        _ if md5 != opts.md5.to_ascii_lowercase() => Some(format!(
            "MD5 of the archive is {md5}, expected {}: the file is corrupt or not {what}",
            opts.md5
        )),
        _ => None,
    }
}

/// Extracts `archive` when its file is already in `dir` under its official name (copied there
/// by hand, or staged from S3 with `trainctl data stage`), after the checks a download gets.
/// `Ok(false)`: there is none. A file that fails them is refused and left alone.
pub(crate) fn extract_present(
    dir: &Path,
    opts: &DownloadOptions,
    archive: &Archive,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<bool> {
    let path = dir.join(archive.file);
    if !path.is_file() {
        return Ok(false);
    }
    let mut file = std::fs::File::open(&path).at(&path)?;
    let mut md5 = Md5::new();
    let size = std::io::copy(&mut file, &mut md5).at(&path)?;
    if let Some(problem) =
        archive_problem(opts, archive.what, &format!("{:x}", md5.finalize()), size)
    {
        return Err(TrainError::BadData {
            path,
            problem: format!("{problem}; replace it with the official archive, or remove it"),
        });
    }
    let extracted = extract(&path, dir, archive, progress);
    progress(DataProgress::Done);
    extracted.map(|()| true)
}

/// A reader that reports how many bytes went through it.
struct Counting<'a, R> {
    inner: R,
    done: u64,
    total: u64,
    progress: &'a mut dyn FnMut(DataProgress),
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if (self.done + n as u64) / REPORT_EVERY != self.done / REPORT_EVERY {
            (self.progress)(DataProgress::Extracting {
                done: self.done + n as u64,
                total: self.total,
            });
        }
        self.done += n as u64;
        Ok(n)
    }
}

/// The `.tar.gz` at `archive` into the folder `staging`; `tar` refuses entries that would land
/// outside it (absolute paths, `..`).
pub(crate) fn untar_gz(
    archive: &Path,
    staging: &Path,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<()> {
    let file = std::fs::File::open(archive).at(archive)?;
    let total = file.metadata().at(archive)?.len();
    let file = Counting {
        inner: file,
        done: 0,
        total,
        progress,
    };
    tar::Archive::new(flate2::read::GzDecoder::new(file))
        .unpack(staging)
        .map_err(|e| TrainError::BadData {
            path: archive.to_path_buf(),
            problem: format!("cannot extract: {e}"),
        })?;
    // tar stops at its end marker, before the last read of the file: report the whole.
    progress(DataProgress::Extracting { done: total, total });
    Ok(())
}

/// The zip at `archive` into the folder `staging`. Entries whose names would leave it are
/// refused.
pub(crate) fn unzip(
    archive: &Path,
    staging: &Path,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<()> {
    let bad = |problem: String| TrainError::BadData {
        path: archive.to_path_buf(),
        problem: format!("cannot extract: {problem}"),
    };
    let file = std::fs::File::open(archive).at(archive)?;
    let total = file.metadata().at(archive)?.len();
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| bad(format!("not a zip archive ({e})")))?;
    let mut done = 0u64;
    let mut buf = vec![0u8; 256 * 1024];
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| bad(e.to_string()))?;
        let Some(name) = entry.enclosed_name() else {
            return Err(bad(format!(
                "entry {:?} would be written outside the folder",
                entry.name()
            )));
        };
        let target = staging.join(name);
        if entry.is_dir() {
            std::fs::create_dir_all(&target).at(&target)?;
            continue;
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        let mut out = std::fs::File::create(&target).at(&target)?;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| bad(format!("{}: {e}", target.display())))?;
            if n == 0 {
                break;
            }
            std::io::Write::write_all(&mut out, &buf[..n]).at(&target)?;
        }
        let before = done;
        done += entry.compressed_size();
        if done / (1 << 20) != before / (1 << 20) {
            progress(DataProgress::Extracting { done, total });
        }
    }
    progress(DataProgress::Extracting { done: total, total });
    Ok(())
}
