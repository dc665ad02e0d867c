//! The store's requests and responses, and their encoding in frames.

use crate::wire::{Decoder, Encoder, WireError};

/// A request to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
    Wait {
        keys: Vec<String>,
        timeout_ms: u64,
    },
    /// Sets `key` to `value` if its current value is `expected` (`None`: absent).
    CompareSet {
        key: String,
        expected: Option<Vec<u8>>,
        value: Vec<u8>,
    },
    /// The value of `key` now, without waiting.
    TryGet {
        key: String,
    },
    /// Keeps liveness key `key` alive for `ttl_ms` more, owned by this connection.
    Heartbeat {
        key: String,
        ttl_ms: u64,
    },
    /// The liveness keys under `prefix` that are alive (`TimedOut` instead if their
    /// [`fingerprint`], of the sorted keys joined by newlines, is `known`: a poll of a set that
    /// rarely changes then costs a few bytes, not one key per node).
    Alive {
        prefix: String,
        known: Option<u64>,
    },
    /// Removes liveness key `key` (an orderly exit).
    Forget {
        key: String,
    },
    /// The keys under `prefix` and their values, sorted by key.
    Scan {
        prefix: String,
    },
    /// The value of `key` once its [`fingerprint`] is not `known` (`TimedOut` if it still is
    /// after `timeout_ms`): a poll that costs a few bytes while nothing changes, and wakes at
    /// once when something does.
    GetChanged {
        key: String,
        known: u64,
        timeout_ms: u64,
    },
}

/// What a set of liveness keys (sorted) is told apart by in [`Request::Alive`].
pub(super) fn keys_fingerprint(keys: &[String]) -> u64 {
    fingerprint(Some(keys.join("\n").as_bytes()))
}

/// What a value is told apart by in [`Request::GetChanged`]; `None` (no value) has its own.
pub fn fingerprint(value: Option<&[u8]>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The store's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Done,
    Value(Vec<u8>),
    Counter(i64),
    TimedOut,
    /// Answer to `CompareSet`: whether it was written, and the value now.
    Swapped {
        swapped: bool,
        current: Option<Vec<u8>>,
    },
    Maybe(Option<Vec<u8>>),
    Keys(Vec<String>),
    Pairs(Vec<(String, Vec<u8>)>),
}

pub(super) fn encode_option(e: Encoder, v: &Option<Vec<u8>>) -> Encoder {
    match v {
        None => e.u8(0),
        Some(v) => e.u8(1).bytes(v),
    }
}

pub(super) fn decode_option(d: &mut Decoder<'_>, what: &str) -> Result<Option<Vec<u8>>, WireError> {
    match d.u8(what)? {
        0 => Ok(None),
        1 => Ok(Some(d.bytes(what)?.to_vec())),
        other => Err(WireError::Malformed(format!(
            "{what}: bad option tag {other}"
        ))),
    }
}

