//! Leaving the job and ending it: a worker's failure recorded, a node told to go, the store
//! handed over, the job closed or finished, the exit barrier, and the c10d host lingering so
//! that the others learn how the job ended.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::{Leaving, Rendezvous, Withdrawn};
use crate::state::{self, AfterFailure, LeaveStep, State, WithdrawStep};
use crate::{Closed, RendezvousError};

impl Rendezvous {
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
