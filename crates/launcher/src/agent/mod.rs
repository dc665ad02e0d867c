//! The elastic agent: one per node, it joins the rendezvous, runs this node's workers at the
//! world size of the round, and starts them again at the next round when a worker fails, a
//! node is lost or a node arrives, until the job succeeds or `--max-restarts` failures.
//!
//! Its loop polls three sources every monitor interval: the stop signals, the local workers,
//! and the rendezvous record (whose heartbeats run on their own thread). What it does about
//! what it sees is decided in `decide`, a pure function tested on its own; this module
//! gathers the observations and carries the decisions out.

mod causes;
mod decide;
mod hold;
mod warm;

use std::time::{Duration, Instant};

use collective::control::ToAgent;
use rendezvous::{Joined, Rendezvous, Restart, Watch};

use crate::output::Sink;
use crate::report::{Failure, Outcome};
use crate::supervise::{Group, Launch, Start, Status, with_timer};
use crate::{LaunchError, LaunchEvent, LaunchSpec};
use causes::Causes;
use decide::{Memory, Next, Round, Seen};
use hold::{ADMISSION_HOLD, may_regroup_in_place};
use warm::Warmed;

/// Runs this node's part of an elastic job. `spec` gives the workers (program, nproc, log dir,
/// grace, max restarts); the rendezvous decides ranks, world size and the master address.
pub fn run_elastic(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    stdout: Sink,
    stderr: Sink,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let outcome = run_rounds(spec, rdzv, stdout, stderr, events)?;
    if !matches!(
        outcome,
        Outcome::Interrupted { .. }
            | Outcome::Left { .. }
            | Outcome::Evicted { .. }
            | Outcome::Refused { .. }
    ) {
        // The job is over: if this agent hosts the store, the others still need it to learn so.
        // (A node that left handed its store over already: the others train on.)
        rdzv.linger(&mut |nodes, up_to| {
            events(LaunchEvent::KeepingStore {
                nodes: nodes.to_vec(),
                up_to,
            })
        });
    }
    Ok(outcome)
}

/// The health check before the first join (`spec.health_check`): measures this node, puts
/// the figures in its entry of the record, compares them with the nodes already in the job,
/// and says so. Refused (the launch's end) when it is far below them and `--health-check
/// refuse`. A record that cannot be read yet compares with nobody: joining says why.
fn health_gate(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    events: &mut dyn FnMut(LaunchEvent),
) -> Gate {
    if spec.health_check == crate::HealthCheck::Off {
        return Gate::Passed(None);
    }
    let mine = crate::health::probe();
    rdzv.set_health(mine);
    let others = rdzv.peers_health().unwrap_or_default();
    let (against, far_below) = match crate::health::judge(mine, &others) {
        crate::health::Verdict::Alone => (None, false),
        crate::health::Verdict::Passed(figures) => (Some(figures), false),
        crate::health::Verdict::FarBelow(figures) => (Some(figures), true),
    };
    events(LaunchEvent::HealthChecked {
        health: mine,
        against: against.clone(),
        far_below,
    });
    if !(far_below && spec.health_check == crate::HealthCheck::Refuse) {
        return Gate::Passed(Some(mine));
    }
    Gate::Refused(Outcome::Refused {
        report: format!(
            "node {} failed its health check, far below the {} node(s) in the job ({}): it does \
             not join (--health-check warn lets it join anyway)",
            rdzv.node_id(),
            others.len(),
            against.unwrap_or_default()
        ),
    })
}

/// What the health check lets through: the node, with its figures (none when not measured).
enum Gate {
    Passed(Option<crate::health::Health>),
    Refused(Outcome),
}

/// How a node's attempt to leave the job ended.
enum Leaving {
    /// It left: the launch ends so.
    Went(Outcome),
    /// The others cannot go on without it (why): its workers, still running, come back.
    Stayed(Box<Group>, String),
}

