//! The c10d backend: trainctl's store (`collective::store`), hosted by the agent whose host is
//! the endpoint. Liveness keys die with the connection that keeps them, so a killed agent is
//! noticed at once; a silent one after its TTL.

use std::collections::BTreeSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use collective::regroup::Failure;
use collective::store::{StoreClient, StoreServer};
use collective::wire::{Hello, Role};

use super::{Backend, Read, decode, encode};
use crate::RendezvousError;
use crate::state::{Node, State};

const STATE_KEY: &str = "rdzv/state";
const ALIVE_PREFIX: &str = "rdzv/alive/";
/// `rdzv/wants/<round>/<node>`: a node that wants to join a round (see [`Backend::announce`]).
const WANTS_PREFIX: &str = "rdzv/wants/";

pub struct C10d {
    host: String,
    port: u16,
    hello: Hello,
    timeout: Duration,
    client: Option<StoreClient>,
    /// The record as last read: a read asks the store for it only if it changed since, so
    /// polling costs a few bytes, not the whole record (which grows with the job).
    cached: Option<Vec<u8>>,
    /// This node's last announcement (key and value).
    announced: Option<(String, Vec<u8>)>,
    /// The liveness keys as last read (asked for again only if they changed).
    alive: Vec<String>,
}

impl C10d {
    /// Hosts the store here if this agent should (see [`should_host`]), then connects to it.
    pub fn open(
        host: &str,
        port: u16,
        run_id: &str,
        token: &str,
        is_host: Option<bool>,
        timeout: Duration,
    ) -> Result<(C10d, Option<StoreServer>), RendezvousError> {
        let server = host_store(host, port, run_id, token, is_host)?;
        let hello = Hello {
            role: Role::StoreClient,
            run_id: run_id.to_string(),
            token: token.to_string(),
            rank: u32::MAX,
        };
        let mut backend = C10d {
            host: host.to_string(),
            port,
            hello,
            timeout,
            client: None,
            cached: None,
            announced: None,
            alive: Vec::new(),
        };
        backend.client()?;
        Ok((backend, server))
    }

    /// The address this host reaches the store from: the one other hosts can reach it at.
    pub fn local_ip(&mut self) -> Result<std::net::IpAddr, RendezvousError> {
        Ok(self.client()?.local_ip()?)
    }

    fn client(&mut self) -> Result<&mut StoreClient, RendezvousError> {
        if self.client.is_none() {
            let c = StoreClient::connect(&self.host, self.port, &self.hello, self.timeout)
                .map_err(|e| match e {
                    collective::CollectiveError::Connect { last_error, .. } => self.error(format!(
                        "no store answers ({last_error}): start the agent on the endpoint's host, which hosts the c10d store, or check --rdzv-endpoint"
                    )),
                    e @ collective::CollectiveError::Refused(_) => self.error(e),
                    // Closed or reset during the handshake: what a trainctl store does as its
                    // job ends (its host's listener goes with the connections it had not yet
                    // served). Worth waiting on, as for a store not there yet; a foreign
                    // program answers with bytes that are not ours, or not at all.
                    e if Failure::of(&e) == Failure::PeerLost => self.error(format!(
                        "the store closed the connection before answering ({e}): it may be shutting down as its job ends, or restarting; if the job is over there is nothing to join, else check --rdzv-endpoint"
                    )),
                    // Connected, but the handshake failed without a trainctl store's refusal:
                    // another program holds the port.
                    e @ (collective::CollectiveError::Wire(_)
                    | collective::CollectiveError::Io(_)
                    | collective::CollectiveError::Timeout { .. }) => RendezvousError::NotAStore {
                        endpoint: format!("{}:{}", self.host, self.port),
                        problem: e.to_string(),
                    },
                    other => self.error(other),
                })?;
            self.client = Some(c);
        }
        self.client.as_mut().ok_or_else(|| RendezvousError::Store {
            endpoint: format!("{}:{}", self.host, self.port),
            problem: "not connected".into(),
        })
    }

    fn error(&self, e: impl std::fmt::Display) -> RendezvousError {
        RendezvousError::Store {
            endpoint: format!("{}:{}", self.host, self.port),
            problem: e.to_string(),
        }
    }

    /// Runs one call; a failed connection is dropped and reopened by the next call.
    fn call<T>(
        &mut self,
        f: impl FnOnce(&mut StoreClient) -> Result<T, collective::CollectiveError>,
    ) -> Result<T, RendezvousError> {
        let result = f(self.client()?);
        result.map_err(|e| {
            // The next connection may reach another store (a replacement host's): nothing
            // known of this one holds there.
            self.client = None;
            self.cached = None;
            self.announced = None;
            self.alive.clear();
            self.error(e)
        })
    }
}

