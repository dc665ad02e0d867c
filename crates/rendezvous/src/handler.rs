//! Drives the state machine against a backend: joining a round, watching it, reporting a
//! failure or the end of the job. A heartbeat thread with its own connection keeps this node
//! alive from the moment the rendezvous is opened until it is dropped.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use collective::store::StoreServer;

use crate::backend::{Backend, C10d, Etcd, Read};
use crate::state::{
    self, AfterFailure, JoinStep, LeaveStep, Node, Phase, State, WatchStep, Watching, WithdrawStep,
};
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

/// A join that has waited a while without a round: said every [`still_joining_every`], so
/// nothing waits silently for its join timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StillJoining {
    pub round: u64,
    /// Nodes in the round so far (with announcements, those announced).
    pub joined: usize,
    pub min: u32,
    pub waited: Duration,
    /// Until the join gives up (`join_timeout` in --rdzv-conf).
    pub left: Duration,
    /// The store's last error, when it cannot be reached.
    pub store_error: Option<String>,
    /// The job trains without this node, which waits for a place (no join timeout then): at
    /// its next admission, or as a spare.
    pub running_without: bool,
    /// The job trains at its `--nnodes` MAX: this node is a spare, waiting to take the place of
    /// a node that goes.
    pub spare: bool,
    /// The job trains without this node, and its workers regroup in place: workers started now
    /// would be taken in warm ([`State::warm_start_pays`]). Said at once when it becomes true.
    pub warm_start_pays: bool,
}

/// How often a join that waits says so: every 30 s, or four times within a shorter join
/// timeout.
pub fn still_joining_every(join_timeout: Duration) -> Duration {
    (join_timeout / 4).clamp(Duration::from_millis(250), Duration::from_secs(30))
}

/// What one pass of [`Rendezvous::join`] did.
enum Pass {
    Wrote,
    Wait,
    Done(Joined),
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

    /// Joins the next round and waits for it to complete, for the job to be over, or for
    /// `stop`. Store errors are retried until the join timeout. Every [`still_joining_every`]
    /// it waits, `waiting` hears how far the round has come.
    pub fn join(
        &mut self,
        stop: &dyn Fn() -> bool,
        waiting: &mut dyn FnMut(StillJoining),
    ) -> Result<Joined, RendezvousError> {
        let mut started = Instant::now();
        let every = still_joining_every(self.cfg.join_timeout);
        let mut next_report = started + every;
        let mut last_call: Option<(u64, Instant)> = None;
        let mut last_error: Option<RendezvousError> = None;
        let mut seen: Option<State> = None;
        // Whether the job was last seen training without this node (said at once when it
        // starts to, then every `every`).
        let mut was_running_without = false;
        let mut warm_paid = false;
        loop {
            if stop() {
                return Ok(Joined::Stopped);
            }
            match self.join_pass(&mut last_call, &mut seen) {
                Ok(Pass::Done(joined)) => return Ok(joined),
                // Written or lost the race: either way, read again at once.
                Ok(Pass::Wrote) => {
                    last_error = None;
                    continue;
                }
                Ok(Pass::Wait) => last_error = None,
                Err(e) => {
                    if last_error.is_none() {
                        if let Some(means) = self.store_loss_means() {
                            tracing::warn!(
                                error = %e,
                                "the rendezvous store does not answer; waiting up to join_timeout, \
                                 the workers keeping their state: {means}"
                            );
                        } else {
                            tracing::warn!(error = %e, "rendezvous store unreachable; retrying");
                        }
                    }
                    last_error = Some(e);
                }
            }
            // A job that trains without this node (at MAX, or until its next admission) is
            // not a round failing to form: the wait for a place does not time out.
            let running_without_me = seen.as_ref().is_some_and(|s| {
                s.phase == Phase::Running && !s.is_participant(&self.me.id) && last_error.is_none()
            });
            if running_without_me {
                started = Instant::now();
                if !was_running_without {
                    next_report = started;
                }
            }
            was_running_without = running_without_me;
            let warm_pays = running_without_me && seen.as_ref().is_some_and(State::warm_start_pays);
            if warm_pays && !warm_paid {
                next_report = Instant::now();
            }
            warm_paid = warm_pays;
            let waited = started.elapsed();
            if waited >= self.cfg.join_timeout {
                if let Some(e) = last_error {
                    return Err(e);
                }
                let (round, joined) = self.joined_so_far(seen.as_ref());
                return Err(RendezvousError::JoinTimeout {
                    run_id: self.cfg.run_id.clone(),
                    waited: self.cfg.join_timeout,
                    joined,
                    min: self.cfg.limits.min,
                    round,
                });
            }
            if Instant::now() >= next_report {
                next_report += every;
                let (round, joined) = self.joined_so_far(seen.as_ref());
                waiting(StillJoining {
                    round,
                    joined,
                    min: self.cfg.limits.min,
                    waited,
                    left: self.cfg.join_timeout.saturating_sub(waited),
                    store_error: last_error.as_ref().map(ToString::to_string),
                    running_without: running_without_me,
                    spare: running_without_me
                        && seen
                            .as_ref()
                            .is_some_and(|s| s.participants.len() as u32 >= self.cfg.limits.max),
                    warm_start_pays: warm_pays,
                });
            }
            self.backend.wait_change(self.cfg.poll);
        }
    }