/// This node's workers, left running between rounds to regroup in place.
struct Kept {
    group: Box<Group>,
    /// Why they left their group, for the report of the regroup.
    reason: String,
}

/// How a round ended for this node.
enum RoundEnd {
    /// Join the next round, with the workers kept running when they regroup in place.
    Next(Option<Kept>),
    /// The launch is over.
    Over(Outcome),
}

fn run_rounds(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    stdout: Sink,
    stderr: Sink,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let health = match health_gate(spec, rdzv, events) {
        Gate::Refused(refused) => return Ok(refused),
        Gate::Passed(health) => health,
    };
    let launch = Launch::open(spec)?;
    // Joining a job under way, the workers start warm: the others then wait for the state's
    // transfer alone, not for this node's start.
    let mut kept: Option<Kept> =
        match warm::warm_up(spec, rdzv, &launch, (&stdout, &stderr), events)? {
            Warmed::Ready(group) => Some(Kept {
                group,
                reason: format!("node {} joins, its workers warm", rdzv.node_id()),
            }),
            Warmed::Cold(why) => {
                if let Some(why) = why {
                    events(LaunchEvent::WarmStartFailed(why));
                }
                None
            }
            Warmed::Stopped(signal) => {
                return Ok(Outcome::Interrupted {
                    signal,
                    checkpointed: false,
                });
            }
        };
    // The nodes of the round the kept workers left.
    let mut held: Vec<String> = Vec::new();
    // Regroups in a row whose new group failed before it trained: past --max-restarts, the
    // workers are started again instead.
    let mut failed_regroups = 0u32;
    // This node's workers have said they regroup in place (in an earlier round of the launch).
    let mut regroup_in_place = false;
    // Rounds this node's workers ran in.
    let mut rounds = 0u32;
    // Why this node's workers were handed each round they have not yet said they train in.
    let mut causes = Causes::default();
    loop {
        rdzv.set_port(crate::free_port()?);
        events(LaunchEvent::Joining {
            node: rdzv.node_id().to_string(),
        });
        let mut warming = warm::WhileWaiting::new(spec, kept.is_some());
        let joined = rdzv.join(&|| launch.signals.received().is_some(), &mut |w| {
            warming.heard(w.warm_start_pays, spec, &launch, (&stdout, &stderr), events);
            events(LaunchEvent::StillJoining(w))
        });
        let assignment = match joined {
            Ok(Joined::Assigned(a)) => a,
            ended => {
                let signal = launch.signals.received().unwrap_or(15);
                let kept = kept.take().or_else(|| {
                    warming.into_group().map(|group| Kept {
                        group,
                        reason: String::new(),
                    })
                });
                return not_joined(ended, spec, rdzv, kept, &held, signal, events);
            }
        };
        if let Some(group) = warming.ready(spec, &launch, events) {
            kept = Some(Kept {
                group,
                reason: format!("node {} takes a place, its workers warm", rdzv.node_id()),
            });
        }
        events(LaunchEvent::Joined(assignment.clone()));
        let mut extra_env = spec.extra_env.clone();
        if let Some(h) = health {
            extra_env.push((
                contract::env::NODE_HEALTH.into(),
                format!("{},{}", h.gemm_mflops, h.loopback_mbps),
            ));
        }
        let round_spec = LaunchSpec {
            extra_env,
            nnodes: assignment.nnodes,
            node_rank: assignment.node_rank,
            rank_offset: assignment.rank_offset,
            world_size: assignment.world_size,
            master_addr: assignment.master_addr.clone(),
            master_port: assignment.master_port,
            ..spec.clone()
        };
        let assigned = kept.take().and_then(|mut k| {
            if k.group.assign(&round_spec, assignment.restart_count) {
                return Some(k);
            }
            // One of them exited meanwhile: this node starts afresh.
            k.group.stop(spec.grace);
            None
        });
        let group = match assigned {
            Some(k) => {
                causes.handed(k.group.assignments(), k.reason);
                *k.group
            }
            None => {
                causes = Causes::default();
                Group::spawn(
                    &round_spec,
                    assignment.restart_count,
                    assignment.round,
                    if spec.regroup {
                        Start::InPlace
                    } else {
                        Start::Plain
                    },
                    launch.outputs(&stdout, &stderr),
                    events,
                )?
            }
        };
        let mut round = InRound {
            spec,
            launch: &launch,
            rdzv: &mut *rdzv,
            restart_count: assignment.restart_count,
            nodes: &assignment.nodes,
            causes: &mut causes,
            failed_regroups,
            regroup_in_place,
            may_hold: rounds == 0 && may_regroup_in_place(&spec.program),
            closing: false,
            store_down: false,
        };
        let end = round.run(group, events);
        rounds += 1;
        failed_regroups = round.failed_regroups;
        regroup_in_place = round.regroup_in_place;
        match end {
            RoundEnd::Next(k) => {
                kept = k;
                // Kept workers hold the state of this round, as its other nodes do.
                held = assignment.nodes.clone();
            }
            RoundEnd::Over(outcome) => return Ok(outcome),
        }
    }
}

