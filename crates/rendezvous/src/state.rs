//! The rendezvous state machine: plain data and pure functions, no I/O.
//!
//! One record per run id holds the whole rendezvous. Every agent reads it, decides with the
//! functions here what the next record should be, and writes it with compare-and-set; a lost
//! race just means reading again. Liveness is not in the record: the backend says which nodes
//! are alive (store liveness keys or etcd leases), so no clock is ever compared across hosts.
//!
//! A round goes `Joining` → `Running`; any agent may reopen a running round (a node lost, a
//! worker failed, a node waiting to join), which starts the next round in `Joining`. `Closed`
//! is final for the job.

// The steps (`JoinStep`, `WatchStep`, ...) carry the next record: each is made once and taken
// at once by the agent that asked, never stored, so their size does not matter.
#![allow(clippy::large_enum_variant)]

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One agent (node) of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Unique per agent process: `hostname-pid-random`.
    pub id: String,
    /// Where this node's rank-0 worker would host the workers' store.
    pub addr: String,
    pub port: u16,
    /// Workers this agent runs.
    pub nproc: u32,
    /// What the node's health check measured before it joined (absent from older agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<Health>,
}

/// A node's health check: a CPU matrix multiply and a loopback TCP stream, measured by its
/// agent before it joins, compared with the other nodes'.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Millions of floating-point operations a second, one thread.
    pub gemm_mflops: u64,
    /// Megabytes a second through a loopback TCP connection.
    pub loopback_mbps: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Joining,
    Running,
    Closed { succeeded: bool },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// Bumped by every write, so no two records are ever equal (compare-and-set by value).
    pub version: u64,
    pub round: u64,
    pub phase: Phase,
    /// In join order; once `Running`, node rank = index.
    pub participants: Vec<Node>,
    /// Nodes of the previous round (and those that waited for it): when all of them that are
    /// still alive have joined, the round completes without waiting for the last call.
    pub expected: Vec<String>,
    /// Nodes that arrived while a round was running: admitted at the next round.
    pub waiting: Vec<Node>,
    /// Restarts caused by worker failures (TORCHELASTIC_RESTART_COUNT).
    pub failures: u32,
    pub last_failed_round: Option<u64>,
    /// The first failure of the job, as its agent reported it.
    pub root_cause: Option<String>,
    /// When that failure happened (milliseconds since the Unix epoch, by the failing node's
    /// clock): a failure reported later that happened earlier takes its place. Only the report
    /// reads it; no liveness or ordering of the rendezvous depends on it.
    #[serde(default)]
    pub root_cause_at: Option<u64>,
    /// Why the current round was opened.
    pub reason: Option<String>,
    /// Rounds in a row opened to admit waiting nodes: each makes the next admission wait
    /// longer ([`admission_cooldown`]), so nodes arriving over minutes cost a few rounds, not
    /// one each. Any other reason to open a round resets it.
    #[serde(default)]
    pub admissions: u32,
    /// Once the job succeeded: the nodes whose workers have finished. A node that finishes
    /// waits until every live participant is here before it exits ([`unfinished`]), so that
    /// a node's exit 0 says the whole job is done (rank 0's model saved and uploaded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finished: Vec<String>,
    /// Nodes a round went on without because their heartbeat stopped (not because they
    /// left): killed, or cut off and perhaps coming back. The store's host keeps a closed
    /// job's store up a while for them ([`State::lapsed_unfinished`]), so that a node cut off
    /// as the job ends learns that it did. The last [`MAX_LAPSED`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lapsed: Vec<String>,
    /// A node's workers said they regroup in place (the built-in trainer, a program using
    /// trainctl.torch): a node joining the job under way starts its workers warm, before it
    /// asks for a place ([`State::warm_start_pays`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub regroups_in_place: bool,
}

/// The most lapsed nodes a record keeps (every agent reads the record: it stays small).
pub(crate) const MAX_LAPSED: usize = 16;

impl Default for State {
    fn default() -> Self {
        State {
            version: 0,
            round: 0,
            phase: Phase::Joining,
            participants: Vec::new(),
            expected: Vec::new(),
            waiting: Vec::new(),
            failures: 0,
            last_failed_round: None,
            root_cause: None,
            root_cause_at: None,
            reason: None,
            admissions: 0,
            finished: Vec::new(),
            lapsed: Vec::new(),
            regroups_in_place: false,
        }
    }
}

/// The smallest and largest number of nodes (`--nnodes MIN:MAX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub min: u32,
    pub max: u32,
}

