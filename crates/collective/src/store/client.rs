//! The store's client, and connecting with retries while a host's name or port is not there
//! yet.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::CollectiveError;
use crate::wire::{Hello, MAX_CONTROL_FRAME, WireError, read_frame, write_frame};

use super::{Request, Response, is_timeout};
use crate::wire::offer_handshake;

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

    #[cfg(test)]
    /// The value of `key` now, if any.
    pub(crate) fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>, CollectiveError> {
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
            known: None,
        })? {
            Response::Keys(k) => Ok(k),
            other => Err(unexpected(other)),
        }
    }

    /// The live liveness keys under `prefix`, sorted, unless they are `known` (`None`).
    pub fn alive_changed(
        &mut self,
        prefix: &str,
        known: &[String],
    ) -> Result<Option<Vec<String>>, CollectiveError> {
        match self.call(&Request::Alive {
            prefix: prefix.into(),
            known: Some(super::protocol::keys_fingerprint(known)),
        })? {
            Response::Keys(k) => Ok(Some(k)),
            Response::TimedOut => Ok(None),
            other => Err(unexpected(other)),
        }
    }

    /// The keys under `prefix` and their values, sorted by key.
    pub fn scan(&mut self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CollectiveError> {
        match self.call(&Request::Scan {
            prefix: prefix.into(),
        })? {
            Response::Pairs(p) => Ok(p),
            other => Err(unexpected(other)),
        }
    }

    /// The value of `key` (`Some(None)`: absent) once it is not the one whose
    /// [`super::fingerprint`] is `known`, waiting up to `wait`; `None`: still that one.
    #[allow(clippy::option_option)]
    pub fn get_changed(
        &mut self,
        key: &str,
        known: u64,
        wait: Duration,
    ) -> Result<Option<Option<Vec<u8>>>, CollectiveError> {
        let timeout_ms = (wait.as_millis() as u64).min(self.server_wait_ms());
        match self.call(&Request::GetChanged {
            key: key.into(),
            known,
            timeout_ms,
        })? {
            Response::Maybe(v) => Ok(Some(v)),
            Response::TimedOut => Ok(None),
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

pub(super) fn unexpected(r: Response) -> CollectiveError {
    CollectiveError::Wire(WireError::Malformed(format!(
        "unexpected store response {r:?}"
    )))
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
