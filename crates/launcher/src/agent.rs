//! The elastic agent: one per node, it joins the rendezvous, runs this node's workers at the
//! world size of the round, and starts them again at the next round when a worker fails, a
//! node is lost or a node arrives, until the job succeeds or `--max-restarts` failures.
//!
//! Its loop polls three sources every monitor interval: the stop signals, the local workers,
//! and the rendezvous record (whose heartbeats run on their own thread).

use std::time::{Duration, Instant};

use collective::control::ToAgent;
use rendezvous::{Joined, Rendezvous, Restart, Watch};

use crate::output::Sink;
use crate::report::{ExitKind, Outcome};
use crate::supervise::{Group, Launch, Status, with_timer};
use crate::{LaunchError, LaunchEvent, LaunchSpec};

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
    if !matches!(outcome, Outcome::Interrupted { .. }) {
        // The job is over: if this agent hosts the store, the others still need it to learn so.
        rdzv.linger();
    }
    Ok(outcome)
}

/// This node's workers, left running between rounds to regroup in place.
struct Kept {
    group: Group,
    /// Why they left their group, for the report of the regroup.
    reason: String,
}

fn run_rounds(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    stdout: Sink,
    stderr: Sink,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let launch = Launch::open(spec)?;
    let (signals, timers) = (&launch.signals, launch.timers.as_ref());
    let mut kept: Option<Kept> = None;
    // Regroups in a row whose new group failed before it trained: past --max-restarts, the
    // workers are started again instead.
    let mut failed_regroups = 0u32;
    loop {
        rdzv.set_port(crate::free_port()?);
        events(LaunchEvent::Joining {
            node: rdzv.node_id().to_string(),
        });
        let joined = rdzv.join(&|| signals.received().is_some());
        let assignment = match joined {
            Ok(Joined::Assigned(a)) => a,
            ended => {
                // Waiting workers that will not train again: a stop request lets them save.
                let checkpointed = kept
                    .take()
                    .is_some_and(|k| k.group.stop_interrupted(spec.grace));
                return match ended? {
                    Joined::Assigned(_) => unreachable!("matched above"),
                    Joined::Stopped => Ok(Outcome::Interrupted {
                        signal: signals.received().unwrap_or(15),
                        checkpointed,
                    }),
                    Joined::Closed(c) if c.succeeded => {
                        events(LaunchEvent::JobAlreadyOver);
                        Ok(Outcome::Succeeded)
                    }
                    Joined::Closed(c) => Ok(Outcome::JobFailed(c.root_cause.unwrap_or_default())),
                };
            }
        };
        events(LaunchEvent::Joined(assignment.clone()));
        let round_spec = LaunchSpec {
            nnodes: assignment.nnodes,
            node_rank: assignment.node_rank,
            rank_offset: assignment.rank_offset,
            world_size: assignment.world_size,
            master_addr: assignment.master_addr.clone(),
            master_port: assignment.master_port,
            ..spec.clone()
        };
        // Why this node's workers regroup, until they report that they did.
        let mut regrouping = None;
        let assigned = kept.take().and_then(|mut k| {
            if k.group.assign(&round_spec, assignment.restart_count) {
                return Some(k);
            }
            // One of them exited meanwhile: this node starts afresh.
            k.group.stop(spec.grace);
            None
        });
        let mut group = match assigned {
            Some(k) => {
                regrouping = Some(k.reason);
                k.group
            }
            None => Group::spawn(
                &round_spec,
                assignment.restart_count,
                assignment.round,
                spec.regroup,
                launch.outputs(&stdout, &stderr),
                events,
            )?,
        };
        // The job was closed by another node that finished: our workers finish too, no restart.
        let mut closing = false;
        let mut store_down_since: Option<Instant> = None;
        loop {
            if let Some(signal) = signals.received() {
                let checkpointed = group.stop_interrupted(spec.grace);
                return Ok(Outcome::Interrupted {
                    signal,
                    checkpointed,
                });
            }
            let mut lost = None;
            for (local_rank, message) in group.messages() {
                match message {
                    ToAgent::Lost { reason, .. } => lost = Some(reason),
                    ToAgent::Regrouped(r) if local_rank == 0 => {
                        failed_regroups = 0;
                        events(LaunchEvent::Regrouped(crate::Regrouped {
                            node: rdzv.node_id().to_string(),
                            reason: regrouping.take().unwrap_or_default(),
                            world_size_before: r.world_size_before,
                            world_size: r.world_size,
                            step: r.step,
                            steps_dropped: r.steps_dropped,
                            bytes: r.bytes,
                            seconds: r.seconds,
                        }));
                    }
                    ToAgent::Ready | ToAgent::Paused { .. } | ToAgent::Regrouped(_) => {}
                }
            }
            if lost.is_some() && closing {
                // Another node finished the job: there is no next round to regroup in.
                group.stop(spec.grace);
                return Ok(Outcome::Succeeded);
            }
            if let Some(reason) = lost {
                if regrouping.is_some() {
                    failed_regroups += 1;
                }
                let reason = format!("a peer was lost ({reason})");
                let report = format!("on node {}: {reason}", rdzv.node_id());
                if failed_regroups > spec.max_restarts {
                    // Today's restart: stop them; the next round starts new workers, which
                    // take the state from a peer that still trains, or from the checkpoint.
                    events(LaunchEvent::RegroupFallback {
                        failed: failed_regroups,
                    });
                    failed_regroups = 0;
                    group.stop(spec.grace);
                } else {
                    events(LaunchEvent::Regrouping {
                        reason: reason.clone(),
                    });
                    kept = Some(Kept { group, reason });
                }
                // Not counted (another node's failure), so its time orders nothing.
                match rdzv.worker_failed(false, &report, 0, spec.max_restarts) {
                    // The store is gone (see below): joining waits for it, the workers too.
                    Err(e) => events(LaunchEvent::StoreLostRegrouping {
                        error: e.to_string(),
                        wait: rdzv.config().join_timeout,
                    }),
                    Ok(None) => {}
                    Ok(Some(closed)) => {
                        if let Some(k) = kept.take() {
                            k.group.stop(spec.grace);
                        }
                        return Ok(Outcome::JobFailed(closed.root_cause.unwrap_or(report)));
                    }
                }
                break;
            }
            match group.poll() {
                Status::Running => {}
                Status::Succeeded => {
                    group.stop(spec.grace);
                    if let Err(e) = rdzv.close(true, None) {
                        events(LaunchEvent::StoreUnreachable(e.to_string()));
                    }
                    return Ok(Outcome::Succeeded);
                }
                Status::Trouble(trouble) => {
                    let failure = with_timer(group.stop_troubled(spec.grace, trouble), timers);
                    let report = format!("on node {}: {failure}", rdzv.node_id());
                    if closing {
                        return Ok(Outcome::Failed(Box::new(failure)));
                    }
                    // A lost peer is another node's failure; a preempted worker saved its work.
                    let counted = ![contract::exit::PEER_LOST, contract::exit::PREEMPTED]
                        .iter()
                        .any(|code| failure.exit == ExitKind::Code(*code));
                    let at = failure.at_millis();
                    match rdzv.worker_failed(counted, &report, at, spec.max_restarts) {
                        // The store is gone, most likely with the node that hosted it (a c10d
                        // store dies with its agent; its workers' deaths are what failed ours).
                        // Join again: joining waits, up to the join timeout, for a store at the
                        // same address, which the host's replacement (a new pod 0) starts afresh.
                        Err(e) => {
                            events(LaunchEvent::StoreLost {
                                error: e.to_string(),
                                failure,
                                wait: rdzv.config().join_timeout,
                            });
                            break;
                        }
                        Ok(None) => {
                            events(LaunchEvent::Restarting {
                                failure,
                                restart_count: assignment.restart_count + counted as u32,
                            });
                            break;
                        }
                        Ok(Some(closed)) => {
                            return Ok(Outcome::JobFailed(closed.root_cause.unwrap_or(report)));
                        }
                    }
                }
            }
            if !closing {
                match rdzv.watch() {
                    Ok(Watch::Healthy) => {
                        if store_down_since.take().is_some() {
                            events(LaunchEvent::StoreBack);
                        }
                    }
                    Ok(Watch::Restart(Restart { reason, node_gone })) => {
                        if group.can_regroup() {
                            // Their collectives with a node gone would wait for the collective
                            // timeout: the step in flight is dropped at once. Otherwise (nodes
                            // joining) they train on until the round's assignment comes.
                            if node_gone {
                                group.abort();
                            }
                            events(LaunchEvent::Regrouping {
                                reason: reason.clone(),
                            });
                            kept = Some(Kept { group, reason });
                        } else {
                            group.stop(spec.grace);
                            events(LaunchEvent::Reopened { reason });
                        }
                        break;
                    }
                    Ok(Watch::Closed(c)) if c.succeeded => closing = true,
                    Ok(Watch::Closed(c)) => {
                        group.stop(spec.grace);
                        return Ok(Outcome::JobFailed(c.root_cause.unwrap_or_default()));
                    }
                    Err(e) => {
                        // The workers do not need the store while they train: let them go on.
                        if store_down_since.is_none() {
                            store_down_since = Some(Instant::now());
                            events(LaunchEvent::StoreUnreachable(e.to_string()));
                        }
                    }
                }
            }
            std::thread::sleep(spec.monitor_interval.max(Duration::from_millis(10)));
        }
    }
}
