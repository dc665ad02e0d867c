//! A live copy of the keys every agent reads (the record and the liveness keys), kept by a
//! watch on etcd instead of reading them at every poll: reading costs the store nothing, and
//! an agent wakes the moment something changes. Without it, 128 agents polling a record that
//! grows with the job (each read returning it whole) kept etcd's core busy and leases expired
//! before their keep-alives were served; rounds never formed.
//!
//! One thread per agent: it reads the range once, then follows etcd's watch stream from the
//! revision after, and starts over (a fresh read) whenever the stream ends, is cancelled or
//! compacted, or the heartbeat says etcd cannot be reached. While it starts over the copy is
//! not `live` and the backend reads etcd directly, as without a mirror.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use super::string_field;

/// One key's value and the revision that wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

#[derive(Default)]
pub(super) struct View {
    pub kvs: BTreeMap<String, Entry>,
    /// Current: synced and following the stream.
    pub live: bool,
    /// Bumped by every change applied (and by losing or regaining `live`).
    pub generation: u64,
}

#[derive(Default)]
pub(super) struct Mirror {
    view: Mutex<View>,
    changed: Condvar,
    stop: AtomicBool,
    /// Set by the heartbeat when etcd did not answer: the stream may be stuck on a dead link.
    resync: AtomicBool,
}

impl Mirror {
    pub(super) fn view(&self) -> MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut View)) {
        let mut view = self.view();
        f(&mut view);
        view.generation = view.generation.wrapping_add(1);
        drop(view);
        self.changed.notify_all();
    }

    /// Waits up to `timeout` (or until the mirror stops) while `waiting` holds for the view.
    fn wait_while(&self, timeout: Duration, waiting: impl Fn(&View) -> bool) {
        let deadline = Instant::now() + timeout;
        let mut view = self.view();
        while waiting(&view) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.stop.load(Ordering::Relaxed) {
                break;
            }
            view = self
                .changed
                .wait_timeout(view, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits up to `timeout` for a generation other than `seen`.
    pub(super) fn wait_past(&self, seen: u64, timeout: Duration) {
        self.wait_while(timeout, |v| v.generation == seen);
    }

    /// Waits up to `timeout` until `done` holds for the view (or it is not live).
    pub(super) fn wait_until(&self, timeout: Duration, done: impl Fn(&View) -> bool) {
        self.wait_while(timeout, |v| v.live && !done(v));
    }

    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.changed.notify_all();
    }

    /// etcd did not answer a call: stop trusting the copy until it is read afresh.
    pub(super) fn suspect(&self) {
        if !self.resync.swap(true, Ordering::Relaxed) {
            self.update(|v| v.live = false);
        }
    }
}

/// Where the mirrored keys are: `[start, end)` at `url`.
pub(super) struct Range {
    pub url: String,
    pub start: String,
    pub end: Vec<u8>,
}

/// The watch thread: keeps `mirror` a copy of `range` until the mirror is stopped.
pub(super) fn follow(mirror: Arc<Mirror>, range: Range, timeout: Duration) {
    // Each read of the stream waits at most this long, so a stop or resync is seen in time;
    // the stream itself lives as long as etcd keeps it.
    let Ok(client) = super::http_client(&range.url, Duration::from_millis(500)) else {
        return;
    };
    let mut failing = false;
    while !mirror.stop.load(Ordering::Relaxed) {
        mirror.resync.store(false, Ordering::Relaxed);
        let result = sync(&client, &mirror, &range, timeout)
            .and_then(|revision| stream(&client, &mirror, &range, revision));
        mirror.update(|v| v.live = false);
        match result {
            Err(e) if !failing => {
                tracing::debug!(error = %e, "etcd watch lost; reading the keys again");
                failing = true;
            }
            Err(_) => {}
            Ok(()) => failing = false,
        }
        if failing && !mirror.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Reads the whole range; returns the store revision it is current at.
fn sync(
    client: &reqwest::blocking::Client,
    mirror: &Mirror,
    range: &Range,
    timeout: Duration,
) -> Result<i64, String> {
    let got: Value = client
        .post(format!("{}/v3/kv/range", range.url))
        .timeout(timeout)
        .body(
            json!({ "key": B64.encode(&range.start), "range_end": B64.encode(&range.end) })
                .to_string(),
        )
        .send()
        .and_then(|r| r.error_for_status())
        .and_then(|r| r.text())
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("not etcd's JSON ({e})")))?;
    let revision = got
        .get("header")
        .and_then(|h| string_field(h, "revision"))
        .and_then(|r| r.parse::<i64>().ok())
        .ok_or("range answer without a revision")?;
    let mut kvs = BTreeMap::new();
    for kv in got
        .get("kvs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some((key, entry)) = entry(kv) {
            kvs.insert(key, entry);
        }
    }
    mirror.update(|v| {
        v.kvs = kvs;
        v.live = true;
    });
    Ok(revision)
}

