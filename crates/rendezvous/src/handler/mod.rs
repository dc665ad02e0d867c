//! Drives the state machine against a backend: joining a round, watching it, reporting a
//! failure or the end of the job. A heartbeat thread with its own connection keeps this node
//! alive from the moment the rendezvous is opened until it is dropped. Here: opening, the
//! record read, watching the round; `join` joins a round, `end` leaves and ends the job.

mod end;
mod join;

pub use join::{StillJoining, still_joining_every};

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use collective::store::StoreServer;

use crate::backend::{Backend, C10d, Etcd, Read};
use crate::state::{self, Node, WatchStep, Watching};
use crate::{Assignment, BackendKind, Closed, Config, RendezvousError};

/// How joining ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Joined {
    Assigned(Assignment),
    /// The job is over: nothing to join.
    Closed(Closed),
    /// `stop` said so.
    Stopped,
}

/// What a check of the running round found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watch {
    Healthy,
    /// The round is over: stop the workers (or have them regroup) and join again.
    Restart(Restart),
    Closed(Closed),
}

/// Why the running round is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restart {
    pub reason: String,
    /// A node of the round is gone (no heartbeat): its peers' collectives will not complete.
    pub node_gone: bool,
}

/// How a node asked to go left the job, or why it could not leave alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leaving {
    /// The next round opened without this node: `nodes` others go on at `world_size`.
    Left { nodes: u32, world_size: u32 },
    /// The others cannot go on without it now (why): the job stops as a whole.
    Refused(String),
}

/// How a node asked to go while it joined left, or why it could not leave alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Withdrawn {
    /// The round goes on without it: `nodes` others (its world size is not known yet).
    Went { nodes: u32 },
    /// The others cannot go on without its state (why): its workers stop, saving it.
    Refused(String),
}

pub struct Rendezvous {
    cfg: Config,
    me: Node,
    backend: Box<dyn Backend>,
    round: u64,
    /// The nodes of `round`.
    nodes: Vec<String>,
    /// When this agent saw `round` start, nodes waiting to join it, a node of it gone: the
    /// clocks of [`Watching`] (this agent's own; never compared across hosts).
    running_since: Instant,
    /// The store is a c10d store, hosted by the agent on the endpoint's host (which may die
    /// with its node), not etcd.
    c10d: bool,
    /// This node's workers are still starting: nodes waiting to join wait for them
    /// ([`Rendezvous::hold_admissions`]).
    hold_admissions: bool,
    waiting_since: Option<Instant>,
    gone_since: Option<Instant>,
    heartbeat: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    /// The c10d store, when this agent hosts it; dropped last.
    server: Option<StoreServer>,
}

/// A fresh id for this agent: unique across hosts and restarts.
fn node_id() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "node".into());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(40)
        .collect();
    let salt: u32 = rand::random();
    format!("{host}-{}-{salt:08x}", std::process::id())
}

/// The address of this host on the route to `host:port` (no packet is sent).
fn route_address(host: &str, port: u16) -> Option<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let target = (host, port).to_socket_addrs().ok()?.next()?;
    let bind: std::net::SocketAddr = if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = std::net::UdpSocket::bind(bind).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

/// A store connection, a second one for heartbeats, the server if this agent hosts it, and
/// this host's address on the route to the store.
type Connected = (
    Box<dyn Backend>,
    Box<dyn Backend>,
    Option<StoreServer>,
    Option<std::net::IpAddr>,
);

/// Connects and sends node `id`'s first heartbeat: a node is alive before it joins.
fn connect(cfg: &Config, kind: &BackendKind, id: &str) -> Result<Connected, RendezvousError> {
    let (backend, server, route): (Box<dyn Backend>, _, _) = match kind {
        BackendKind::C10d { host, port } => {
            let (mut c, server) = C10d::open(
                host,
                *port,
                &cfg.run_id,
                &cfg.token,
                cfg.is_host,
                cfg.store_timeout,
            )?;
            let ip = c.local_ip().ok();
            (Box::new(c), server, ip)
        }
        BackendKind::Etcd { url } => {
            let etcd = Etcd::open(url, &cfg.run_id, cfg.store_timeout)?;
            etcd.probe()?;
            let ip = etcd
                .host_port()
                .and_then(|(h, p)| route_address(h.trim_matches(['[', ']']), p));
            (Box::new(etcd), None, ip)
        }
    };
    let mut beats = backend.reconnect()?;
    beats.heartbeat(id, cfg.heartbeat_timeout)?;
    Ok((backend, beats, server, route))
}