/// This node's place in a completed round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub round: u64,
    pub node_rank: u32,
    pub nnodes: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    pub world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub restart_count: u32,
    pub nodes: Vec<String>,
}

/// The job is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    pub succeeded: bool,
    pub root_cause: Option<String>,
    /// This node was in the round that closed the job: its workers hold the job's last
    /// state. Otherwise the job went on without it (it was cut off, or stopped) and its
    /// workers' state is behind: they must not save it over the job's.
    pub member: bool,
}

/// What an agent that wants to join does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinStep {
    /// Write this record (compare-and-set against the one read), then read again.
    Write(State),
    /// Nothing to do yet: read again after a while.
    Wait,
    Assigned(Assignment),
    Closed(Closed),
}

/// What an agent whose workers run in `round` does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchStep {
    Healthy,
    /// Write this record, which reopens the round for `reason`, then restart.
    Reopen(State, String),
    /// The round is over (reopened by someone, or this node was dropped): restart.
    Restart(String),
    Closed(Closed),
}

impl State {
    fn written(mut self) -> State {
        self.version = self.version.saturating_add(1);
        self
    }

    /// Whether a node joining now should start its workers warm: the job is under way (a
    /// round has run, and it is not over) and its workers regroup in place, so they will take
    /// the joiner's workers in place, which then need only their group and the state.
    pub fn warm_start_pays(&self) -> bool {
        self.regroups_in_place
            && self.closed().is_none()
            && (self.round > 0 || self.phase == Phase::Running)
    }

    pub(crate) fn is_participant(&self, id: &str) -> bool {
        self.participants.iter().any(|n| n.id == id)
    }

    /// The nodes of this record's job: its participants, the nodes a reopened round expects
    /// or has waiting (a round reopened and then closed lists no participants), and the nodes
    /// it lost on the way (one cut off may come back after the others have gone).
    fn members(&self) -> impl Iterator<Item = &str> {
        self.participants
            .iter()
            .chain(&self.waiting)
            .map(|n| n.id.as_str())
            .chain(self.expected.iter().map(String::as_str))
            .chain(self.lapsed.iter().map(String::as_str))
    }

    fn closed(&self) -> Option<Closed> {
        match self.phase {
            Phase::Closed { succeeded } => Some(Closed {
                succeeded,
                root_cause: self.root_cause.clone(),
                member: false,
            }),
            _ => None,
        }
    }

    /// The next round, open for joining, expecting every live node of this one.
    fn reopened(&self, reason: String, alive: &BTreeSet<String>) -> State {
        let expected = self
            .participants
            .iter()
            .chain(&self.waiting)
            .map(|n| n.id.clone())
            .filter(|id| alive.contains(id))
            .collect();
        State {
            round: self.round.saturating_add(1),
            phase: Phase::Joining,
            participants: Vec::new(),
            expected,
            waiting: Vec::new(),
            reason: Some(reason),
            admissions: 0,
            ..self.clone()
        }
        .written()
    }

    /// The next round as [`State::reopened`] makes it, because participant `gone` has no
    /// heartbeat: it is counted among the lapsed.
    fn reopened_without(&self, gone: &str, reason: String, alive: &BTreeSet<String>) -> State {
        let mut next = self.reopened(reason, alive);
        if !next.lapsed.iter().any(|id| id == gone) {
            next.lapsed.push(gone.to_string());
            let over = next.lapsed.len().saturating_sub(MAX_LAPSED);
            next.lapsed.drain(..over);
        }
        next
    }

    /// The nodes lost during this job (no heartbeat) that have not finished since: those a
    /// closed job's store waits for a while, in case they were only cut off.
    pub(crate) fn lapsed_unfinished(&self) -> Vec<String> {
        self.lapsed
            .iter()
            .filter(|id| !self.finished.contains(id))
            .cloned()
            .collect()
    }

