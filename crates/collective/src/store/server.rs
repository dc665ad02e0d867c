//! The store's server: one thread per connection over a shared table of keys, with
//! compare-and-set, waits and liveness keys.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::CollectiveError;
use crate::wire::{MAX_CONTROL_FRAME, Role, read_frame, write_frame};

use super::{Request, Response};
use crate::wire::accept_handshake;

#[derive(Default)]
pub(super) struct Inner {
    map: HashMap<String, Vec<u8>>,
    /// Liveness keys: when each expires, and the connection that keeps it.
    alive: HashMap<String, (Instant, u64)>,
}

#[derive(Default)]
pub(super) struct Table {
    inner: Mutex<Inner>,
    changed: Condvar,
}

/// The longest a liveness key may live without a heartbeat (a bound on hostile requests).
pub(super) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

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
            Request::Alive { prefix, known } => {
                let now = Instant::now();
                let mut t = self.lock();
                t.alive.retain(|_, (expires, _)| *expires > now);
                let mut keys: Vec<String> = t
                    .alive
                    .keys()
                    .filter(|k| k.starts_with(&prefix))
                    .cloned()
                    .collect();
                drop(t);
                keys.sort();
                if known.is_some_and(|k| k == super::protocol::keys_fingerprint(&keys)) {
                    Response::TimedOut
                } else {
                    Response::Keys(keys)
                }
            }
            Request::Forget { key } => {
                self.lock().alive.remove(&key);
                Response::Done
            }
            Request::Scan { prefix } => {
                let t = self.lock();
                let mut pairs: Vec<(String, Vec<u8>)> = t
                    .map
                    .iter()
                    .filter(|(k, _)| k.starts_with(&prefix))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                drop(t);
                pairs.sort();
                Response::Pairs(pairs)
            }
            Request::GetChanged {
                key,
                known,
                timeout_ms,
            } => self.wait_for(timeout_ms, |t| {
                let value = t.map.get(&key);
                (super::fingerprint(value.map(Vec::as_slice)) != known)
                    .then(|| Response::Maybe(value.cloned()))
            }),
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

pub(super) fn accept_loop(
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

pub(super) fn serve(
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