/// Reads a count of strings, bounded by what the frame can hold (each takes 4 bytes at least).
pub(super) fn decode_strings(
    d: &mut Decoder<'_>,
    buf: &[u8],
    what: &str,
) -> Result<Vec<String>, WireError> {
    let n = d.u32(what)? as usize;
    if n > buf.len() / 4 {
        return Err(WireError::Malformed(format!(
            "{what}: {n} strings cannot fit in {} bytes",
            buf.len()
        )));
    }
    (0..n).map(|_| d.string(what)).collect()
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Request::Set { key, value } => Encoder::new().u8(1).str(key).bytes(value).finish(),
            Request::Get { key, timeout_ms } => {
                Encoder::new().u8(2).str(key).u64(*timeout_ms).finish()
            }
            Request::Add { key, delta } => Encoder::new().u8(3).str(key).i64(*delta).finish(),
            Request::Wait { keys, timeout_ms } => {
                let mut e = Encoder::new().u8(4).u32(keys.len() as u32);
                for k in keys {
                    e = e.str(k);
                }
                e.u64(*timeout_ms).finish()
            }
            Request::CompareSet {
                key,
                expected,
                value,
            } => encode_option(Encoder::new().u8(5).str(key), expected)
                .bytes(value)
                .finish(),
            Request::TryGet { key } => Encoder::new().u8(6).str(key).finish(),
            Request::Heartbeat { key, ttl_ms } => {
                Encoder::new().u8(7).str(key).u64(*ttl_ms).finish()
            }
            Request::Alive {
                prefix,
                known: None,
            } => Encoder::new().u8(8).str(prefix).finish(),
            Request::Alive {
                prefix,
                known: Some(known),
            } => Encoder::new().u8(12).str(prefix).u64(*known).finish(),
            Request::Forget { key } => Encoder::new().u8(9).str(key).finish(),
            Request::Scan { prefix } => Encoder::new().u8(10).str(prefix).finish(),
            Request::GetChanged {
                key,
                known,
                timeout_ms,
            } => Encoder::new()
                .u8(11)
                .str(key)
                .u64(*known)
                .u64(*timeout_ms)
                .finish(),
        }
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut d = Decoder::new(buf);
        let req = match d.u8("request tag")? {
            1 => Request::Set {
                key: d.string("key")?,
                value: d.bytes("value")?.to_vec(),
            },
            2 => Request::Get {
                key: d.string("key")?,
                timeout_ms: d.u64("timeout")?,
            },
            3 => Request::Add {
                key: d.string("key")?,
                delta: d.i64("delta")?,
            },
            4 => Request::Wait {
                keys: decode_strings(&mut d, buf, "wait keys")?,
                timeout_ms: d.u64("timeout")?,
            },
            5 => Request::CompareSet {
                key: d.string("key")?,
                expected: decode_option(&mut d, "expected value")?,
                value: d.bytes("value")?.to_vec(),
            },
            6 => Request::TryGet {
                key: d.string("key")?,
            },
            7 => Request::Heartbeat {
                key: d.string("key")?,
                ttl_ms: d.u64("ttl")?,
            },
            8 => Request::Alive {
                prefix: d.string("prefix")?,
                known: None,
            },
            12 => Request::Alive {
                prefix: d.string("prefix")?,
                known: Some(d.u64("known fingerprint")?),
            },
            9 => Request::Forget {
                key: d.string("key")?,
            },
            10 => Request::Scan {
                prefix: d.string("prefix")?,
            },
            11 => Request::GetChanged {
                key: d.string("key")?,
                known: d.u64("known fingerprint")?,
                timeout_ms: d.u64("timeout")?,
            },
            other => return Err(WireError::Malformed(format!("unknown request tag {other}"))),
        };
        d.end("store request")?;
        Ok(req)
    }
}

impl Response {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Response::Done => Encoder::new().u8(1).finish(),
            Response::Value(v) => Encoder::new().u8(2).bytes(v).finish(),
            Response::Counter(n) => Encoder::new().u8(3).i64(*n).finish(),
            Response::TimedOut => Encoder::new().u8(4).finish(),
            Response::Swapped { swapped, current } => {
                encode_option(Encoder::new().u8(5).u8(*swapped as u8), current).finish()
            }
            Response::Maybe(v) => encode_option(Encoder::new().u8(6), v).finish(),
            Response::Keys(keys) => {
                let mut e = Encoder::new().u8(7).u32(keys.len() as u32);
                for k in keys {
                    e = e.str(k);
                }
                e.finish()
            }
            Response::Pairs(pairs) => {
                let mut e = Encoder::new().u8(8).u32(pairs.len() as u32);
                for (k, v) in pairs {
                    e = e.str(k).bytes(v);
                }
                e.finish()
            }
        }
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut d = Decoder::new(buf);
        let resp = match d.u8("response tag")? {
            1 => Response::Done,
            2 => Response::Value(d.bytes("value")?.to_vec()),
            3 => Response::Counter(d.i64("counter")?),
            4 => Response::TimedOut,
            5 => Response::Swapped {
                swapped: match d.u8("swapped")? {
                    0 => false,
                    1 => true,
                    other => {
                        return Err(WireError::Malformed(format!("swapped flag {other}")));
                    }
                },
                current: decode_option(&mut d, "current value")?,
            },
            6 => Response::Maybe(decode_option(&mut d, "value")?),
            7 => Response::Keys(decode_strings(&mut d, buf, "keys")?),
            8 => {
                let n = d.u32("pairs")? as usize;
                if n > buf.len() / 8 {
                    return Err(WireError::Malformed(format!(
                        "pairs: {n} pairs cannot fit in {} bytes",
                        buf.len()
                    )));
                }
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    pairs.push((d.string("key")?, d.bytes("value")?.to_vec()));
                }
                Response::Pairs(pairs)
            }
            other => {
                return Err(WireError::Malformed(format!(
                    "unknown response tag {other}"
                )));
            }
        };
        d.end("store response")?;
        Ok(resp)
    }
}