    /// The participant that writes for the others: the first one alive. Only it merges the
    /// nodes announced for a joining round, completes it, and reopens a running one, so a
    /// change costs one write instead of one per agent racing for the same record.
    pub fn writer<'a>(&'a self, alive: &BTreeSet<String>) -> Option<&'a str> {
        self.participants
            .iter()
            .find(|n| alive.contains(&n.id))
            .map(|n| n.id.as_str())
    }

    /// This joining round as its writer would complete it: dead nodes dropped, `me` and then
    /// the live `announced` nodes added in order, up to MAX.
    pub fn merged(
        &self,
        me: &Node,
        alive: &BTreeSet<String>,
        announced: &[Node],
        limits: Limits,
    ) -> State {
        let mut next = self.clone();
        next.participants
            .retain(|n| alive.contains(&n.id) || n.id == me.id);
        next.waiting
            .retain(|n| alive.contains(&n.id) && n.id != me.id);
        for n in std::iter::once(me).chain(announced) {
            if (alive.contains(&n.id) || n.id == me.id)
                && !next.is_participant(&n.id)
                && (next.participants.len() as u32) < limits.max
            {
                next.participants.push(n.clone());
            }
        }
        next
    }

    /// This round, started. The nodes of the round before keep their order ahead of the nodes
    /// new to the job (stable: those in join order), so a regroup leaves every surviving rank
    /// where it was: rank 0's node, with the workers' store and whatever a program keeps on
    /// rank 0 only, stays rank 0 unless it is the one gone. The nodes it expected are then no
    /// longer needed (a reopened round expects the participants): every agent reads the
    /// record, so it stays small.
    fn running(&self) -> State {
        let mut next = self.clone();
        let before = |n: &Node| {
            self.expected
                .iter()
                .position(|id| *id == n.id)
                .unwrap_or(usize::MAX)
        };
        next.participants.sort_by_key(before);
        next.phase = Phase::Running;
        next.expected.clear();
        next.written()
    }

    /// Live nodes that wait for the next round: the record's waiting list and the nodes
    /// announced for the next round, not already in this one.
    pub(crate) fn newcomers<'a>(
        &'a self,
        alive: &BTreeSet<String>,
        announced: &'a [Node],
    ) -> Vec<&'a Node> {
        let mut out: Vec<&Node> = Vec::new();
        for n in self.waiting.iter().chain(announced) {
            if alive.contains(&n.id)
                && !self.is_participant(&n.id)
                && !out.iter().any(|o| o.id == n.id)
            {
                out.push(n);
            }
        }
        out
    }

    /// `me`'s place, if the round is running with it.
    pub fn assignment(&self, me: &str) -> Option<Assignment> {
        if self.phase != Phase::Running {
            return None;
        }
        let node_rank = self.participants.iter().position(|n| n.id == me)?;
        // Saturating: a record is read from the network and may hold any numbers.
        let total = |nodes: &[Node]| nodes.iter().fold(0u32, |a, n| a.saturating_add(n.nproc));
        let rank_offset = total(&self.participants[..node_rank]);
        let master = self.participants.first()?;
        Some(Assignment {
            round: self.round,
            node_rank: node_rank as u32,
            nnodes: self.participants.len() as u32,
            rank_offset,
            world_size: total(&self.participants),
            master_addr: master.addr.clone(),
            master_port: master.port,
            restart_count: self.failures,
            nodes: self.participants.iter().map(|n| n.id.clone()).collect(),
        })
    }

    /// Whether a joining round with enough participants may complete now, without a last call:
    /// it is full, or every live node it expects has joined.
    fn complete_without_last_call(&self, limits: Limits, alive: &BTreeSet<String>) -> bool {
        let n = self.participants.len() as u32;
        n >= limits.max
            || (n >= limits.min
                && !self.expected.is_empty()
                && self
                    .expected
                    .iter()
                    .all(|id| !alive.contains(id) || self.is_participant(id)))
    }

    /// Whether the last call may start: a joining round with at least MIN participants.
    pub(crate) fn last_call_due(&self, limits: Limits) -> bool {
        self.phase == Phase::Joining && self.participants.len() as u32 >= limits.min
    }
}

/// What a watching agent knows besides the record: the nodes announced for the next round
/// (read by the round's writer only), and its own clock (never compared across hosts).
#[derive(Debug, Clone, Copy, Default)]
pub struct Watching<'a> {
    pub announced: &'a [Node],
    /// How long this agent has seen the round running.
    pub running_for: Duration,
    /// How long this agent has seen nodes waiting to join.
    pub waiting_for: Duration,
    /// How long this agent has seen a participant gone.
    pub gone_for: Duration,
    /// `join_window`: how long waiting nodes are gathered before a round reopens for them.
    pub window: Duration,
    /// After how long a participant that is not the writer reopens for a gone node itself
    /// (the writer may be busy or about to be found gone too).
    pub take_over: Duration,
    /// This node's workers are still starting (they have not said they regroup in place):
    /// nodes waiting to join are admitted once they have, so that the joiner is taken in place
    /// instead of costing them a restart. (A node gone reopens the round all the same.)
    pub hold_admissions: bool,
}

