//! Staging: copying every object under a prefix onto a folder, several at a time, skipping what
//! an earlier run already copied.
//!
//! A file is skipped when it has the object's size and its MD5 is the object's ETag (S3's ETag
//! of an object uploaded in one request), or when the folder's journal (`.trainctl-stage`, one
//! JSON line per copied file, appended as each lands) says it was copied from the object with
//! this ETag and the file still has the MD5 recorded then (objects uploaded in parts, or
//! encrypted with KMS, have ETags that are not MD5s). An interrupted run leaves whole files and
//! journal lines for what it finished, so the next run copies only the rest.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use futures::StreamExt;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use crate::error::{Action, LocalContext, classify, parent_of};
use crate::{Client, Error, S3Uri, download, hash_file, object_path, part_path};

/// The journal's name inside the destination folder.
pub(crate) const JOURNAL: &str = ".trainctl-stage";

/// Where a staging run is, after each file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageProgress {
    pub files_total: usize,
    pub files_done: usize,
    /// Bytes of the files this run copies (skipped ones excluded).
    pub bytes_to_copy: u64,
    pub bytes_copied: u64,
    pub skipped: usize,
}

/// What a staging run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageSummary {
    pub files: usize,
    pub copied: usize,
    pub skipped: usize,
    pub bytes_copied: u64,
    pub bytes_total: u64,
    pub seconds: f64,
    /// Copied files whose object carried a SHA-256 (uploaded by trainctl) that was checked.
    pub verified: usize,
}

impl StageSummary {
    pub fn megabytes_per_second(&self) -> f64 {
        self.bytes_copied as f64 / 1e6 / self.seconds.max(1e-9)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct JournalLine {
    key: String,
    etag: String,
    size: u64,
    md5: String,
}

/// One object to stage and where it lands.
struct Planned {
    uri: S3Uri,
    local: PathBuf,
    relative: String,
    meta: ObjectMeta,
}

impl Client {
    /// Copies every object under `from` (taken as a folder; or the one object it names) into
    /// `dir`, keeping the keys' relative paths, `Settings::concurrency` at a time. Calls
    /// `progress` after each file. On an error the files already copied stay (and are skipped by
    /// the next run); no part file is left.
    pub fn stage(
        &self,
        from: &S3Uri,
        dir: &Path,
        progress: &mut dyn FnMut(&StageProgress),
    ) -> Result<StageSummary, Error> {
        let started = Instant::now();
        let store = self.store(from)?;
        let planned = self.runtime.block_on(plan(store.as_ref(), from, dir))?;
        std::fs::create_dir_all(dir).at(dir)?;
        let journal_path = dir.join(JOURNAL);
        let journal = read_journal(&journal_path);

        let mut state = StageProgress {
            files_total: planned.len(),
            ..Default::default()
        };
        let mut to_copy = Vec::new();
        let mut kept = Vec::new();
        for item in planned {
            match already_there(&item, &journal)? {
                Some(line) => {
                    state.skipped += 1;
                    state.files_done += 1;
                    kept.push(line);
                }
                None => {
                    state.bytes_to_copy += item.meta.size;
                    to_copy.push(item);
                }
            }
        }
        progress(&state);

        let mut appender = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&journal_path)
            .at(&journal_path)?;
        let parts: Vec<PathBuf> = to_copy.iter().map(|p| part_path(&p.local)).collect();
        let mut verified = 0;
        let copied = self.runtime.block_on(async {
            let mut downloads = futures::stream::iter(to_copy)
                .map(|item| {
                    let store = store.clone();
                    async move {
                        let fetched = download(store.as_ref(), &item.uri, &item.local).await?;
                        Ok::<_, Error>((item, fetched))
                    }
                })
                .buffer_unordered(self.settings.concurrency.max(1));
            let mut copied = 0;
            while let Some(done) = downloads.next().await {
                let (item, fetched) = done?;
                let line = JournalLine {
                    key: item.relative,
                    etag: item.meta.e_tag.clone().unwrap_or_default(),
                    size: item.meta.size,
                    md5: fetched.md5,
                };
                // One write per line: an interrupted run leaves at most one partial line, which
                // the next run ignores.
                let mut text = serde_json::to_string(&line).expect("journal lines serialise");
                text.push('\n');
                appender.write_all(text.as_bytes()).at(&journal_path)?;
                kept.push(line);
                verified += usize::from(fetched.transfer.verified);
                copied += 1;
                state.files_done += 1;
                state.bytes_copied += item.meta.size;
                progress(&state);
            }
            Ok::<_, Error>(copied)
        });
        if copied.is_err() {
            // Downloads still in flight were dropped with the stream, part files and all.
            for part in &parts {
                let _ = std::fs::remove_file(part);
            }
        }
        let copied = copied?;
        drop(appender);
        rewrite_journal(&journal_path, &kept)?;
        Ok(StageSummary {
            files: state.files_total,
            copied,
            skipped: state.skipped,
            bytes_copied: state.bytes_copied,
            bytes_total: kept.iter().map(|l| l.size).sum(),
            seconds: started.elapsed().as_secs_f64(),
            verified,
        })
    }
}

/// Lists what `from` holds and where each object lands under `dir`.
async fn plan(store: &dyn ObjectStore, from: &S3Uri, dir: &Path) -> Result<Vec<Planned>, Error> {
    let prefix_text = from.key().trim_end_matches('/');
    let prefix = if prefix_text.is_empty() {
        None
    } else {
        Some(object_path(&S3Uri::new(from.bucket(), prefix_text)?)?)
    };
    let mut listed: Vec<ObjectMeta> = Vec::new();
    let mut stream = store.list(prefix.as_ref());
    while let Some(meta) = stream.next().await {
        listed.push(meta.map_err(|e| classify(e, from, Action::List))?);
    }
    if listed.is_empty() {
        // `from` may name one object rather than a folder.
        let Some(name) = from.file_name() else {
            return Err(Error::EmptyPrefix {
                uri: from.to_string(),
                parent: parent_of(from),
            });
        };
        let meta = match store.head(&object_path(from)?).await {
            Ok(meta) => meta,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Error::EmptyPrefix {
                    uri: from.to_string(),
                    parent: parent_of(from),
                });
            }
            Err(e) => return Err(classify(e, from, Action::Read)),
        };
        return Ok(vec![Planned {
            uri: from.clone(),
            local: dir.join(name),
            relative: name.to_string(),
            meta,
        }]);
    }
    listed.sort_by(|a, b| a.location.cmp(&b.location));
    // The S3 console's "folders" are empty objects named `folder/`, which object_store lists
    // as `folder`: copied, they would be files where the folder must go.
    let folders: std::collections::HashSet<String> = listed
        .iter()
        .filter_map(|m| {
            m.location
                .as_ref()
                .rsplit_once('/')
                .map(|(dir, _)| dir.to_string())
        })
        .flat_map(|dir| {
            let mut parents = vec![dir.clone()];
            let mut rest = dir.as_str();
            while let Some((parent, _)) = rest.rsplit_once('/') {
                parents.push(parent.to_string());
                rest = parent;
            }
            parents
        })
        .collect();
    listed.retain(|m| !(m.size == 0 && folders.contains(m.location.as_ref())));
    let mut planned = Vec::with_capacity(listed.len());
    for meta in listed {
        let key = meta.location.as_ref().to_string();
        let relative = match prefix_text {
            "" => key.as_str(),
            p => key
                .strip_prefix(p)
                .and_then(|rest| rest.strip_prefix('/'))
                .unwrap_or(key.as_str()),
        }
        .to_string();
        let uri = S3Uri::new(from.bucket(), &key)?;
        let local = local_path(dir, &relative).map_err(|reason| Error::UnsafeKey {
            uri: uri.to_string(),
            reason,
        })?;
        planned.push(Planned {
            uri,
            local,
            relative,
            meta,
        });
    }
    Ok(planned)
}

