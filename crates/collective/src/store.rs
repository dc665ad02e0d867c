//! A key-value store over TCP, torch's TCPStore in spirit: rank 0 hosts it at
//! MASTER_ADDR:MASTER_PORT and peers use it to find each other. The elastic agent hosts one
//! too (the c10d rendezvous), which also uses compare-and-set and liveness keys: a liveness key
//! lives until its time-to-live passes without a heartbeat, or until the connection that set it
//! closes (a killed agent is gone at once, a cut link after the TTL).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::CollectiveError;
use crate::wire::{
    Decoder, Encoder, HandshakeReply, Hello, MAX_CONTROL_FRAME, Role, WireError, read_frame,
    write_frame,
};

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
    /// The liveness keys under `prefix` that are alive.
    Alive {
        prefix: String,
    },
    /// Removes liveness key `key` (an orderly exit).
    Forget {
        key: String,
    },
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
}

fn encode_option(e: Encoder, v: &Option<Vec<u8>>) -> Encoder {
    match v {
        None => e.u8(0),
        Some(v) => e.u8(1).bytes(v),
    }
}

fn decode_option(d: &mut Decoder<'_>, what: &str) -> Result<Option<Vec<u8>>, WireError> {
    match d.u8(what)? {
        0 => Ok(None),
        1 => Ok(Some(d.bytes(what)?.to_vec())),
        other => Err(WireError::Malformed(format!(
            "{what}: bad option tag {other}"
        ))),
    }
}