    /// The round last seen and how many nodes are in it. With announcements the record lists
    /// only the round's writer until it completes: who joined is who announced.
    fn joined_so_far(&mut self, seen: Option<&State>) -> (u64, usize) {
        let round = seen.map_or(0, |s| s.round);
        let announced = if self.backend.announces() {
            self.backend.announced(round).map_or(0, |a| a.len())
        } else {
            0
        };
        (
            round,
            seen.map_or(0, |s| s.participants.len()).max(announced),
        )
    }

    /// One read of the record and what follows from it. `last_call` is this agent's last-call
    /// timer (the round it runs for), `seen` the record read, for the timeout's message.
    fn join_pass(
        &mut self,
        last_call: &mut Option<(u64, Instant)>,
        seen: &mut Option<State>,
    ) -> Result<Pass, RendezvousError> {
        let (read, alive) = self.read()?;
        *seen = read.state.clone();
        let limits = self.cfg.limits;
        let announced = self.announcements(read.state.as_ref(), &alive)?;
        // The last call runs from when this agent saw MIN nodes in the round: in the record,
        // or, for the writer of a round with announcements, among the nodes it would merge.
        let merged = match (&read.state, &announced) {
            (Some(s), Some(nodes))
                if s.phase == Phase::Joining && s.writer(&alive) == Some(self.me.id.as_str()) =>
            {
                Some(s.merged(&self.me, &alive, nodes, limits))
            }
            _ => None,
        };
        if let Some(m) = &merged {
            *seen = Some(m.clone());
        }
        let over = match merged.as_ref().or(read.state.as_ref()) {
            Some(s) if s.last_call_due(limits) => {
                let since = match *last_call {
                    Some((round, since)) if round == s.round => since,
                    _ => {
                        let now = Instant::now();
                        *last_call = Some((s.round, now));
                        now
                    }
                };
                since.elapsed() >= self.cfg.last_call_timeout
            }
            _ => false,
        };
        let step = state::join_step(
            read.state.as_ref(),
            &self.me,
            &alive,
            limits,
            over,
            announced.as_deref(),
        );
        Ok(match step {
            JoinStep::Write(next) => {
                self.backend.write(read.token.as_deref(), &next)?;
                Pass::Wrote
            }
            JoinStep::Wait => Pass::Wait,
            JoinStep::Assigned(a) => {
                self.round = a.round;
                self.nodes = a.nodes.clone();
                self.running_since = Instant::now();
                self.waiting_since = None;
                self.gone_since = None;
                Pass::Done(Joined::Assigned(a))
            }
            JoinStep::Closed(c) => Pass::Done(Joined::Closed(c)),
        })
    }

