//! The etcd backend: etcd's v3 API through its JSON gateway (`/v3/kv/range`, `/v3/kv/txn`,
//! `/v3/lease/*`), so it needs no `--enable-v2` and no gRPC stack. The record is one key
//! written by a transaction that compares its mod revision; liveness is a key per node attached
//! to that node's lease, which etcd deletes when the lease is not kept alive.
//!
//! Keys live under `/trainctl/<run id>/`.

use std::collections::BTreeSet;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use super::{Backend, Read, decode, encode};
use crate::RendezvousError;
use crate::state::State;

pub struct Etcd {
    url: String,
    run_id: String,
    prefix: String,
    timeout: Duration,
    http: reqwest::blocking::Client,
    /// This node's lease, once granted.
    lease: Option<String>,
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
        let http = reqwest::blocking::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| RendezvousError::Store {
                endpoint: url.clone(),
                problem: e.to_string(),
            })?;
        Ok(Etcd {
            prefix: format!("/trainctl/{run_id}/"),
            run_id: run_id.to_string(),
            url,
            timeout,
            http,
            lease: None,
        })
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
        self.lease = Some(id);
        Ok(())
    }
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
            state: Some(decode(&key, &value)?),
            token: Some(revision.into_bytes()),
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
                "success": [{ "request_put": { "key": key, "value": B64.encode(encode(next)) } }],
            }),
        )?;
        Ok(answer.get("succeeded").and_then(Value::as_bool) == Some(true))
    }

    fn heartbeat(&mut self, node: &str, ttl: Duration) -> Result<(), RendezvousError> {
        let Some(id) = self.lease.clone() else {
            return self.grant(node, ttl);
        };
        let answer = self.post("/v3/lease/keepalive", json!({ "ID": id }))?;
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

    fn forget(&mut self, _node: &str) -> Result<(), RendezvousError> {
        if let Some(id) = self.lease.take() {
            self.post("/v3/lease/revoke", json!({ "ID": id }))?;
        }
        Ok(())
    }

    fn reconnect(&self) -> Result<Box<dyn Backend>, RendezvousError> {
        Ok(Box::new(Etcd::open(&self.url, &self.run_id, self.timeout)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_key() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