impl Rendezvous {
    /// Connects to (or hosts) the store and starts heartbeats. `local_addr` is where this
    /// node's workers can be reached (default: this host's address on the route to the store).
    /// A store that is not up yet (its host agent or etcd still starting) is waited for, up to
    /// the join timeout.
    pub fn open(
        cfg: Config,
        kind: &BackendKind,
        nproc: u32,
        local_addr: Option<String>,
    ) -> Result<Self, RendezvousError> {
        Self::open_unless(cfg, kind, nproc, local_addr, &|| false)
    }

    /// [`Rendezvous::open`], giving up with [`RendezvousError::Stopped`] as soon as `stopped`
    /// says so (a stop signal) while it waits for the store.
    pub fn open_unless(
        cfg: Config,
        kind: &BackendKind,
        nproc: u32,
        local_addr: Option<String>,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Self, RendezvousError> {
        let id = node_id();
        let started = Instant::now();
        let mut warned = false;
        let (backend, beats, server, route) = loop {
            match connect(&cfg, kind, &id) {
                Ok(connected) => break connected,
                Err(e @ RendezvousError::NotAStore { .. }) => return Err(e),
                Err(_) if stopped() => return Err(RendezvousError::Stopped),
                Err(e) if started.elapsed() < cfg.join_timeout => {
                    if !warned {
                        tracing::warn!(error = %e, "rendezvous store not reachable yet; waiting");
                        warned = true;
                    }
                    std::thread::sleep(cfg.poll.max(Duration::from_millis(200)));
                }
                Err(e) => return Err(e),
            }
        };
        let me = Node {
            id,
            addr: local_addr
                .or_else(|| route.map(|ip| ip.to_string()))
                .unwrap_or_else(|| "127.0.0.1".into()),
            // Picked before each join (`set_port`).
            port: 0,
            nproc,
            health: None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, id, every, ttl) = (
                stop.clone(),
                me.id.clone(),
                cfg.heartbeat,
                cfg.heartbeat_timeout,
            );
            std::thread::Builder::new()
                .name("rdzv-heartbeat".into())
                .spawn(move || heartbeats(beats, &id, every, ttl, &stop))?
        };
        Ok(Rendezvous {
            c10d: matches!(kind, BackendKind::C10d { .. }),
            cfg,
            me,
            backend,
            round: 0,
            nodes: Vec::new(),
            running_since: Instant::now(),
            hold_admissions: false,
            waiting_since: None,
            gone_since: None,
            heartbeat: Some((stop, thread)),
            server,
        })
    }

    pub fn node_id(&self) -> &str {
        &self.me.id
    }

