//! Joining a round: read the record, announce this node (etcd), merge the announcements when
//! this node writes the round, and wait, saying so, until the round completes or the job is
//! over.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::{Joined, Rendezvous};
use crate::RendezvousError;
use crate::state::{self, JoinStep, Node, Phase, State};

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

impl Rendezvous {
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
}
