//! One round of this node's workers: each monitor interval it looks (the stop signals, the
//! workers' messages and state, the rendezvous record), `decide` says what follows, and it
//! carries that out: train on, regroup in place, restart, leave, or end the launch.

use std::time::Duration;

use collective::control::ToAgent;
use rendezvous::{Rendezvous, Restart, Watch};

use super::causes::Causes;
use super::decide::{Memory, Next, Round, Seen};
use super::hold::ADMISSION_HOLD;
use super::leave::{leave_unsaved, let_workers_go, signal_name};
use super::{Kept, Leaving, RoundEnd};
use crate::report::{Failure, Outcome};
use crate::supervise::{Group, Launch, Status, with_timer};
use crate::{LaunchEvent, LaunchSpec};

/// What carrying a decision out left: the round's end, or the workers still running in it.
// It lives for one turn of the agent's loop, on the stack: boxing the group would allocate at
// every turn (every monitor interval) to save a few hundred bytes.
#[allow(clippy::large_enum_variant)]
enum Acted {
    Ended(RoundEnd),
    Running(Group),
}

/// One round of this node's workers, watched until it ends.
pub(super) struct InRound<'a> {
    pub(super) spec: &'a LaunchSpec,
    pub(super) launch: &'a Launch,
    pub(super) rdzv: &'a mut Rendezvous,
    pub(super) restart_count: u32,
    /// The round's nodes, this one among them.
    pub(super) nodes: &'a [String],
    /// Why this node's workers regroup, until they report that they did.
    pub(super) causes: &'a mut Causes,
    pub(super) failed_regroups: u32,
    /// This node's workers have said they regroup in place, in this round or an earlier one.
    pub(super) regroup_in_place: bool,
    /// These workers are this node's first of the launch (no round before this one), of a
    /// program that may say it regroups in place (`hold::may_regroup_in_place`): while they
    /// start, they hold late nodes.
    pub(super) may_hold: bool,
    /// The job was closed by another node that finished: our workers finish too, no restart.
    pub(super) closing: bool,
    /// The last watch could not reach the store (said once, until it answers again).
    pub(super) store_down: bool,
}

/// What one look found, with what it needs to be acted on: why (a peer lost, a round
/// reopened, the job's root cause, the store's error) and a failed worker's report.
struct Looked {
    seen: Seen,
    why: String,
    failure: Option<Box<Failure>>,
}

impl Looked {
    fn just(seen: Seen) -> Looked {
        Looked {
            seen,
            why: String::new(),
            failure: None,
        }
    }

    fn because(seen: Seen, why: String) -> Looked {
        Looked {
            seen,
            why,
            failure: None,
        }
    }
}