/// Joining ended without a round (`ended`: a stop, the job over, an error): the launch ends,
/// and workers `kept` from the last round (whose nodes were `held`) with it.
fn not_joined(
    ended: Result<Joined, rendezvous::RendezvousError>,
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    kept: Option<Kept>,
    held: &[String],
    signal: i32,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let kept = match (&ended, kept) {
        (Ok(Joined::Stopped), Some(k)) => {
            return Ok(go_while_joining(spec, rdzv, k, held, signal, events));
        }
        // Told to go as it joins, with no workers yet (a pod deleted as it starts): it holds
        // nothing, and the round forms without it rather than wait for its heartbeat to lapse.
        (Ok(Joined::Stopped), None) => {
            let reason = format!("node {} leaves ({})", rdzv.node_id(), signal_name(signal));
            if let Ok(rendezvous::Withdrawn::Went { nodes }) = rdzv.withdraw(None, &reason) {
                events(LaunchEvent::NeverJoined { reason, nodes });
            }
            None
        }
        // The job ended in a round without this node: its workers are behind (not to save).
        (Ok(Joined::Closed(c)), Some(k)) if !c.member => {
            events(LaunchEvent::LeftBehind {
                succeeded: c.succeeded,
                warm: held.is_empty(),
            });
            leave_unsaved(*k.group, spec.grace, spec.grace);
            return Ok(match ended? {
                Joined::Closed(c) if !c.succeeded => {
                    Outcome::JobFailed(c.root_cause.unwrap_or_default())
                }
                _ => Outcome::Succeeded,
            });
        }
        (_, kept) => kept,
    };
    // Waiting workers that will not train again: a stop request lets them save.
    if let Some(k) = kept {
        k.group.stop_interrupted(spec.grace);
    }
    match ended? {
        Joined::Stopped => Ok(Outcome::Interrupted {
            signal,
            checkpointed: false,
        }),
        Joined::Closed(c) if c.succeeded => {
            events(LaunchEvent::JobAlreadyOver);
            Ok(Outcome::Succeeded)
        }
        Joined::Closed(c) => Ok(Outcome::JobFailed(c.root_cause.unwrap_or_default())),
        Joined::Assigned(_) => unreachable!("a round joined is not an end"),
    }
}