/// `relative` under `dir`, refusing anything that would land elsewhere or collide with the
/// staging's own files.
pub(crate) fn local_path(dir: &Path, relative: &str) -> Result<PathBuf, String> {
    let path = Path::new(relative);
    if relative.is_empty() || !path.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(format!(
            "{relative:?} is not a relative path of plain names"
        ));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    if name == JOURNAL || name.ends_with(".trainctl-part") {
        return Err(format!("{name:?} is a name trainctl's staging uses itself"));
    }
    Ok(dir.join(path))
}

/// The journal line that lets `item` be skipped, if its file is already there whole.
fn already_there(
    item: &Planned,
    journal: &HashMap<String, JournalLine>,
) -> Result<Option<JournalLine>, Error> {
    let Ok(local) = std::fs::metadata(&item.local) else {
        return Ok(None);
    };
    if !local.is_file() || local.len() != item.meta.size {
        return Ok(None);
    }
    let etag = item.meta.e_tag.clone().unwrap_or_default();
    let md5 = hash_file(&item.local)?.md5;
    let etag_is_md5 = etag.trim_matches('"').eq_ignore_ascii_case(&md5);
    let journal_says = journal
        .get(&item.relative)
        .is_some_and(|line| line.etag == etag && line.size == item.meta.size && line.md5 == md5);
    Ok((etag_is_md5 || journal_says).then(|| JournalLine {
        key: item.relative.clone(),
        etag,
        size: item.meta.size,
        md5,
    }))
}

/// The journal's lines by key; a missing journal or a partial last line is no error.
fn read_journal(path: &Path) -> HashMap<String, JournalLine> {
    parse_journal(&std::fs::read_to_string(path).unwrap_or_default())
}

/// The journal's text by key: lines that do not parse (a partial last line) are skipped.
pub(crate) fn parse_journal(text: &str) -> HashMap<String, JournalLine> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<JournalLine>(line).ok())
        .map(|line| (line.key.clone(), line))
        .collect()
}

/// Replaces the journal with the lines of this run's files (whole or not at all).
fn rewrite_journal(path: &Path, lines: &[JournalLine]) -> Result<(), Error> {
    let mut text = String::new();
    for line in lines {
        text.push_str(&serde_json::to_string(line).expect("journal lines serialise"));
        text.push('\n');
    }
    let tmp = path.with_file_name(format!("{JOURNAL}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.at(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_land_only_under_the_folder() {
        let dir = Path::new("/stage");
        assert_eq!(
            local_path(dir, "train/cat/1.jpg").unwrap(),
            Path::new("/stage/train/cat/1.jpg")
        );
        for bad in [
            "",
            "/etc/passwd",
            "a/../../b",
            "./a",
            JOURNAL,
            "x/.a.trainctl-part",
        ] {
            assert!(local_path(dir, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_partial_journal_line_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL);
        let line = JournalLine {
            key: "a".into(),
            etag: "\"e\"".into(),
            size: 3,
            md5: "m".into(),
        };
        let whole = serde_json::to_string(&line).unwrap();
        std::fs::write(&path, format!("{whole}\n{{\"key\":\"b\",\"et")).unwrap();
        let read = read_journal(&path);
        assert_eq!(read.len(), 1);
        assert_eq!(read["a"], line);
        rewrite_journal(&path, std::slice::from_ref(&line)).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{whole}\n")
        );
    }
}