/// How long a round must have run before it reopens to admit waiting nodes: the join window,
/// doubled for each round in a row that was opened to admit nodes, up to 30 s (or the window,
/// if longer). Nodes arriving spread over a minute then cost a handful of rounds.
pub(crate) fn admission_cooldown(window: Duration, admissions: u32) -> Duration {
    let cap = window.max(Duration::from_secs(30));
    window.saturating_mul(1u32 << admissions.min(16)).min(cap)
}

/// One check of a running round by a node whose workers run in `round`. Only the round's
/// writer reopens it (for a gone node at once; the others after `take_over`, in case the writer
/// cannot), and it admits waiting nodes when the round is full with them, or when they have
/// waited the join window and the round has run its [`admission_cooldown`].
pub fn watch_step(
    state: Option<&State>,
    me: &str,
    round: u64,
    alive: &BTreeSet<String>,
    limits: Limits,
    seen: &Watching<'_>,
) -> WatchStep {
    let Some(state) = state else {
        return WatchStep::Restart("the rendezvous record vanished".into());
    };
    if let Some(closed) = state.closed() {
        let member = state.round == round && state.is_participant(me);
        return WatchStep::Closed(Closed { member, ..closed });
    }
    if state.round != round || state.phase != Phase::Running || !state.is_participant(me) {
        return WatchStep::Restart(
            state
                .reason
                .clone()
                .unwrap_or_else(|| format!("round {round} is over")),
        );
    }
    let writer = state.writer(alive) == Some(me);
    if let Some(dead) = state.participants.iter().find(|n| !alive.contains(&n.id)) {
        if !writer && seen.gone_for < seen.take_over {
            return WatchStep::Healthy;
        }
        let reason = format!("node {} is gone (no heartbeat)", dead.id);
        return WatchStep::Reopen(
            state.reopened_without(&dead.id, reason.clone(), alive),
            reason,
        );
    }
    let newcomers = state.newcomers(alive, seen.announced);
    let n = state.participants.len() as u32;
    if !writer || newcomers.is_empty() || n >= limits.max || seen.hold_admissions {
        return WatchStep::Healthy;
    }
    let fills = n.saturating_add(newcomers.len() as u32) >= limits.max;
    let gathered = seen.waiting_for >= seen.window
        && seen.running_for >= admission_cooldown(seen.window, state.admissions);
    if !fills && !gathered {
        return WatchStep::Healthy;
    }
    let ids: Vec<&str> = newcomers.iter().map(|n| n.id.as_str()).collect();
    let reason = if ids.len() > 4 {
        format!(
            "{} nodes waiting to join ({}, ...)",
            ids.len(),
            ids[..3].join(", ")
        )
    } else {
        format!("node(s) {} waiting to join", ids.join(", "))
    };
    let mut next = state.reopened(reason.clone(), alive);
    for n in newcomers {
        if !next.expected.contains(&n.id) {
            next.expected.push(n.id.clone());
        }
    }
    next.admissions = state.admissions.saturating_add(1);
    WatchStep::Reopen(next, reason)
}

/// What an agent whose node is asked to go (SIGTERM) does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LeaveStep {
    /// Write this record (the next round, without this node), then leave at a step boundary:
    /// the others go on in place, `nodes` of them at `world_size`.
    Write {
        next: State,
        nodes: u32,
        world_size: u32,
    },
    /// The others cannot go on without this node, or the job is changing already (another
    /// node leaving, joining or failed): the job stops as a whole, checkpointing once.
    Refused(String),
}