/// Reads a count of strings, bounded by what the frame can hold (each takes 4 bytes at least).
fn decode_strings(d: &mut Decoder<'_>, buf: &[u8], what: &str) -> Result<Vec<String>, WireError> {
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
            Request::Alive { prefix } => Encoder::new().u8(8).str(prefix).finish(),
            Request::Forget { key } => Encoder::new().u8(9).str(key).finish(),
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
            },
            9 => Request::Forget {
                key: d.string("key")?,
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

#[derive(Default)]
struct Inner {
    map: HashMap<String, Vec<u8>>,
    /// Liveness keys: when each expires, and the connection that keeps it.
    alive: HashMap<String, (Instant, u64)>,
}

#[derive(Default)]
struct Table {
    inner: Mutex<Inner>,
    changed: Condvar,
}

/// The longest a liveness key may live without a heartbeat (a bound on hostile requests).
const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the table until `ready` holds or `timeout_ms` passes.
    fn wait_for(
        &self,
        timeout_ms: u64,
        mut ready: impl FnMut(&Inner) -> Option<Response>,
    ) -> Response {
        let deadline =
            Instant::now() + Duration::from_millis(timeout_ms.min(MAX_TTL.as_millis() as u64));
        let mut inner = self.lock();
        loop {
            if let Some(r) = ready(&inner) {
                return r;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Response::TimedOut;
            };
            inner = self
                .changed
                .wait_timeout(inner, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Runs `f` on the table under the lock and wakes every waiter.
    fn update(&self, f: impl FnOnce(&mut Inner) -> Response) -> Response {
        let response = f(&mut self.lock());
        self.changed.notify_all();
        response
    }

    fn handle(&self, req: Request, conn: u64) -> Response {
        match req {
            Request::Get { key, timeout_ms } => self.wait_for(timeout_ms, |t| {
                t.map.get(&key).cloned().map(Response::Value)
            }),
            Request::Wait { keys, timeout_ms } => self.wait_for(timeout_ms, |t| {
                keys.iter()
                    .all(|k| t.map.contains_key(k))
                    .then_some(Response::Done)
            }),
            Request::TryGet { key } => Response::Maybe(self.lock().map.get(&key).cloned()),
            Request::Set { key, value } => self.update(|t| {
                t.map.insert(key, value);
                Response::Done
            }),
            Request::Add { key, delta } => self.update(|t| {
                let current = t
                    .map
                    .get(&key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let next = current.saturating_add(delta);
                t.map.insert(key, next.to_string().into_bytes());
                Response::Counter(next)
            }),
            Request::CompareSet {
                key,
                expected,
                value,
            } => self.update(|t| {
                let swapped = t.map.get(&key) == expected.as_ref();
                if swapped {
                    t.map.insert(key.clone(), value);
                }
                Response::Swapped {
                    swapped,
                    current: t.map.get(&key).cloned(),
                }
            }),
            Request::Heartbeat { key, ttl_ms } => {
                let ttl = Duration::from_millis(ttl_ms).min(MAX_TTL);
                self.lock().alive.insert(key, (Instant::now() + ttl, conn));
                Response::Done
            }
            Request::Alive { prefix } => {
                let now = Instant::now();
                let mut t = self.lock();
                t.alive.retain(|_, (expires, _)| *expires > now);
                let mut keys: Vec<String> = t
                    .alive
                    .keys()
                    .filter(|k| k.starts_with(&prefix))
                    .cloned()
                    .collect();
                keys.sort();
                Response::Keys(keys)
            }
            Request::Forget { key } => {
                self.lock().alive.remove(&key);
                Response::Done
            }
        }
    }

    /// A connection ended: the liveness keys it kept die with it.
    fn disconnected(&self, conn: u64) {
        self.lock().alive.retain(|_, (_, owner)| *owner != conn);
    }
}

/// The hosting side. Dropping it stops accepting and joins the accept thread.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` and serves clients that present `run_id` and `token`.
    pub fn bind(addr: SocketAddr, run_id: &str, token: &str) -> Result<Self, CollectiveError> {
        let listener = TcpListener::bind(addr).map_err(|source| CollectiveError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let (run_id, token) = (run_id.to_string(), token.to_string());
        let acceptor = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("store-accept".into())
                .spawn(move || accept_loop(listener, table, &run_id, &token, &stop))?
        };
        Ok(StoreServer {
            addr,
            stop,
            acceptor: Some(acceptor),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(handle) = self.acceptor.take() {
            let _ = handle.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    table: Arc<Table>,
    run_id: &str,
    token: &str,
    stop: &AtomicBool,
) {
    // Connection threads are detached on purpose: each blocks in a read on a socket whose peer
    // owns its lifetime, and dies with that socket or with the process.
    let mut next_conn = 0u64;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let table = table.clone();
                let (run_id, token) = (run_id.to_string(), token.to_string());
                next_conn += 1;
                let conn = next_conn;
                let _ = std::thread::Builder::new()
                    .name("store-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve(stream, &table, &run_id, &token, conn) {
                            tracing::debug!(%peer, error = %e, "store connection ended");
                        }
                        table.disconnected(conn);
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!(error = %e, "store accept failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Reads the peer's hello and answers it; `Ok(hello)` only when run id and token match.
pub(crate) fn accept_handshake(
    stream: &mut TcpStream,
    run_id: &str,
    token: &str,
    expect: Role,
) -> Result<Hello, CollectiveError> {
    let frame = read_frame(stream, 4096)?.ok_or(WireError::Truncated)?;
    let hello = Hello::decode(&frame)?;
    let refusal = if hello.run_id != run_id {
        Some(format!(
            "run id mismatch: this side is in run {run_id:?}, the peer in run {:?}",
            hello.run_id
        ))
    } else if hello.token != token {
        Some(format!(
            "job token mismatch for run {run_id:?}: the peer was not started by this job's launcher"
        ))
    } else if hello.role != expect {
        Some(format!(
            "unexpected role {:?}, expected {expect:?}",
            hello.role
        ))
    } else {
        None
    };
    match refusal {
        Some(why) => {
            let _ = write_frame(stream, &HandshakeReply::Refused(why.clone()).encode());
            Err(CollectiveError::Refused(why))
        }
        None => {
            write_frame(stream, &HandshakeReply::Accepted.encode())?;
            Ok(hello)
        }
    }
}

/// Sends our hello and reads the acceptor's answer.
pub(crate) fn offer_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
) -> Result<(), CollectiveError> {
    write_frame(stream, &hello.encode())?;
    finish_handshake(stream)
}

pub(crate) fn finish_handshake(stream: &mut TcpStream) -> Result<(), CollectiveError> {
    let frame = read_frame(stream, 4096)?.ok_or(WireError::Truncated)?;
    match HandshakeReply::decode(&frame)? {
        HandshakeReply::Accepted => Ok(()),
        HandshakeReply::Refused(why) => Err(CollectiveError::Refused(why)),
    }
}

fn serve(
    mut stream: TcpStream,
    table: &Table,
    run_id: &str,
    token: &str,
    conn: u64,
) -> Result<(), CollectiveError> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    accept_handshake(&mut stream, run_id, token, Role::StoreClient)?;
    // Clients may idle between requests for as long as they like.
    stream.set_read_timeout(None)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    while let Some(frame) = read_frame(&mut reader, MAX_CONTROL_FRAME)? {
        let response = table.handle(Request::decode(&frame)?, conn);
        write_frame(&mut writer, &response.encode())?;
    }
    Ok(())
}

/// A connection to the store.
pub struct StoreClient {
    stream: TcpStream,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `host:port`, retrying (name resolution included: in a cluster the leader's
    /// DNS name may appear after we start) until `timeout` has passed.
    pub fn connect(
        host: &str,
        port: u16,
        hello: &Hello,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let mut stream = connect_with_retry(host, port, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        offer_handshake(&mut stream, hello)?;
        Ok(StoreClient { stream, timeout })
    }

    /// The local address of our connection: the address peers can reach us at.
    pub fn local_ip(&self) -> Result<std::net::IpAddr, CollectiveError> {
        Ok(self.stream.local_addr()?.ip())
    }

    fn call(&mut self, req: &Request) -> Result<Response, CollectiveError> {
        write_frame(&mut self.stream, &req.encode()).map_err(|e| self.lost(e))?;
        let frame = read_frame(&mut self.stream, MAX_CONTROL_FRAME)
            .map_err(|e| self.lost(e))?
            .ok_or_else(|| self.lost(WireError::Truncated))?;
        Ok(Response::decode(&frame)?)
    }

    fn lost(&self, e: WireError) -> CollectiveError {
        match e {
            WireError::Io(io) if is_timeout(&io) => CollectiveError::Timeout {
                what: "the store (rank 0)".into(),
                after: self.timeout,
            },
            WireError::Truncated => CollectiveError::PeerLost("the store (rank 0)".into()),
            other => other.into(),
        }
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CollectiveError> {
        self.call(&Request::Set {
            key: key.into(),
            value: value.to_vec(),
        })?;
        Ok(())
    }

    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, CollectiveError> {
        match self.call(&Request::Add {
            key: key.into(),
            delta,
        })? {
            Response::Counter(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    /// Waits for `key` to be set, up to the client's timeout.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, CollectiveError> {
        let timeout_ms = self.server_wait_ms();
        match self.call(&Request::Get {
            key: key.into(),
            timeout_ms,
        })? {
            Response::Value(v) => Ok(v),
            Response::TimedOut => Err(CollectiveError::Timeout {
                what: format!("key {key:?} in the store"),
                after: self.timeout,
            }),
            other => Err(unexpected(other)),
        }
    }

    pub fn wait(&mut self, keys: &[&str]) -> Result<(), CollectiveError> {
        let timeout_ms = self.server_wait_ms();
        match self.call(&Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout_ms,
        })? {
            Response::Done => Ok(()),
            Response::TimedOut => Err(CollectiveError::Timeout {
                what: format!("keys {keys:?} in the store"),
                after: self.timeout,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Sets `key` to `value` if it is `expected` now (`None`: absent). Returns whether it was
    /// written and the value after the call.
    pub fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> Result<(bool, Option<Vec<u8>>), CollectiveError> {
        match self.call(&Request::CompareSet {
            key: key.into(),
            expected: expected.map(<[u8]>::to_vec),
            value: value.to_vec(),
        })? {
            Response::Swapped { swapped, current } => Ok((swapped, current)),
            other => Err(unexpected(other)),
        }
    }

    /// The value of `key` now, if any.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>, CollectiveError> {
        match self.call(&Request::TryGet { key: key.into() })? {
            Response::Maybe(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    /// Keeps liveness key `key` alive for `ttl` more (and for no longer than this connection).
    pub fn heartbeat(&mut self, key: &str, ttl: Duration) -> Result<(), CollectiveError> {
        self.call(&Request::Heartbeat {
            key: key.into(),
            ttl_ms: ttl.as_millis() as u64,
        })?;
        Ok(())
    }

    /// The live liveness keys under `prefix`, sorted.
    pub fn alive(&mut self, prefix: &str) -> Result<Vec<String>, CollectiveError> {
        match self.call(&Request::Alive {
            prefix: prefix.into(),
        })? {
            Response::Keys(k) => Ok(k),
            other => Err(unexpected(other)),
        }
    }

    /// Drops liveness key `key` now.
    pub fn forget(&mut self, key: &str) -> Result<(), CollectiveError> {
        self.call(&Request::Forget { key: key.into() })?;
        Ok(())
    }

    /// The server gives up slightly before our socket does, so a timeout arrives as an answer.
    fn server_wait_ms(&self) -> u64 {
        (self.timeout.as_millis() as u64).saturating_sub(500).max(1)
    }
}

fn unexpected(r: Response) -> CollectiveError {
    CollectiveError::Wire(WireError::Malformed(format!(
        "unexpected store response {r:?}"
    )))
}

pub(crate) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Connects to `host:port`, resolving the name anew on every attempt.
pub fn connect_with_retry(
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<TcpStream, CollectiveError> {
    let deadline = Instant::now() + timeout;
    let mut last_error;
    loop {
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                last_error = format!("no address for {host}");
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                        Ok(s) => {
                            s.set_nodelay(true)?;
                            return Ok(s);
                        }
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve {host}: {e}"),
        }
        if Instant::now() >= deadline {
            return Err(CollectiveError::Connect {
                addr: format!("{host}:{port}"),
                after: timeout,
                last_error,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello(token: &str) -> Hello {
        Hello {
            role: Role::StoreClient,
            run_id: "r".into(),
            token: token.into(),
            rank: 1,
        }
    }

    fn request() -> impl Strategy<Value = Request> {
        prop_oneof![
            (".{0,20}", proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(key, value)| Request::Set { key, value }),
            (".{0,20}", any::<u64>())
                .prop_map(|(key, timeout_ms)| Request::Get { key, timeout_ms }),
            (".{0,20}", any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
            (proptest::collection::vec(".{0,10}", 0..5), any::<u64>())
                .prop_map(|(keys, timeout_ms)| Request::Wait { keys, timeout_ms }),
            (
                ".{0,20}",
                proptest::option::of(proptest::collection::vec(any::<u8>(), 0..32)),
                proptest::collection::vec(any::<u8>(), 0..32)
            )
                .prop_map(|(key, expected, value)| Request::CompareSet {
                    key,
                    expected,
                    value
                }),
            ".{0,20}".prop_map(|key| Request::TryGet { key }),
            (".{0,20}", any::<u64>()).prop_map(|(key, ttl_ms)| Request::Heartbeat { key, ttl_ms }),
            ".{0,20}".prop_map(|prefix| Request::Alive { prefix }),
            ".{0,20}".prop_map(|key| Request::Forget { key }),
        ]
    }

    fn response() -> impl Strategy<Value = Response> {
        prop_oneof![
            Just(Response::Done),
            Just(Response::TimedOut),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(Response::Value),
            any::<i64>().prop_map(Response::Counter),
            (
                any::<bool>(),
                proptest::option::of(proptest::collection::vec(any::<u8>(), 0..32))
            )
                .prop_map(|(swapped, current)| Response::Swapped { swapped, current }),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..32))
                .prop_map(Response::Maybe),
            proptest::collection::vec(".{0,10}", 0..5).prop_map(Response::Keys),
        ]
    }

    proptest! {
        #[test]
        fn requests_round_trip(req in request()) {
            prop_assert_eq!(Request::decode(&req.encode()).unwrap(), req);
        }

        #[test]
        fn responses_round_trip(resp in response()) {
            prop_assert_eq!(Response::decode(&resp.encode()).unwrap(), resp);
        }

        #[test]
        fn garbage_requests_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Request::decode(&bytes);
            let _ = Response::decode(&bytes);
        }
    }

    #[test]
    fn set_get_add_wait_across_clients() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
        let port = server.local_addr().port();
        let mut a =
            StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
        let mut b =
            StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
        let waiter = std::thread::spawn(move || {
            b.wait(&["k"]).unwrap();
            b.get("k").unwrap()
        });
        a.set("k", b"v").unwrap();
        assert_eq!(waiter.join().unwrap(), b"v");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(a.add("n", 3).unwrap(), 5);
    }

    #[test]
    fn compare_set_writes_only_over_the_expected_value() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
        let port = server.local_addr().port();
        let mut c =
            StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
        assert_eq!(c.try_get("k").unwrap(), None);
        assert_eq!(
            c.compare_set("k", None, b"1").unwrap(),
            (true, Some(b"1".to_vec()))
        );
        assert_eq!(
            c.compare_set("k", None, b"2").unwrap(),
            (false, Some(b"1".to_vec())),
            "an absent expectation fails once the key exists"
        );
        assert_eq!(
            c.compare_set("k", Some(b"0"), b"2").unwrap(),
            (false, Some(b"1".to_vec()))
        );
        assert_eq!(
            c.compare_set("k", Some(b"1"), b"2").unwrap(),
            (true, Some(b"2".to_vec()))
        );
        assert_eq!(c.try_get("k").unwrap(), Some(b"2".to_vec()));
    }

    #[test]
    fn liveness_keys_expire_and_die_with_their_connection() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
        let port = server.local_addr().port();
        let connect = || {
            StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap()
        };
        let (mut watcher, mut a, mut b) = (connect(), connect(), connect());
        a.heartbeat("alive/a", Duration::from_secs(60)).unwrap();
        b.heartbeat("alive/b", Duration::from_millis(200)).unwrap();
        watcher
            .heartbeat("other/w", Duration::from_secs(60))
            .unwrap();
        assert_eq!(watcher.alive("alive/").unwrap(), ["alive/a", "alive/b"]);
        // b stops beating: gone after its TTL.
        let deadline = Instant::now() + Duration::from_secs(5);
        while watcher.alive("alive/").unwrap() != ["alive/a"] {
            assert!(Instant::now() < deadline, "alive/b never expired");
            std::thread::sleep(Duration::from_millis(20));
        }
        // a's connection closes (its process died): gone without waiting for the TTL.
        drop(a);
        while !watcher.alive("alive/").unwrap().is_empty() {
            assert!(Instant::now() < deadline, "alive/a outlived its connection");
            std::thread::sleep(Duration::from_millis(20));
        }
        b.heartbeat("alive/b", Duration::from_secs(60)).unwrap();
        b.forget("alive/b").unwrap();
        assert!(watcher.alive("alive/").unwrap().is_empty());
    }

    #[test]
    fn get_of_a_missing_key_times_out() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
        let mut c = StoreClient::connect(
            "127.0.0.1",
            server.local_addr().port(),
            &hello("t"),
            Duration::from_millis(700),
        )
        .unwrap();
        let err = c.get("never").unwrap_err();
        assert!(matches!(err, CollectiveError::Timeout { .. }), "{err}");
    }

    #[test]
    fn wrong_token_is_refused() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
        let err = StoreClient::connect(
            "127.0.0.1",
            server.local_addr().port(),
            &hello("wrong"),
            Duration::from_secs(5),
        )
        .err()
        .expect("a wrong token must be refused");
        assert!(err.to_string().contains("job token mismatch"), "{err}");
    }
}