impl InRound<'_> {
    /// Watches `group` until the round ends for this node: look, decide, act.
    pub(super) fn run(
        &mut self,
        mut group: Group,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> RoundEnd {
        let spec = self.spec;
        loop {
            if let Some(looked) = self.look(&mut group, events) {
                let memory = Memory {
                    closing: self.closing,
                    can_regroup: group.can_regroup(),
                    regrouping: self.causes.pending(),
                    failed_regroups: self.failed_regroups,
                    max_restarts: spec.max_restarts,
                };
                let next = super::decide::next(&looked.seen, &memory, self.store_down);
                match self.act(next, looked, group, events) {
                    Acted::Ended(end) => return end,
                    Acted::Running(running) => group = running,
                }
            }
            std::thread::sleep(spec.monitor_interval.max(Duration::from_millis(10)));
        }
    }

    /// The most pressing thing there is to see, if any: a stop signal, a worker's report of a
    /// lost peer, the workers' state, then (unless another node closed the job) the round.
    fn look(&mut self, group: &mut Group, events: &mut dyn FnMut(LaunchEvent)) -> Option<Looked> {
        if let Some(signal) = self.launch.signals.received() {
            // Whether this node may leave alone depends on its workers having said they
            // regroup: a SIGTERM soon after they started (a pod deleted as it came up) must
            // not find that word still unread and stop the whole job instead.
            group.read_messages();
            return Some(Looked::just(Seen::Signal(signal)));
        }
        let mut lost = None;
        let mut straggler = None;
        for (local_rank, message) in group.messages() {
            match message {
                ToAgent::Lost { reason, .. } => lost = Some(reason),
                ToAgent::Straggler { slow, report } if local_rank == 0 => {
                    events(LaunchEvent::Straggler {
                        slow,
                        report: report.clone(),
                    });
                    straggler = slow.then_some(report);
                }
                ToAgent::Regrouped(r) if local_rank == 0 => {
                    self.failed_regroups = 0;
                    events(LaunchEvent::Regrouped(crate::NodeRegrouped {
                        node: self.rdzv.node_id().to_string(),
                        reason: self.causes.reported(r.assignments),
                        worker: r,
                    }));
                }
                // The job's training is over: this node's workers finish what they still do
                // (no group needed) and exit; a peer going now changes nothing for them.
                ToAgent::Finished => self.closing = true,
                ToAgent::Ready
                | ToAgent::Paused { .. }
                | ToAgent::Regrouped(_)
                | ToAgent::Straggler { .. } => {}
            }
        }
        if let Some(reason) = lost {
            return Some(Looked::because(
                Seen::PeerLost,
                format!("a peer was lost: {reason}"),
            ));
        }
        if let Some(report) = straggler.filter(|_| self.spec.evict_stragglers) {
            return Some(Looked::because(Seen::Straggler, report));
        }
        match group.poll() {
            Status::Running => {}
            Status::Succeeded => return Some(Looked::just(Seen::WorkersDone)),
            Status::Trouble(trouble) => {
                let failure = with_timer(
                    group.stop_troubled(self.spec.grace, trouble),
                    self.launch.timers.as_ref(),
                );
                return Some(Looked {
                    seen: Seen::WorkerFailed {
                        kind: failure.kind(),
                    },
                    why: String::new(),
                    failure: Some(Box::new(failure)),
                });
            }
        }
        if self.closing {
            return None;
        }
        // The record says the job regroups in place (once): a node joining later starts warm.
        if group.can_regroup() && !self.regroup_in_place {
            let _ = self.rdzv.note_in_place();
        }
        // Workers still starting (a program importing torch) would have to be restarted to
        // take a joiner now; held a while, they say they regroup and take it in place (see
        // ADMISSION_HOLD): at this node's first start of a program that may say so, and mid-job
        // where they said so before; never under --regroup restart, where a joiner restarts
        // them whenever it comes.
        self.regroup_in_place |= group.can_regroup();
        self.rdzv.hold_admissions(
            self.spec.regroup
                && (self.may_hold || self.regroup_in_place)
                && group.starting(ADMISSION_HOLD),
        );
        Some(match self.rdzv.watch() {
            Ok(Watch::Healthy) => Looked::just(Seen::Round(Round::Healthy)),
            Ok(Watch::Restart(Restart { reason, node_gone })) => {
                Looked::because(Seen::Round(Round::Reopened { node_gone }), reason)
            }
            Ok(Watch::Closed(c)) => Looked::because(
                Seen::Round(Round::Closed {
                    succeeded: c.succeeded,
                    member: c.member,
                }),
                c.root_cause.unwrap_or_default(),
            ),
            // The workers do not need the store while they train: they go on.
            Err(e) => Looked::because(Seen::Round(Round::Unreachable), e.to_string()),
        })
    }

    /// Carries `next` out: the end of the round for this node, or the group back when it
    /// trains on.
    fn act(
        &mut self,
        next: Next,
        looked: Looked,
        group: Group,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> Acted {
        let grace = self.spec.grace;
        let Looked { why, failure, .. } = looked;
        let signal = || {
            self.launch
                .signals
                .received()
                .unwrap_or(signal_hook::consts::SIGTERM)
        };
        Acted::Ended(match next {
            Next::Wait => return Acted::Running(group),
            Next::Closing => {
                self.closing = true;
                return Acted::Running(group);
            }
            Next::StoreDown => {
                self.store_down = true;
                let why = match self.rdzv.store_loss_means() {
                    Some(means) => format!("{why}; {means}"),
                    None => why,
                };
                events(LaunchEvent::StoreUnreachable(why));
                return Acted::Running(group);
            }
            Next::StoreBack => {
                self.store_down = false;
                events(LaunchEvent::StoreBack);
                return Acted::Running(group);
            }
            Next::Leave => RoundEnd::Over(self.leave(group, signal(), events)),
            Next::Evict => match self.evict(group, &why, events) {
                Leaving::Went(outcome) => RoundEnd::Over(outcome),
                Leaving::Stayed(group, _) => return Acted::Running(*group),
            },
            Next::Stop => {
                let signal = signal();
                RoundEnd::Over(Outcome::Interrupted {
                    signal,
                    checkpointed: group.stop_interrupted(grace),
                })
            }
            Next::Succeed => {
                group.stop(grace);
                self.exit_barrier(events);
                RoundEnd::Over(Outcome::Succeeded)
            }
            Next::Regroup {
                abort,
                failed,
                tell,
            } => self.regroup(group, abort, failed, tell, why, events),
            Next::Restart { fallback, tell } => self.restart(group, fallback, tell, &why, events),
            Next::RecordFailure { kind } => {
                let failure = *failure.expect("a worker failure comes with its report");
                self.record_failure(failure, kind, events)
            }
            Next::FailAlone => {
                let failure = failure.expect("a worker failure comes with its report");
                RoundEnd::Over(Outcome::Failed(failure))
            }
            Next::JobFailed => {
                group.stop(grace);
                RoundEnd::Over(Outcome::JobFailed(why))
            }
            Next::LeftBehind { succeeded } => {
                events(LaunchEvent::LeftBehind {
                    succeeded,
                    warm: false,
                });
                leave_unsaved(group, grace, grace);
                RoundEnd::Over(if succeeded {
                    Outcome::Succeeded
                } else {
                    Outcome::JobFailed(why)
                })
            }
        })
    }
}

impl InRound<'_> {
    /// [`Next::Regroup`]: this node's workers keep running and take the next round in place.
    fn regroup(
        &mut self,
        mut group: Group,
        abort: bool,
        failed: bool,
        tell: bool,
        why: String,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> RoundEnd {
        self.failed_regroups += failed as u32;
        // Their collectives with a node gone would wait for the collective timeout: the step
        // in flight is dropped at once. Otherwise (nodes joining or leaving) they train on
        // until the round's assignment comes.
        if abort {
            group.abort();
        }
        events(LaunchEvent::Regrouping {
            reason: why.clone(),
        });
        let kept = Kept {
            group: Box::new(group),
            reason: why.clone(),
        };
        if tell {
            self.tell_peer_lost(Some(kept), &why, events)
        } else {
            RoundEnd::Next(Some(kept))
        }
    }

    /// [`Next::Restart`]: this node's workers stop; new ones start at the next round.
    fn restart(
        &mut self,
        group: Group,
        fallback: bool,
        tell: bool,
        why: &str,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> RoundEnd {
        group.stop(self.spec.grace);
        if fallback {
            events(LaunchEvent::RegroupFallback {
                failed: self.failed_regroups + 1,
            });
            self.failed_regroups = 0;
        } else {
            events(LaunchEvent::Reopened {
                reason: why.to_string(),
            });
        }
        if tell {
            self.tell_peer_lost(None, why, events)
        } else {
            RoundEnd::Next(None)
        }
    }

    /// This node's workers lost a peer (`why`): the round is reopened, uncounted (another
    /// node's failure, so its time orders nothing), and the next round joined with `kept`.
    fn tell_peer_lost(
        &mut self,
        kept: Option<Kept>,
        why: &str,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> RoundEnd {
        let report = format!("on node {}: {why}", self.rdzv.node_id());
        match self.rdzv.worker_failed(
            rendezvous::FailureKind::Uncounted,
            &report,
            0,
            self.spec.max_restarts,
        ) {
            // The store is gone (with the node that hosted it): joining waits for it, the
            // workers too.
            Err(e) => {
                events(LaunchEvent::StoreLostRegrouping {
                    error: e.to_string(),
                    wait: self.rdzv.config().join_timeout,
                });
                RoundEnd::Next(kept)
            }
            Ok(None) => RoundEnd::Next(kept),
            Ok(Some(closed)) => {
                if let Some(k) = kept {
                    k.group.stop(self.spec.grace);
                }
                RoundEnd::Over(Outcome::JobFailed(closed.root_cause.unwrap_or(report)))
            }
        }
    }

    /// A worker of this node failed: the rendezvous records it (`kind`: counted against
    /// --max-restarts) and the next round restarts every node's workers, or the job ends.
    fn record_failure(
        &mut self,
        failure: Failure,
        kind: rendezvous::FailureKind,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> RoundEnd {
        let report = format!("on node {}: {failure}", self.rdzv.node_id());
        let at = failure.at_millis();
        let recorded = self
            .rdzv
            .worker_failed(kind, &report, at, self.spec.max_restarts);
        match recorded {
            // No retry can fix it: whether or not the record could tell the others, this node
            // ends with it (the others learn of the end, or fail on their own).
            Ok(None) | Err(_) if kind == rendezvous::FailureKind::Unrecoverable => {
                RoundEnd::Over(Outcome::Failed(Box::new(failure)))
            }
            // The store is gone, most likely with the node that hosted it (a c10d store dies
            // with its agent; its workers' deaths are what failed ours). Join again: joining
            // waits, up to the join timeout, for a store at the same address, which the host's
            // replacement (a new pod 0) starts afresh.
            Err(e) => {
                events(LaunchEvent::StoreLost {
                    error: e.to_string(),
                    failure,
                    wait: self.rdzv.config().join_timeout,
                });
                RoundEnd::Next(None)
            }
            Ok(None) => {
                events(LaunchEvent::Restarting {
                    failure,
                    restart_count: self.restart_count
                        + (kind == rendezvous::FailureKind::Counted) as u32,
                });
                RoundEnd::Next(None)
            }
            Ok(Some(closed)) => {
                RoundEnd::Over(Outcome::JobFailed(closed.root_cause.unwrap_or(report)))
            }
        }
    }

    /// This node's workers are done and the job succeeded: count this node finished (closing
    /// the job for the others if it is the first), then wait until every live node's workers
    /// have finished too, up to exit_barrier_timeout, saying whom it waits for. A node's exit 0
    /// then says the whole job is done, which a Kubernetes Job's successPolicy relies on.
    fn exit_barrier(&mut self, events: &mut dyn FnMut(LaunchEvent)) {
        if let Err(e) = self.rdzv.finish() {
            events(LaunchEvent::StoreUnreachable(e.to_string()));
            return;
        }
        let wait = self.rdzv.config().exit_barrier_timeout;
        let unfinished = self.rdzv.await_finished(wait, &mut |nodes, waited| {
            events(LaunchEvent::AwaitingOthers {
                nodes: nodes.to_vec(),
                waited,
            })
        });
        if !unfinished.is_empty() {
            events(LaunchEvent::OthersUnfinished {
                nodes: unfinished,
                waited: wait,
            });
        }
    }

    /// This node is asked to go (`signal`) and its workers regroup: when the others can go on
    /// without it, it leaves the rendezvous, its workers leave after the step under way (the
    /// pause they raise makes it the same step for every rank) and exit, and the launch ends
    /// with [`Outcome::Left`]; otherwise the job stops as a whole, checkpointing once.
    fn leave(&mut self, group: Group, signal: i32, events: &mut dyn FnMut(LaunchEvent)) -> Outcome {
        let node = self.rdzv.node_id().to_string();
        let reason = format!("node {node} leaves ({})", signal_name(signal));
        match self.leave_job(group, reason, Outcome::Left { signal }, events) {
            Leaving::Went(outcome) => outcome,
            Leaving::Stayed(group, why) => {
                events(LaunchEvent::LeaveRefused { node, signal, why });
                Outcome::Interrupted {
                    signal,
                    checkpointed: group.stop_interrupted(self.spec.grace),
                }
            }
        }
    }

    /// This node is a straggler (`report`, `--stragglers evict`): it leaves the job as a node
    /// asked to go does, the others going on in place without it. When they cannot (they
    /// would be fewer than --nnodes MIN, or the job is changing already), it stays and trains
    /// on, and the group comes back.
    fn evict(
        &mut self,
        group: Group,
        report: &str,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> Leaving {
        let node = self.rdzv.node_id().to_string();
        let reason = format!("node {node} is {}: {report}", contract::exit::EVICTED);
        let evicted = Outcome::Evicted {
            report: reason.clone(),
        };
        match self.leave_job(group, reason, evicted, events) {
            Leaving::Stayed(group, why) => {
                events(LaunchEvent::EvictRefused {
                    report: report.to_string(),
                    why: why.clone(),
                });
                Leaving::Stayed(group, why)
            }
            went => went,
        }
    }

    /// Leaves the job for `reason` when the rendezvous lets this node go alone: its workers
    /// leave after the step under way and exit, and the launch ends with `left` (or
    /// succeeded, when the job ended at that very step: nothing was left to leave); the group
    /// back, with why, when the rendezvous refused.
    fn leave_job(
        &mut self,
        group: Group,
        reason: String,
        left: Outcome,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> Leaving {
        match self.rdzv.leave(&reason) {
            Ok(rendezvous::Leaving::Left { nodes, world_size }) => {
                events(LaunchEvent::Leaving {
                    reason,
                    nodes,
                    world_size,
                });
            }
            // Another node told to go at the same moment (a scale-down by several pods, a
            // drain) reopened the round first: this one goes too, from the round that gathers,
            // when the others can go on without both.
            Ok(rendezvous::Leaving::Refused(why)) => {
                match self.rdzv.withdraw(Some(self.nodes), &reason) {
                    Ok(rendezvous::Withdrawn::Went { nodes }) => {
                        events(LaunchEvent::Withdrawing { reason, nodes });
                    }
                    _ => return Leaving::Stayed(Box::new(group), why),
                }
            }
            Err(e) => {
                return Leaving::Stayed(
                    Box::new(group),
                    format!("the rendezvous could not record it ({e})"),
                );
            }
        }
        let finished = let_workers_go(self.spec, self.rdzv, group);
        Leaving::Went(if finished == Some(true) {
            Outcome::Succeeded
        } else {
            left
        })
    }
}