/// A key-value of etcd's JSON (base64 key and value, revisions as strings).
fn entry(kv: &Value) -> Option<(String, Entry)> {
    let key = String::from_utf8(B64.decode(kv.get("key")?.as_str()?).ok()?).ok()?;
    let value = kv
        .get("value")
        .and_then(Value::as_str)
        .and_then(|v| B64.decode(v).ok())
        .unwrap_or_default();
    let mod_revision = string_field(kv, "mod_revision")?.parse().ok()?;
    Some((
        key,
        Entry {
            value,
            mod_revision,
        },
    ))
}

/// Follows the watch stream from `revision + 1`. Returns when it ends or must be read afresh.
fn stream(
    client: &reqwest::blocking::Client,
    mirror: &Mirror,
    range: &Range,
    revision: i64,
) -> Result<(), String> {
    let body = json!({ "create_request": {
        "key": B64.encode(&range.start),
        "range_end": B64.encode(&range.end),
        "start_revision": (revision + 1).to_string(),
    }});
    let mut response = client
        .post(format!("{}/v3/watch", range.url))
        .body(body.to_string())
        .send()
        .and_then(|r| r.error_for_status())
        .map_err(|e| e.to_string())?;
    let mut pending: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if mirror.stop.load(Ordering::Relaxed) || mirror.resync.load(Ordering::Relaxed) {
            return Ok(());
        }
        let n = match response.read(&mut chunk) {
            Ok(0) => return Err("etcd closed the watch".into()),
            Ok(n) => n,
            Err(e) if is_timeout(&e) => continue,
            Err(e) => return Err(e.to_string()),
        };
        pending.extend_from_slice(&chunk[..n]);
        // One JSON message per line.
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let message: Value = serde_json::from_slice(&line)
                .map_err(|e| format!("not etcd's watch message ({e})"))?;
            apply(mirror, &message)?;
        }
    }
}

/// A read that waited its limit (reqwest wraps its own error in the I/O error): nothing came,
/// the stream goes on.
fn is_timeout(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::TimedOut
        || e.get_ref()
            .and_then(|inner| inner.downcast_ref::<reqwest::Error>())
            .is_some_and(reqwest::Error::is_timeout)
}

/// Applies one watch message; an error asks for a fresh read.
fn apply(mirror: &Mirror, message: &Value) -> Result<(), String> {
    if let Some(error) = message.get("error") {
        return Err(format!("watch error: {error}"));
    }
    let result = message
        .get("result")
        .ok_or("watch message without a result")?;
    if result.get("canceled").and_then(Value::as_bool) == Some(true)
        || result.get("compact_revision").is_some()
    {
        return Err(format!("watch cancelled: {result}"));
    }
    let Some(events) = result.get("events").and_then(Value::as_array) else {
        return Ok(());
    };
    mirror.update(|v| {
        for event in events {
            let Some((key, entry)) = event.get("kv").and_then(entry) else {
                continue;
            };
            if event.get("type").and_then(Value::as_str) == Some("DELETE") {
                v.kvs.remove(&key);
            } else {
                v.kvs.insert(key, entry);
            }
        }
    });
    Ok(())
}
