//! The etcd backend: etcd's v3 API through its JSON gateway (`/v3/kv/range`, `/v3/kv/txn`,
//! `/v3/watch`, `/v3/lease/*`), so it needs no `--enable-v2` and no gRPC stack. The record is
//! one key written by a transaction that compares its mod revision; liveness is a key per node
//! attached to that node's lease, which etcd deletes when the lease is not kept alive. Both are
//! read from a [`mirror::Mirror`] the watch keeps current, not from etcd at every poll.
//!
//! A node joins a round by announcing itself (a key of its own under `wants/<round>/`, on its
//! lease: no race), and the round's writer merges the announcements into the record, many in
//! one write ([`crate::state::join_step`]). Announcements lie outside the mirrored range, so
//! only the writer, who reads them, pays for them.
//!
//! Keys live under `/trainctl/<run id>/`: `alive/<node>`, `state`, `wants/<round>/<node>`.

mod mirror;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use super::{Backend, Read, decode, encode};
use crate::RendezvousError;
use crate::state::{Node, State};
use mirror::{Mirror, Range};

/// What an agent's connections share: the heartbeat's connection grants the lease the main
/// one announces with, and tells the mirror when etcd stops answering.
#[derive(Default)]
struct Shared {
    mirror: Arc<Mirror>,
    /// This node's lease, once granted.
    lease: Mutex<Option<String>>,
}

pub struct Etcd {
    url: String,
    run_id: String,
    prefix: String,
    timeout: Duration,
    http: reqwest::blocking::Client,
    shared: Arc<Shared>,
    /// The connection that reads: it runs the watch (started at the first read).
    primary: bool,
    watching: bool,
    /// The mirror's generation at the last read.
    seen: u64,
    /// The key, lease and value of this node's last announcement.
    announced: Option<(String, String, Vec<u8>)>,
    /// The record last decoded from the mirror, by its revision: an agent reads at every wake
    /// and the record rarely changes.
    decoded: Option<(i64, State)>,
}

impl Etcd {
    pub fn open(url: &str, run_id: &str, timeout: Duration) -> Result<Etcd, RendezvousError> {
        let url = url.trim_end_matches('/').to_string();
        if reqwest::Url::parse(&url).is_err() {
            return Err(RendezvousError::Store {
                endpoint: url,
                problem: "not a URL: give --rdzv-endpoint HOST[:PORT] or http://HOST:PORT".into(),
            });
        }
        let http = http_client(&url, timeout).map_err(|e| RendezvousError::Store {
            endpoint: url.clone(),
            problem: e.to_string(),
        })?;
        Ok(Etcd {
            prefix: format!("/trainctl/{run_id}/"),
            run_id: run_id.to_string(),
            url,
            timeout,
            http,
            shared: Arc::default(),
            primary: true,
            watching: false,
            seen: 0,
            announced: None,
            decoded: None,
        })
    }

    /// The mirror, its watch started if this is the reading connection.
    fn mirror(&mut self) -> &Mirror {
        if self.primary && !self.watching {
            self.watching = true;
            let range = Range {
                url: self.url.clone(),
                // `alive/...` and `state`, in key order; `wants/` sorts after.
                start: self.key("alive/"),
                end: prefix_end(&self.key("state")),
            };
            let (mirror, timeout) = (self.shared.mirror.clone(), self.timeout);
            let started = std::thread::Builder::new()
                .name("rdzv-etcd-watch".into())
                .spawn(move || mirror::follow(mirror, range, timeout));
            if let Err(e) = started {
                tracing::warn!(error = %e, "cannot start the etcd watch; reading etcd at each poll");
            }
        }
        &self.shared.mirror
    }