/// Node `me`, whose workers run in `round`, is asked to go for `reason`. It may leave alone
/// only from a running round it is part of (so that two nodes told to go at once cannot both
/// leave: the second finds the round reopened by the first) and only when the live nodes left
/// are at least `limits.min`; then the next round opens without it, expecting the others.
pub(crate) fn leave_step(
    state: Option<&State>,
    me: &str,
    round: u64,
    alive: &BTreeSet<String>,
    limits: Limits,
    reason: &str,
) -> LeaveStep {
    let Some(state) = state else {
        return LeaveStep::Refused("the rendezvous record is gone".into());
    };
    if state.closed().is_some() {
        return LeaveStep::Refused("the job is over".into());
    }
    if state.round != round || state.phase != Phase::Running || !state.is_participant(me) {
        return LeaveStep::Refused(format!(
            "the job is between rounds ({})",
            state
                .reason
                .as_deref()
                .unwrap_or("another node joins or leaves")
        ));
    }
    let others: Vec<&Node> = state
        .participants
        .iter()
        .filter(|n| n.id != me && alive.contains(&n.id))
        .collect();
    if (others.len() as u32) < limits.min.max(1) {
        return LeaveStep::Refused(format!(
            "without it the job would have {} node(s), fewer than its minimum of {} (--nnodes MIN:MAX)",
            others.len(),
            limits.min.max(1)
        ));
    }
    let mut staying = alive.clone();
    staying.remove(me);
    LeaveStep::Write {
        next: state.reopened(reason.to_string(), &staying),
        nodes: others.len() as u32,
        world_size: others.iter().fold(0u32, |a, n| a.saturating_add(n.nproc)),
    }
}

/// What an agent asked to go (SIGTERM) while it joins the next round, its workers kept from
/// the last one, does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WithdrawStep {
    /// Write this record (the round without this node), then let the workers go without
    /// saving: `nodes` others go on, and some of them hold the same state.
    Write { next: State, nodes: u32 },
    /// The record needs no change (this node is in no round of it): go as above.
    Go { nodes: u32 },
    /// The others cannot go on without this node's state, or the job is over (why): its
    /// workers stop the old way, the one that was rank 0 saving a checkpoint.
    Refused(String),
}

/// Node `me` is asked to go for `reason` while it joins the next round, its workers still
/// holding the state of the last round, whose nodes were `held` (None: it holds no training
/// state, its workers never trained). It may go alone when at least `limits.min` live nodes go
/// on and one of them held that round too (they hold the same state, or one step apart: a
/// regroup takes the furthest). A round still gathering forgets this node; one that completed
/// with it (its assignment not read yet) is reopened without it, as a node leaving a running
/// round does.
pub(crate) fn withdraw_step(
    state: Option<&State>,
    me: &str,
    held: Option<&[String]>,
    alive: &BTreeSet<String>,
    limits: Limits,
    reason: &str,
) -> WithdrawStep {
    let Some(state) = state else {
        return WithdrawStep::Refused("the rendezvous record is gone".into());
    };
    if state.closed().is_some() {
        return WithdrawStep::Refused("the job is over".into());
    }
    let others: BTreeSet<&str> = state
        .participants
        .iter()
        .chain(&state.waiting)
        .map(|n| n.id.as_str())
        .chain(state.expected.iter().map(String::as_str))
        .filter(|id| *id != me && alive.contains(*id))
        .collect();
    let nodes = others.len() as u32;
    if nodes < limits.min.max(1) {
        return WithdrawStep::Refused(format!(
            "without it the job would have {nodes} node(s), fewer than its minimum of {} (--nnodes MIN:MAX)",
            limits.min.max(1)
        ));
    }
    if let Some(held) = held
        && !others.iter().any(|id| held.iter().any(|h| h == id))
    {
        return WithdrawStep::Refused(
            "no other node trained in the last round, so no other holds the training's state"
                .into(),
        );
    }
    let mentioned = state.is_participant(me)
        || state.waiting.iter().any(|n| n.id == me)
        || state.expected.iter().any(|id| id == me);
    if !mentioned {
        return WithdrawStep::Go { nodes };
    }
    // A node that only waits (for its admission, or as a spare) is not in the group that
    // trains: its going changes nothing there, and the round is not reopened for it.
    let trains = state.is_participant(me) || state.expected.iter().any(|id| id == me);
    if state.phase == Phase::Running && trains {
        let mut staying = alive.clone();
        staying.remove(me);
        return WithdrawStep::Write {
            next: state.reopened(reason.to_string(), &staying),
            nodes,
        };
    }
    let mut next = state.clone();
    next.participants.retain(|n| n.id != me);
    next.waiting.retain(|n| n.id != me);
    next.expected.retain(|id| id != me);
    WithdrawStep::Write {
        next: next.written(),
        nodes,
    }
}

/// The job's workers regroup in place, as a node's said: the record says so for joiners
/// (None: it does already, or the job is over).
pub(crate) fn in_place_step(state: Option<&State>) -> Option<State> {
    let state = state?;
    if state.regroups_in_place || state.closed().is_some() {
        return None;
    }
    Some(
        State {
            regroups_in_place: true,
            ..state.clone()
        }
        .written(),
    )
}