/// This node is asked to go (`signal`) while it joins the next round, its workers `kept` from
/// the last one, whose nodes were `held`: when another of them goes on, the round forms without
/// this node and its workers leave without saving (the others hold the same state); otherwise
/// they stop, the one that was rank 0 saving a checkpoint.
fn go_while_joining(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    kept: Kept,
    held: &[String],
    signal: i32,
    events: &mut dyn FnMut(LaunchEvent),
) -> Outcome {
    let node = rdzv.node_id().to_string();
    let reason = format!("node {node} leaves ({})", signal_name(signal));
    // Warm workers that never trained hold nothing.
    let held = (!held.is_empty()).then_some(held);
    let why = match rdzv.withdraw(held, &reason) {
        Ok(rendezvous::Withdrawn::Went { nodes }) => {
            events(LaunchEvent::Withdrawing { reason, nodes });
            let_workers_go(spec, rdzv, *kept.group);
            return Outcome::Left { signal };
        }
        Ok(rendezvous::Withdrawn::Refused(why)) => why,
        Err(e) => format!("the rendezvous could not record it ({e})"),
    };
    events(LaunchEvent::WithdrawRefused { node, signal, why });
    Outcome::Interrupted {
        signal,
        checkpointed: kept.group.stop_interrupted(spec.grace),
    }
}

/// What carrying a decision out left: the round's end, or the workers still running in it.
// It lives for one turn of the agent's loop, on the stack: boxing the group would allocate at
// every turn (every monitor interval) to save a few hundred bytes.
#[allow(clippy::large_enum_variant)]
enum Acted {
    Ended(RoundEnd),
    Running(Group),
}

/// One round of this node's workers, watched until it ends.
struct InRound<'a> {
    spec: &'a LaunchSpec,
    launch: &'a Launch,
    rdzv: &'a mut Rendezvous,
    restart_count: u32,
    /// The round's nodes, this one among them.
    nodes: &'a [String],
    /// Why this node's workers regroup, until they report that they did.
    causes: &'a mut Causes,
    failed_regroups: u32,
    /// This node's workers have said they regroup in place, in this round or an earlier one.
    regroup_in_place: bool,
    /// These workers are this node's first of the launch (no round before this one), of a
    /// program that may say it regroups in place (`hold::may_regroup_in_place`): while they
    /// start, they hold late nodes.
    may_hold: bool,
    /// The job was closed by another node that finished: our workers finish too, no restart.
    closing: bool,
    /// The last watch could not reach the store (said once, until it answers again).
    store_down: bool,
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
    fn run(&mut self, mut group: Group, events: &mut dyn FnMut(LaunchEvent)) -> RoundEnd {
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
                let next = decide::next(&looked.seen, &memory, self.store_down);
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

/// This node leaves, the rendezvous already told: its workers leave after the step under way
/// and exit (stopped if they do not), then its store, if it hosts it, stays until the others
/// have formed their round. One budget for both waits: the pod's grace period bounds them
/// together. Workers that cannot leave at a step (still starting, a program without
/// `trainctl.torch`) are stopped as a stop signal stops them; the others restart theirs at the
/// new size. Returns [`Group::wait_exited`]'s word on how the workers ended.
fn let_workers_go(spec: &LaunchSpec, rdzv: &mut Rendezvous, group: Group) -> Option<bool> {
    let wait = LEAVE_TIMEOUT.min(spec.regroup_timeout);
    let deadline = Instant::now() + wait;
    let finished = if group.can_regroup() {
        leave_unsaved(group, wait, spec.grace)
    } else {
        group.stop_interrupted(spec.grace);
        None
    };
    rdzv.hand_over(deadline.saturating_duration_since(Instant::now()));
    finished
}

/// This node's workers leave without saving (the others hold the same state, or the job is
/// over and theirs is behind): `Leave`, up to `wait` for them to exit, then stopped (each given
/// `grace`). Returns [`Group::wait_exited`]'s word on how they ended.
fn leave_unsaved(mut group: Group, wait: Duration, grace: Duration) -> Option<bool> {
    group.leave();
    let finished = group.wait_exited(wait);
    group.stop(grace);
    finished
}

/// How long a leaving node may take to see its workers reach the end of their step and, when
/// it hosts the c10d store, the others form their next round: well inside Kubernetes' default
/// grace period of 30 s, after which the pod is killed.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(20);

fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_string())
}