    fn lease(&self) -> Option<String> {
        self.shared
            .lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_lease(&self, id: Option<String>) {
        *self.shared.lease.lock().unwrap_or_else(|e| e.into_inner()) = id;
    }

    /// After a transaction on the record answered with its revision: waits (a store timeout
    /// at most) for the mirror to hold that revision or a later one, so the next read sees it.
    fn catch_up(&mut self, revision: i64) {
        let (key, timeout) = (self.key("state"), self.timeout);
        self.mirror().wait_until(timeout, |v| {
            v.kvs
                .get(&key)
                .map_or(revision == 0, |e| e.mod_revision >= revision)
        });
    }

    fn read_direct(&mut self) -> Result<Read, RendezvousError> {
        let key = self.key("state");
        let got = self.post("/v3/kv/range", json!({ "key": B64.encode(&key) }))?;
        let Some(kv) = got.get("kvs").and_then(|k| k.get(0)) else {
            return Ok(Read {
                state: None,
                token: None,
            });
        };
        let value = kv
            .get("value")
            .and_then(Value::as_str)
            .and_then(|v| B64.decode(v).ok())
            .unwrap_or_default();
        let revision = string_field(kv, "mod_revision")
            .ok_or_else(|| self.error("record without revision"))?;
        Ok(Read {
            state: Some(unpack(&key, &value)?),
            token: Some(revision.into_bytes()),
        })
    }

    fn alive_direct(&mut self) -> Result<BTreeSet<String>, RendezvousError> {
        let prefix = self.key("alive/");
        let got = self.post(
            "/v3/kv/range",
            json!({
                "key": B64.encode(&prefix),
                "range_end": B64.encode(prefix_end(&prefix)),
                "keys_only": true,
            }),
        )?;
        let kvs = got.get("kvs").and_then(Value::as_array);
        Ok(kvs
            .into_iter()
            .flatten()
            .filter_map(|kv| kv.get("key")?.as_str())
            .filter_map(|k| B64.decode(k).ok())
            .filter_map(|k| String::from_utf8(k).ok())
            .filter_map(|k| k.strip_prefix(&prefix).map(str::to_string))
            .collect())
    }

    fn wants(&self, round: u64) -> String {
        self.key(&format!("wants/{round:020}/"))
    }

    /// Host and port of the endpoint, to find this host's address on the route to it.
    pub fn host_port(&self) -> Option<(String, u16)> {
        let url = reqwest::Url::parse(&self.url).ok()?;
        Some((url.host_str()?.to_string(), url.port_or_known_default()?))
    }

    /// First contact: etcd's status. Nothing listening is an error worth waiting on (etcd may
    /// be starting); something that accepts the connection and then does not answer, or
    /// answers but not as etcd does, is [`RendezvousError::NotAStore`]: waiting will not help.
    pub fn probe(&self) -> Result<(), RendezvousError> {
        let not_etcd = |problem: String| RendezvousError::NotAStore {
            endpoint: self.url.clone(),
            problem,
        };
        let response = self
            .http
            .post(format!("{}/v3/maintenance/status", self.url))
            .body("{}")
            .send()
            .map_err(|e| {
                if e.is_timeout() && !e.is_connect() {
                    not_etcd(format!(
                        "it took the connection but sent nothing in {:.0} s",
                        self.timeout.as_secs_f64()
                    ))
                } else {
                    self.error(format!("{e} (is etcd running there?)"))
                }
            })?;
        let status = response.status();
        let text = response.text().map_err(|e| self.error(e))?;
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v.get("version").is_some() => Ok(()),
            _ => Err(not_etcd(format!(
                "/v3/maintenance/status: HTTP {status}, not etcd's status: {:?}",
                text.chars().take(200).collect::<String>()
            ))),
        }
    }

    fn error(&self, problem: impl std::fmt::Display) -> RendezvousError {
        RendezvousError::Store {
            endpoint: self.url.clone(),
            problem: problem.to_string(),
        }
    }