/// Whether this agent hosts the store, and its server if so. The agent hosts when told to, or
/// when the endpoint names this host: its host name (a pod's, before its DNS record exists), or
/// an address of one of its interfaces (binding tells). Another agent of this host that got
/// there first (address in use) hosts instead.
fn host_store(
    host: &str,
    port: u16,
    run_id: &str,
    token: &str,
    is_host: Option<bool>,
) -> Result<Option<StoreServer>, RendezvousError> {
    if is_host == Some(false) {
        return Ok(None);
    }
    let any: SocketAddr = ([0, 0, 0, 0], port).into();
    let names_this_host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .is_some_and(|me| {
            let first = |s: &str| s.split('.').next().unwrap_or("").to_ascii_lowercase();
            !me.is_empty() && first(&me) == first(host)
        });
    let candidates: Vec<SocketAddr> = if names_this_host || is_host == Some(true) {
        vec![any]
    } else {
        (host, port)
            .to_socket_addrs()
            .map(|a| a.collect())
            .unwrap_or_default()
    };
    let mut last = None;
    for addr in candidates {
        match StoreServer::bind(addr, run_id, token) {
            Ok(server) => {
                tracing::info!(%addr, "hosting the c10d rendezvous store");
                return Ok(Some(server));
            }
            Err(e) => last = Some(e),
        }
    }
    match (is_host, last) {
        (Some(true), Some(e)) => Err(RendezvousError::Store {
            endpoint: format!("{host}:{port}"),
            problem: format!("is_host=true but this agent cannot host the store: {e}"),
        }),
        _ => Ok(None),
    }
}

impl Backend for C10d {
    fn describe(&self) -> String {
        format!("c10d store at {}:{}", self.host, self.port)
    }

    fn read(&mut self) -> Result<Read, RendezvousError> {
        self.refresh(Duration::ZERO)?;
        let bytes = self.cached.clone();
        let state = bytes.as_deref().map(|b| decode(STATE_KEY, b)).transpose()?;
        Ok(Read {
            state,
            token: bytes,
        })
    }

    fn write(&mut self, token: Option<&[u8]>, next: &State) -> Result<bool, RendezvousError> {
        let value = encode(next);
        let (swapped, current) = self.call(|c| c.compare_set(STATE_KEY, token, &value))?;
        // Written or not, the store said what the record is now.
        self.cached = current;
        Ok(swapped)
    }

    fn heartbeat(&mut self, node: &str, ttl: Duration) -> Result<(), RendezvousError> {
        let key = format!("{ALIVE_PREFIX}{node}");
        self.call(|c| c.heartbeat(&key, ttl))
    }

    fn alive(&mut self) -> Result<BTreeSet<String>, RendezvousError> {
        let known = std::mem::take(&mut self.alive);
        let changed = self.call(|c| c.alive_changed(ALIVE_PREFIX, &known))?;
        self.alive = changed.unwrap_or(known);
        Ok(self
            .alive
            .iter()
            .filter_map(|k| k.strip_prefix(ALIVE_PREFIX).map(str::to_string))
            .collect())
    }

    fn forget(&mut self, node: &str) -> Result<(), RendezvousError> {
        let key = format!("{ALIVE_PREFIX}{node}");
        self.call(|c| c.forget(&key))
    }

    fn reconnect(&self) -> Result<Box<dyn Backend>, RendezvousError> {
        let mut other = C10d {
            host: self.host.clone(),
            port: self.port,
            hello: self.hello.clone(),
            timeout: self.timeout,
            client: None,
            cached: None,
            announced: None,
            alive: Vec::new(),
        };
        other.client()?;
        Ok(Box::new(other))
    }

    fn announces(&self) -> bool {
        true
    }

    fn announce(&mut self, round: u64, node: &Node) -> Result<(), RendezvousError> {
        let key = format!("{WANTS_PREFIX}{round:020}/{}", node.id);
        let value = serde_json::to_vec(node).unwrap_or_default();
        if self.announced.as_ref() == Some(&(key.clone(), value.clone())) {
            return Ok(());
        }
        self.call(|c| c.set(&key, &value))?;
        self.announced = Some((key, value));
        Ok(())
    }

    fn announced(&mut self, round: u64) -> Result<Vec<Node>, RendezvousError> {
        let prefix = format!("{WANTS_PREFIX}{round:020}/");
        let pairs = self.call(|c| c.scan(&prefix))?;
        // The store keeps no order of arrival: by node id. Dead nodes' keys stay (the store
        // has no leases on plain keys); the writer merges live nodes only.
        Ok(pairs
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice::<Node>(&v).ok())
            .collect())
    }

    fn wait_change(&mut self, timeout: Duration) {
        if self.refresh(timeout).is_err() {
            std::thread::sleep(timeout);
        }
    }
}

impl C10d {
    /// Brings the cached record up to date, waiting up to `wait` for it to change.
    fn refresh(&mut self, wait: Duration) -> Result<(), RendezvousError> {
        let known = collective::store::fingerprint(self.cached.as_deref());
        if let Some(now) = self.call(|c| c.get_changed(STATE_KEY, known, wait))? {
            self.cached = now;
        }
        Ok(())
    }
}