    /// With a backend that announces: announces this node for the round it can join (the
    /// joining one, or the next after a running one it is not in) and, if it is the joining
    /// round's writer, reads who announced. `None`: nodes add themselves to the record.
    fn announcements(
        &mut self,
        state: Option<&State>,
        alive: &BTreeSet<String>,
    ) -> Result<Option<Vec<Node>>, RendezvousError> {
        if !self.backend.announces() {
            return Ok(None);
        }
        let Some(state) = state else {
            return Ok(Some(Vec::new()));
        };
        match state.phase {
            Phase::Joining if !state.is_participant(&self.me.id) => {
                self.backend.announce(state.round, &self.me)?;
            }
            Phase::Running if state.assignment(&self.me.id).is_none() => {
                self.backend
                    .announce(state.round.saturating_add(1), &self.me)?;
            }
            _ => {}
        }
        if state.phase == Phase::Joining && state.writer(alive) == Some(self.me.id.as_str()) {
            return Ok(Some(self.backend.announced(state.round)?));
        }
        Ok(Some(Vec::new()))
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

    /// A worker of this node failed (`kind`: how it bears on the job). Returns `Ok(None)` to
    /// restart at the next round, or the end of the job when `max_restarts` is exceeded, the
    /// failure is unrecoverable, or someone else already ended it.
    pub fn worker_failed(
        &mut self,
        kind: state::FailureKind,
        report: &str,
        at_millis: u64,
        max_restarts: u32,
    ) -> Result<Option<Closed>, RendezvousError> {
        let deadline = Instant::now() + self.cfg.close_timeout;
        loop {
            let (read, alive) = self.read()?;
            let (write, result) = match state::fail_step(
                read.state.as_ref(),
                self.round,
                kind,
                report,
                at_millis,
                max_restarts,
                &alive,
            ) {
                AfterFailure::Restart(w) => (w, None),
                AfterFailure::GiveUp(w, closed) => (w, Some(closed)),
            };
            match write {
                None => return Ok(result),
                Some(next) if self.backend.write(read.token.as_deref(), &next)? => {
                    return Ok(result);
                }
                Some(_) if Instant::now() > deadline => {
                    return Err(RendezvousError::Store {
                        endpoint: self.backend.describe(),
                        problem: "could not record the failure (too much contention)".into(),
                    });
                }
                Some(_) => {}
            }
        }
    }

    /// This node is asked to go (`reason`, e.g. "node X leaves (SIGTERM)"): opens the next
    /// round without it when the others can go on in place ([`state::leave_step`]). The
    /// caller's workers then leave their group at a step boundary, which the others' pause
    /// makes the same for every rank.
    pub fn leave(&mut self, reason: &str) -> Result<Leaving, RendezvousError> {
        let deadline = Instant::now() + self.cfg.close_timeout;
        loop {
            let (read, alive) = self.read()?;
            match state::leave_step(
                read.state.as_ref(),
                &self.me.id,
                self.round,
                &alive,
                self.cfg.limits,
                reason,
            ) {
                LeaveStep::Refused(why) => return Ok(Leaving::Refused(why)),
                LeaveStep::Write {
                    next,
                    nodes,
                    world_size,
                } => {
                    if self.backend.write(read.token.as_deref(), &next)? {
                        return Ok(Leaving::Left { nodes, world_size });
                    }
                }
            }
            if Instant::now() > deadline {
                return Err(RendezvousError::Store {
                    endpoint: self.backend.describe(),
                    problem: "could not record this node's leave (too much contention)".into(),
                });
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

    /// This node is asked to go (`reason`) while it joins the next round, its workers kept
    /// from the last one, whose nodes were `held` (None: it holds no training state): the
    /// round goes on without it when another node that held the same state does
    /// ([`state::withdraw_step`]).
    pub fn withdraw(
        &mut self,
        held: Option<&[String]>,
        reason: &str,
    ) -> Result<Withdrawn, RendezvousError> {
        let deadline = Instant::now() + self.cfg.close_timeout;
        loop {
            let (read, alive) = self.read()?;
            let nodes = match state::withdraw_step(
                read.state.as_ref(),
                &self.me.id,
                held,
                &alive,
                self.cfg.limits,
                reason,
            ) {
                WithdrawStep::Refused(why) => return Ok(Withdrawn::Refused(why)),
                WithdrawStep::Go { nodes } => nodes,
                WithdrawStep::Write { next, nodes } => {
                    if !self.backend.write(read.token.as_deref(), &next)? {
                        if Instant::now() > deadline {
                            return Err(RendezvousError::Store {
                                endpoint: self.backend.describe(),
                                problem: "could not record this node's leave (too much contention)"
                                    .into(),
                            });
                        }
                        continue;
                    }
                    nodes
                }
            };
            return Ok(Withdrawn::Went { nodes });
        }
    }

    /// After [`Rendezvous::leave`]: an agent that hosts the store keeps it up until the others
    /// run their next round (they have read their places), or `wait` at most. Without the
    /// store they would train on, but could not form a round until a replacement hosts one.
    pub fn hand_over(&mut self, wait: Duration) {
        if self.server.is_none() {
            return;
        }
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            match self.read() {
                Ok((read, alive)) => {
                    let moved_on = read
                        .state
                        .as_ref()
                        .is_none_or(|s| s.round > self.round && s.phase != state::Phase::Joining);
                    if moved_on || alive.iter().all(|id| *id == self.me.id) {
                        return;
                    }
                }
                Err(_) => return,
            }
            std::thread::sleep(self.cfg.poll);
        }
    }

    /// This node's workers are done: the job is over. `report` is the root cause on failure.
    pub fn close(&mut self, succeeded: bool, report: Option<&str>) -> Result<(), RendezvousError> {
        self.write_until_done("close the rendezvous", |state| {
            state::close_step(state, succeeded, report)
        })
    }

    /// This node's workers finished: the job is closed as succeeded (if no node closed it
    /// yet) and this node is counted among the finished ([`state::finish_step`]).
    pub fn finish(&mut self) -> Result<(), RendezvousError> {
        let me = self.me.id.clone();
        self.write_until_done("mark this node finished", |state| {
            state::finish_step(state, &me)
        })
    }

    /// Writes what `step` makes of the record read, compare-and-set, until it has nothing
    /// more to write, within the close timeout (`what` names the write in the error).
    fn write_until_done(
        &mut self,
        what: &str,
        step: impl Fn(Option<&State>) -> Option<State>,
    ) -> Result<(), RendezvousError> {
        let deadline = Instant::now() + self.cfg.close_timeout;
        loop {
            let read = self.backend.read()?;
            let Some(next) = step(read.state.as_ref()) else {
                return Ok(());
            };
            if self.backend.write(read.token.as_deref(), &next)? {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(RendezvousError::Store {
                    endpoint: self.backend.describe(),
                    problem: format!("could not {what} (too much contention)"),
                });
            }
        }
    }

    /// After [`Rendezvous::finish`], the exit barrier: waits until every live participant's
    /// workers have finished too, or `wait` at most, so that this node's exit says the whole
    /// job is done. `waiting` hears, every [`EXIT_BARRIER_SAY_EVERY`], the nodes still waited
    /// for. Returns those still unfinished when it gave up (empty when none are); a store that
    /// cannot be read ends the wait (nothing more can be learnt).
    pub fn await_finished(
        &mut self,
        wait: Duration,
        waiting: &mut dyn FnMut(&[String], Duration),
    ) -> Vec<String> {
        let start = Instant::now();
        let mut said = start;
        loop {
            let pending = match self.read() {
                Ok((read, alive)) => read
                    .state
                    .as_ref()
                    .map(|s| state::unfinished(s, &alive))
                    .unwrap_or_default(),
                Err(_) => return Vec::new(),
            };
            if pending.is_empty() || start.elapsed() >= wait {
                return pending;
            }
            if said.elapsed() >= EXIT_BARRIER_SAY_EVERY {
                said = Instant::now();
                waiting(&pending, start.elapsed());
            }
            std::thread::sleep(self.cfg.poll.max(Duration::from_millis(100)));
        }
    }
}

/// How often a finished node waiting for the others says whom it waits for.
pub(crate) const EXIT_BARRIER_SAY_EVERY: Duration = Duration::from_secs(10);

impl Rendezvous {
    /// Once the job is over: an agent that hosts the store keeps it up until every other agent
    /// has left, so that they learn how the job ended, and until the nodes lost during the job
    /// (no heartbeat: killed, or only cut off) have come back and left; all within the close
    /// timeout. `waiting` hears, once, the lost nodes it then waits for alone.
    pub fn linger(&mut self, waiting: &mut dyn FnMut(&[String], Duration)) {
        if self.server.is_none() {
            return;
        }
        let deadline = Instant::now() + self.cfg.close_timeout;
        let lapsed = match self.read() {
            Ok((read, _)) => read
                .state
                .map(|s| s.lapsed_unfinished())
                .unwrap_or_default(),
            Err(_) => return,
        };
        let mut back = BTreeSet::new();
        let mut said = false;
        while Instant::now() < deadline {
            let Ok(alive) = self.backend.alive() else {
                return;
            };
            back.extend(lapsed.iter().filter(|id| alive.contains(*id)).cloned());
            if alive.iter().all(|id| *id == self.me.id) {
                let missing: Vec<String> = lapsed
                    .iter()
                    .filter(|id| !back.contains(*id))
                    .cloned()
                    .collect();
                if missing.is_empty() {
                    return;
                }
                if !said {
                    said = true;
                    waiting(&missing, deadline.saturating_duration_since(Instant::now()));
                }
            }
            std::thread::sleep(self.cfg.poll);
        }
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
