//! The elastic agent: one per node, it joins the rendezvous, runs this node's workers at the
//! world size of the round, and starts them again at the next round when a worker fails, a
//! node is lost or a node arrives, until the job succeeds or `--max-restarts` failures.
//!
//! Its loop polls three sources every monitor interval: the stop signals, the local workers,
//! and the rendezvous record (whose heartbeats run on their own thread). What it does about
//! what it sees is decided in `decide`, a pure function tested on its own. This module joins
//! the rounds one after another; `round` watches one round and carries the decisions out;
//! `hold` says when a starting group holds late nodes, `warm` starts a joiner's workers
//! before it has a place, `leave` lets the workers go, `causes` keeps why each regroup came.

mod causes;
mod decide;
mod hold;
mod leave;
mod round;
mod warm;

use rendezvous::{Assignment, Joined, Rendezvous};

use crate::output::Sink;
use crate::report::Outcome;
use crate::supervise::{Group, Launch, Outputs, Start};
use crate::{LaunchError, LaunchEvent, LaunchSpec};
use causes::Causes;
use hold::may_regroup_in_place;
use leave::{leave_unsaved, let_workers_go, signal_name};
use round::InRound;
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
    let warmed = warm::warm_up(spec, rdzv, &launch, (&stdout, &stderr), events)?;
    let mut kept = match kept_warm(warmed, rdzv.node_id(), events) {
        Ok(kept) => kept,
        Err(stopped) => return Ok(stopped),
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
        let assignment = match join_round(
            spec,
            rdzv,
            &launch,
            (&stdout, &stderr),
            &mut kept,
            &held,
            events,
        )? {
            Ok(assignment) => assignment,
            Err(over) => return Ok(over),
        };
        events(LaunchEvent::Joined(assignment.clone()));
        let round_spec = round_spec(spec, &assignment, health);
        let outputs = launch.outputs(&stdout, &stderr);
        let group = round_workers(
            kept.take(),
            &round_spec,
            &assignment,
            spec,
            &mut causes,
            outputs,
            events,
        )?;
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

/// Joins the next round, the workers `kept` from the last one (whose nodes were `held`) still
/// running, or starting warm meanwhile when the job turns out to train without this node; those
/// workers are in `kept` once it has a place. `Err`: joining ended without a round (a stop, the
/// job over, an error), and the launch ends so.
fn join_round(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    launch: &Launch,
    outputs: (&Sink, &Sink),
    kept: &mut Option<Kept>,
    held: &[String],
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Result<Assignment, Outcome>, LaunchError> {
    rdzv.set_port(crate::free_port()?);
    events(LaunchEvent::Joining {
        node: rdzv.node_id().to_string(),
    });
    let mut warming = warm::WhileWaiting::new(spec, kept.is_some());
    let joined = rdzv.join(&|| launch.signals.received().is_some(), &mut |w| {
        warming.heard(w.warm_start_pays, spec, launch, outputs, events);
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
            return not_joined(ended, spec, rdzv, kept, held, signal, events).map(Err);
        }
    };
    if let Some(group) = warming.ready(spec, launch, events) {
        *kept = Some(Kept {
            group,
            reason: format!("node {} takes a place, its workers warm", rdzv.node_id()),
        });
    }
    Ok(Ok(assignment))
}

/// The workers a warm start left (`Warmed`), kept for the first round; `Err`: a stop signal
/// came while they started, and the launch ends so.
fn kept_warm(
    warmed: Warmed,
    node: &str,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Option<Kept>, Outcome> {
    match warmed {
        Warmed::Ready(group) => Ok(Some(Kept {
            group,
            reason: format!("node {node} joins, its workers warm"),
        })),
        Warmed::Cold(why) => {
            if let Some(why) = why {
                events(LaunchEvent::WarmStartFailed(why));
            }
            Ok(None)
        }
        Warmed::Stopped(signal) => Err(Outcome::Interrupted {
            signal,
            checkpointed: false,
        }),
    }
}

/// The workers' spec in the round `assignment` gives: its ranks, world size and master, and
/// this node's health figures (`contract::env::NODE_HEALTH`) when it measured them.
fn round_spec(
    spec: &LaunchSpec,
    assignment: &Assignment,
    health: Option<crate::health::Health>,
) -> LaunchSpec {
    let mut extra_env = spec.extra_env.clone();
    if let Some(h) = health {
        extra_env.push((
            contract::env::NODE_HEALTH.into(),
            format!("{},{}", h.gemm_mflops, h.loopback_mbps),
        ));
    }
    LaunchSpec {
        extra_env,
        nnodes: assignment.nnodes,
        node_rank: assignment.node_rank,
        rank_offset: assignment.rank_offset,
        world_size: assignment.world_size,
        master_addr: assignment.master_addr.clone(),
        master_port: assignment.master_port,
        ..spec.clone()
    }
}

/// The workers of the round `assignment` gives: those `kept` running, handed the round, or,
/// when there are none or one of them exited meanwhile (the others are stopped), new ones.
/// `causes` learns why kept workers were handed it, and starts afresh with new ones.
fn round_workers(
    kept: Option<Kept>,
    round_spec: &LaunchSpec,
    assignment: &Assignment,
    spec: &LaunchSpec,
    causes: &mut Causes,
    outputs: Outputs<'_>,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Group, LaunchError> {
    if let Some(mut k) = kept {
        if k.group.assign(round_spec, assignment.restart_count) {
            causes.handed(k.group.assignments(), k.reason);
            return Ok(*k.group);
        }
        k.group.stop(spec.grace);
    }
    *causes = Causes::default();
    let start = if spec.regroup {
        Start::InPlace
    } else {
        Start::Plain
    };
    Group::spawn(
        round_spec,
        assignment.restart_count,
        assignment.round,
        start,
        outputs,
        events,
    )
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