/// What follows a worker failure on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Restart at the next round (after writing the record, if any).
    Restart(Option<State>),
    /// Too many failures: the job is over (after writing the record, if any).
    GiveUp(Option<State>, Closed),
}

/// How a worker's failure bears on the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Another node's doing (its peer vanished) or a save on request: the round reopens,
    /// uncounted.
    Uncounted,
    /// Counts against `max_restarts`.
    Counted,
    /// The program found it cannot train right (`contract::exit::UNRECOVERABLE`): the job
    /// ends now, whatever `max_restarts` allows.
    Unrecoverable,
}

/// A worker of this node failed in `round`, at `at_millis` (its node's wall clock). Counted
/// failures count against `max_restarts`, once per round however many nodes report one; the
/// earliest of them is the job's root cause. An unrecoverable one closes the job, and is its
/// root cause unless an earlier failure of this round is.
pub fn fail_step(
    state: Option<&State>,
    round: u64,
    kind: FailureKind,
    report: &str,
    at_millis: u64,
    max_restarts: u32,
    alive: &BTreeSet<String>,
) -> AfterFailure {
    let Some(state) = state else {
        return AfterFailure::Restart(None);
    };
    if let Some(closed) = state.closed() {
        return AfterFailure::GiveUp(None, closed);
    }
    let mut next = state.clone();
    if kind != FailureKind::Uncounted {
        // A root cause from an earlier round was retried past; this one ends the job.
        let retried = next.last_failed_round.is_some_and(|r| r < round);
        if next.last_failed_round.is_none_or(|r| r < round) {
            next.failures = next.failures.saturating_add(1);
            next.last_failed_round = Some(round);
        }
        let earlier = match (&next.root_cause, next.root_cause_at) {
            (None, _) => true,
            (Some(_), Some(at)) => at_millis < at,
            (Some(_), None) => false,
        };
        if earlier || (kind == FailureKind::Unrecoverable && retried) {
            next.root_cause = Some(report.to_string());
            next.root_cause_at = Some(at_millis);
        }
    }
    if next.failures > max_restarts || kind == FailureKind::Unrecoverable {
        next.phase = Phase::Closed { succeeded: false };
        let closed = next.closed();
        return AfterFailure::GiveUp(
            Some(next.written()),
            closed.unwrap_or(Closed {
                succeeded: false,
                root_cause: None,
                member: true,
            }),
        );
    }
    if next.round == round && next.phase == Phase::Running {
        let reason = format!("a worker failed: {}", report.lines().next().unwrap_or(""));
        next = next.reopened(reason, alive);
        return AfterFailure::Restart(Some(next));
    }
    if next == *state {
        AfterFailure::Restart(None)
    } else {
        AfterFailure::Restart(Some(next.written()))
    }
}

/// This node's workers all finished: the job is over (a no-op if it already is).
pub fn close_step(state: Option<&State>, succeeded: bool, report: Option<&str>) -> Option<State> {
    let state = state.cloned().unwrap_or_default();
    if state.closed().is_some() {
        return None;
    }
    let mut next = state;
    next.phase = Phase::Closed { succeeded };
    if next.root_cause.is_none() {
        next.root_cause = report.map(str::to_string);
    }
    Some(next.written())
}

/// Node `me`'s workers finished: the job is closed as succeeded (if no node closed it yet)
/// and `me` is counted among the finished. None when there is nothing to write (already
/// counted, or the job was closed as failed).
pub(crate) fn finish_step(state: Option<&State>, me: &str) -> Option<State> {
    let mut next = state.cloned().unwrap_or_default();
    match next.closed() {
        Some(Closed {
            succeeded: false, ..
        }) => return None,
        Some(_) if next.finished.iter().any(|id| id == me) => return None,
        Some(_) => {}
        None => next.phase = Phase::Closed { succeeded: true },
    }
    next.finished.push(me.to_string());
    Some(next.written())
}

/// The live participants of a succeeded job whose workers have not finished yet: those a
/// finished node waits for before it exits (a node gone is not waited for).
pub fn unfinished(state: &State, alive: &BTreeSet<String>) -> Vec<String> {
    if state.closed().is_none_or(|c| !c.succeeded) {
        return Vec::new();
    }
    state
        .participants
        .iter()
        .map(|n| &n.id)
        .filter(|id| alive.contains(*id) && !state.finished.contains(id))
        .cloned()
        .collect()
}

mod join;
pub use join::join_step;

#[cfg(test)]
mod tests;