    fn post(&self, path: &str, body: Value) -> Result<Value, RendezvousError> {
        let response = self
            .http
            .post(format!("{}{path}", self.url))
            .body(body.to_string())
            .send()
            .map_err(|e| self.error(format!("{e} (is etcd running there?)")))?;
        let status = response.status();
        let text = response.text().map_err(|e| self.error(e))?;
        let value: Value = serde_json::from_str(&text).map_err(|_| {
            self.error(format!(
                "{path}: HTTP {status}, not etcd's JSON: {:?}",
                text.chars().take(200).collect::<String>()
            ))
        })?;
        if !status.is_success() {
            let message = value
                .get("message")
                .or_else(|| value.get("error"))
                .and_then(Value::as_str)
                .unwrap_or("");
            return Err(self.error(format!("{path}: HTTP {status}: {message}")));
        }
        Ok(value)
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    fn grant(&mut self, node: &str, ttl: Duration) -> Result<(), RendezvousError> {
        let ttl_s = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let granted = self.post("/v3/lease/grant", json!({ "TTL": ttl_s }))?;
        let id =
            string_field(&granted, "ID").ok_or_else(|| self.error("lease grant without ID"))?;
        self.post(
            "/v3/kv/put",
            json!({
                "key": B64.encode(self.key(&format!("alive/{node}"))),
                "value": B64.encode(b"1"),
                "lease": id,
            }),
        )?;
        self.set_lease(Some(id));
        Ok(())
    }
}

/// Marks a record stored deflated: every agent's watch receives each write of the record,
/// which lists every node, so its size times the agents is what a round costs etcd to send.
const DEFLATED: &[u8] = b"trainctl-deflate\n";

/// A record as stored in etcd: deflated past 1 KiB (a 256-node record shrinks about 5x).
fn pack(state: &State) -> Vec<u8> {
    use std::io::Write as _;
    let json = encode(state);
    if json.len() < 1024 {
        return json;
    }
    let mut z = flate2::write::DeflateEncoder::new(DEFLATED.to_vec(), flate2::Compression::fast());
    match z.write_all(&json).and_then(|()| z.finish()) {
        Ok(packed) => packed,
        Err(_) => json,
    }
}

/// The record in `bytes` (deflated or not), refusing anything that is not one of ours.
fn unpack(key: &str, bytes: &[u8]) -> Result<State, RendezvousError> {
    use std::io::Read as _;
    let Some(packed) = bytes.strip_prefix(DEFLATED) else {
        return decode(key, bytes);
    };
    // Bounded: a record of 10,000 nodes is a few MB.
    let mut json = Vec::new();
    flate2::read::DeflateDecoder::new(packed)
        .take(64 << 20)
        .read_to_end(&mut json)
        .map_err(|e| RendezvousError::BadRecord {
            key: key.to_string(),
            problem: format!("not deflate data ({e})"),
        })?;
    decode(key, &json)
}

/// An HTTP client for etcd at `url`, each call (or each read of a stream) limited to
/// `timeout`. For plain `http://` it loads no TLS roots: reading the system's certificates
/// costs each agent tens of milliseconds of CPU, which 256 agents starting at once on two cores
/// could not afford.
fn http_client(url: &str, timeout: Duration) -> reqwest::Result<reqwest::blocking::Client> {
    reqwest::blocking::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .tls_built_in_root_certs(!url.starts_with("http://"))
        .build()
}

/// etcd's gateway writes 64-bit numbers as strings, and leaves out zero values.
fn string_field(v: &Value, name: &str) -> Option<String> {
    match v.get(name)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The key just after every key with `prefix` (etcd's range end for a prefix).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl Backend for Etcd {
    fn describe(&self) -> String {
        format!("etcd at {}", self.url)
    }

    fn read(&mut self) -> Result<Read, RendezvousError> {
        let key = self.key("state");
        let (state, generation) = {
            let view = self.mirror().view();
            if !view.live {
                drop(view);
                return self.read_direct();
            }
            (view.kvs.get(&key).cloned(), view.generation)
        };
        self.seen = generation;
        let Some(entry) = state else {
            return Ok(Read {
                state: None,
                token: None,
            });
        };
        let state = match &self.decoded {
            Some((revision, state)) if *revision == entry.mod_revision => state.clone(),
            _ => {
                let state = unpack(&key, &entry.value)?;
                self.decoded = Some((entry.mod_revision, state.clone()));
                state
            }
        };
        Ok(Read {
            state: Some(state),
            token: Some(entry.mod_revision.to_string().into_bytes()),
        })
    }

    fn write(&mut self, token: Option<&[u8]>, next: &State) -> Result<bool, RendezvousError> {
        let key = B64.encode(self.key("state"));
        let compare = match token {
            Some(rev) => json!({
                "key": key, "target": "MOD", "result": "EQUAL",
                "mod_revision": String::from_utf8_lossy(rev),
            }),
            None => json!({
                "key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0",
            }),
        };
        let answer = self.post(
            "/v3/kv/txn",
            json!({
                "compare": [compare],
                "success": [{ "request_put": { "key": key, "value": B64.encode(pack(next)) } }],
                // Lost: the record's revision now, to wait for the mirror to show it.
                "failure": [{ "request_range": { "key": key, "keys_only": true } }],
            }),
        )?;
        let succeeded = answer.get("succeeded").and_then(Value::as_bool) == Some(true);
        let revision = if succeeded {
            answer
                .get("header")
                .and_then(|h| string_field(h, "revision"))
        } else {
            answer
                .pointer("/responses/0/response_range/kvs/0")
                .and_then(|kv| string_field(kv, "mod_revision"))
        };
        self.catch_up(revision.and_then(|r| r.parse().ok()).unwrap_or(0));
        Ok(succeeded)
    }

    fn heartbeat(&mut self, node: &str, ttl: Duration) -> Result<(), RendezvousError> {
        let Some(id) = self.lease() else {
            return self.grant(node, ttl);
        };
        let answer = match self.post("/v3/lease/keepalive", json!({ "ID": id })) {
            Ok(answer) => answer,
            Err(e) => {
                // The watch may be stuck on the same dead link: read afresh once it is back.
                self.shared.mirror.suspect();
                return Err(e);
            }
        };
        let ttl_left = answer
            .get("result")
            .and_then(|r| string_field(r, "TTL"))
            .and_then(|t| t.parse::<i64>().ok())
            .unwrap_or(0);
        if ttl_left <= 0 {
            // The lease expired (a long outage): this node was declared gone; come back.
            tracing::warn!(node, "etcd lease expired; granting a new one");
            self.grant(node, ttl)?;
        }
        Ok(())
    }

    fn alive(&mut self) -> Result<BTreeSet<String>, RendezvousError> {
        let prefix = self.key("alive/");
        let view = self.mirror().view();
        if !view.live {
            drop(view);
            return self.alive_direct();
        }
        Ok(view
            .kvs
            .range(prefix.clone()..)
            .map_while(|(k, _)| k.strip_prefix(&prefix))
            .map(str::to_string)
            .collect())
    }

    fn forget(&mut self, _node: &str) -> Result<(), RendezvousError> {
        let lease = self
            .shared
            .lease
            .lock()
            .map(|mut l| l.take())
            .ok()
            .flatten();
        if let Some(id) = lease {
            self.post("/v3/lease/revoke", json!({ "ID": id }))?;
        }
        Ok(())
    }

    fn reconnect(&self) -> Result<Box<dyn Backend>, RendezvousError> {
        // A clone of the client is another connection (its pool opens one per caller at a
        // time) on the same I/O thread.
        Ok(Box::new(Etcd {
            url: self.url.clone(),
            run_id: self.run_id.clone(),
            prefix: self.prefix.clone(),
            timeout: self.timeout,
            http: self.http.clone(),
            shared: self.shared.clone(),
            primary: false,
            watching: false,
            seen: 0,
            announced: None,
            decoded: None,
        }))
    }

    fn announces(&self) -> bool {
        true
    }

    fn announce(&mut self, round: u64, node: &Node) -> Result<(), RendezvousError> {
        let Some(lease) = self.lease() else {
            return Err(self.error("no lease to announce this node with yet"));
        };
        let key = format!("{}{}", self.wants(round), node.id);
        let value = serde_json::to_vec(node).unwrap_or_default();
        let mut ops = Vec::new();
        match &self.announced {
            Some((k, l, v)) if *k == key && *l == lease && *v == value => return Ok(()),
            Some((old, _, _)) if *old != key => ops.push(json!({
                "request_delete_range": { "key": B64.encode(old) }
            })),
            _ => {}
        }
        ops.push(json!({ "request_put": {
            "key": B64.encode(&key), "value": B64.encode(&value), "lease": lease,
        }}));
        self.post("/v3/kv/txn", json!({ "success": ops }))?;
        self.announced = Some((key, lease, value));
        Ok(())
    }

    fn announced(&mut self, round: u64) -> Result<Vec<Node>, RendezvousError> {
        let prefix = self.wants(round);
        let got = self.post(
            "/v3/kv/range",
            json!({
                "key": B64.encode(&prefix),
                "range_end": B64.encode(prefix_end(&prefix)),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
            }),
        )?;
        Ok(got
            .get("kvs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|kv| B64.decode(kv.get("value")?.as_str()?).ok())
            // Someone else's key under ours is skipped, never trusted.
            .filter_map(|v| serde_json::from_slice::<Node>(&v).ok())
            .collect())
    }

    fn wait_change(&mut self, timeout: Duration) {
        // Not live, nothing bumps the generation: a plain wait, as without a mirror.
        let seen = self.seen;
        self.mirror().wait_past(seen, timeout);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if self.primary {
            self.shared.mirror.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_record_is_stored_deflated_and_read_back() {
        let node = |i: usize| Node {
            id: format!("trainer-worker-{i}-7f9c2"),
            addr: format!("198.18.{}.{}", i / 250, i % 250 + 1),
            port: 29500,
            nproc: 8,
            health: None,
        };
        let state = State {
            participants: (0..256).map(node).collect(),
            expected: (0..256).map(|i| node(i).id).collect(),
            ..State::default()
        };
        let json = encode(&state);
        let packed = pack(&state);
        assert!(packed.starts_with(DEFLATED));
        assert!(
            packed.len() * 4 < json.len(),
            "{} vs {}",
            packed.len(),
            json.len()
        );
        assert_eq!(unpack("k", &packed).unwrap(), state);
        let small = State::default();
        assert_eq!(
            pack(&small),
            encode(&small),
            "a small record stays plain JSON"
        );
        let mut broken = DEFLATED.to_vec();
        broken.extend_from_slice(b"not deflate");
        assert!(matches!(
            unpack("k", &broken),
            Err(RendezvousError::BadRecord { .. })
        ));
    }

    #[test]
    fn prefix_end_is_the_next_key() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