    /// What a store that stopped answering most likely means, when the backend says more than
    /// its error: a c10d store dies with the agent that hosts it.
    pub fn store_loss_means(&self) -> Option<&'static str> {
        self.c10d.then_some(
            "the c10d store lives in the agent on the endpoint's host, so that node is \
             probably gone: a new round waits until the node that replaces it hosts a new store \
             there (on Kubernetes, pod 0's replacement, after the Job's backoff)",
        )
    }

    pub fn describe(&self) -> String {
        let hosted = if self.server.is_some() {
            " (hosted by this agent)"
        } else {
            ""
        };
        format!("{}{hosted}", self.backend.describe())
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The port this node's rank-0 worker hosts the workers' store on, if it is rank 0.
    /// Whether this node's workers are still starting, so that, where this node writes for the
    /// round, nodes waiting to join are admitted once the workers can take them in place
    /// (`state::Watching::hold_admissions`). The agent bounds how long it holds.
    pub fn hold_admissions(&mut self, hold: bool) {
        self.hold_admissions = hold;
    }

    pub fn set_port(&mut self, port: u16) {
        self.me.port = port;
    }

    /// What this node's health check measured, carried in its entry of the record.
    pub fn set_health(&mut self, health: state::Health) {
        self.me.health = Some(health);
    }

    /// The health figures of the other live nodes in the record (those that measured any).
    pub fn peers_health(&mut self) -> Result<Vec<state::Health>, RendezvousError> {
        let (read, alive) = self.read()?;
        Ok(read
            .state
            .iter()
            .flat_map(|s| s.participants.iter())
            .filter(|n| n.id != self.me.id && alive.contains(&n.id))
            .filter_map(|n| n.health)
            .collect())
    }

    fn read(&mut self) -> Result<(Read, BTreeSet<String>), RendezvousError> {
        let read = self.backend.read()?;
        let mut alive = self.backend.alive()?;
        // This agent is alive by definition, even if its heartbeat is late.
        alive.insert(self.me.id.clone());
        Ok((read, alive))
    }

    /// Checks the round this node's workers run in. An error means the store could not be
    /// asked; the workers may well go on.
    pub fn watch(&mut self) -> Result<Watch, RendezvousError> {
        loop {
            let (read, alive) = self.read()?;
            let writer =
                read.state.as_ref().and_then(|s| s.writer(&alive)) == Some(self.me.id.as_str());
            let announced = if writer && self.backend.announces() {
                self.backend.announced(self.round.saturating_add(1))?
            } else {
                Vec::new()
            };
            let waiting = read
                .state
                .as_ref()
                .is_some_and(|s| !s.newcomers(&alive, &announced).is_empty());
            let gone = self.nodes.iter().any(|n| !alive.contains(n));
            let since = |clock: &mut Option<Instant>, on: bool| {
                if !on {
                    *clock = None;
                }
                clock.map_or(Duration::ZERO, |t| t.elapsed())
            };
            if waiting {
                self.waiting_since.get_or_insert_with(Instant::now);
            }
            if gone {
                self.gone_since.get_or_insert_with(Instant::now);
            }
            let seen = Watching {
                hold_admissions: self.hold_admissions,
                announced: &announced,
                running_for: self.running_since.elapsed(),
                waiting_for: since(&mut self.waiting_since, waiting),
                gone_for: since(&mut self.gone_since, gone),
                window: self.cfg.join_window,
                take_over: self.cfg.heartbeat * 2,
            };
            let restart = |reason| {
                Watch::Restart(Restart {
                    reason,
                    node_gone: gone,
                })
            };
            match state::watch_step(
                read.state.as_ref(),
                &self.me.id,
                self.round,
                &alive,
                self.cfg.limits,
                &seen,
            ) {
                WatchStep::Healthy => return Ok(Watch::Healthy),
                WatchStep::Restart(reason) => return Ok(restart(reason)),
                WatchStep::Closed(c) => return Ok(Watch::Closed(c)),
                WatchStep::Reopen(next, reason) => {
                    if self.backend.write(read.token.as_deref(), &next)? {
                        return Ok(restart(reason));
                    }
                }
            }
        }
    }

    /// This node's workers said they regroup in place: the record says so, once, so that a
    /// node that joins the job later starts its workers warm.
    pub fn note_in_place(&mut self) -> Result<(), RendezvousError> {
        let deadline = Instant::now() + self.cfg.close_timeout;
        loop {
            let (read, _) = self.read()?;
            let Some(next) = state::in_place_step(read.state.as_ref()) else {
                return Ok(());
            };
            if self.backend.write(read.token.as_deref(), &next)? || Instant::now() > deadline {
                return Ok(());
            }
        }
    }

    /// Whether this node, about to join, should start its workers warm first
    /// ([`State::warm_start_pays`]); false when the record cannot be read.
    pub fn warm_start_pays(&mut self) -> bool {
        self.read()
            .ok()
            .and_then(|(read, _)| read.state)
            .is_some_and(|s| s.warm_start_pays())
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.heartbeat.take() {
            stop.store(true, Ordering::SeqCst);
            let _ = thread.join();
        }
    }
}

/// Beats every `every` until `stop`, then says this node left.
fn heartbeats(
    mut backend: Box<dyn Backend>,
    id: &str,
    every: Duration,
    ttl: Duration,
    stop: &AtomicBool,
) {
    let mut failing = false;
    let mut next = Instant::now() + every;
    while !stop.load(Ordering::SeqCst) {
        if Instant::now() >= next {
            next = Instant::now() + every;
            match backend.heartbeat(id, ttl) {
                Ok(()) if failing => {
                    tracing::warn!("rendezvous heartbeats reach the store again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "heartbeat failed; retrying");
                    failing = true;
                }
                Err(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20).min(every));
    }
    if let Err(e) = backend.forget(id) {
        tracing::debug!(error = %e, "could not say goodbye to the store");
    }
}
