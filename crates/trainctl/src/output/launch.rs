//! What `trainctl run` says about its agent's events ([`launcher::LaunchEvent`]): one function
//! per family of events (the rounds a node joins, its regroups and leaves, its warm start, its
//! health and speed, the rendezvous store and the end of the job, its workers), each returning
//! what is said; [`launch_event`] prints it.

use launcher::LaunchEvent;

use super::{duration, err, megabytes, warn};

/// What an event says: a line of `trainctl run`'s, a warning, or nothing on the terminal.
enum Said {
    Line(String),
    Warning(String),
    Quiet,
}

use Said::{Line, Quiet, Warning};

pub(crate) fn launch_event(event: LaunchEvent) {
    use LaunchEvent::*;
    let said = match event {
        e @ (Joining { .. }
        | StillJoining(_)
        | Joined(_)
        | Reopened { .. }
        | NeverJoined { .. }
        | JobAlreadyOver) => rounds(e),
        e @ (Regrouping { .. }
        | Regrouped(_)
        | Leaving { .. }
        | LeaveRefused { .. }
        | Withdrawing { .. }
        | WithdrawRefused { .. }
        | RegroupFallback { .. }
        | LeftBehind { .. }) => regroups(e),
        e @ (Warming | WarmingWhileWaiting | Warm { .. } | WarmStartFailed(_)) => warm_start(e),
        e @ (HealthChecked { .. } | Straggler { .. } | EvictRefused { .. }) => health(e),
        e @ (StoreUnreachable(_)
        | StoreLost { .. }
        | StoreLostRegrouping { .. }
        | StoreBack
        | KeepingStore { .. }
        | AwaitingOthers { .. }
        | OthersUnfinished { .. }) => store_and_end(e),
        e @ (Started(_) | Restarting { .. }) => workers(e),
    };
    match said {
        Line(text) => err(format_args!("trainctl run: {text}")),
        Warning(text) => warn(&text),
        Quiet => {}
    }
}

/// Joining a round: waiting, joined, reopened, never joined.
fn rounds(event: LaunchEvent) -> Said {
    match event {
        LaunchEvent::Joining { node } => {
            tracing::info!(node, "joining the rendezvous");
            Quiet
        }
        LaunchEvent::StillJoining(w) if w.spare => Line(format!(
            "a spare: the job trains at its --nnodes maximum ({} nodes) without this node, which waits, its workers warm, to take the place of a node that goes",
            w.joined
        )),
        LaunchEvent::StillJoining(w) if w.running_without => Line(format!(
            "the job trains at round {} without this node yet: it is admitted at a later round (nodes arriving one by one are admitted in batches)",
            w.round
        )),
        LaunchEvent::StillJoining(w) => Line(format!(
            "still joining round {} after {}: {}; giving up in {} (join_timeout in --rdzv-conf)",
            w.round,
            duration(w.waited.as_secs_f64()),
            match &w.store_error {
                Some(e) => format!("the rendezvous store does not answer ({e})"),
                None => format!(
                    "{} of at least {} node(s) here; the others must run with the same --rdzv-endpoint and --rdzv-id",
                    w.joined, w.min
                ),
            },
            duration(w.left.as_secs_f64())
        )),
        LaunchEvent::Joined(a) => Line(format!(
            "round {}: node rank {} of {}, first rank {}, world size {}, restart count {}, store at {}:{}",
            a.round,
            a.node_rank,
            a.nnodes,
            a.rank_offset,
            a.world_size,
            a.restart_count,
            a.master_addr,
            a.master_port
        )),
        LaunchEvent::Reopened { reason } => Line(format!(
            "new rendezvous round: {reason}; restarting the workers"
        )),
        LaunchEvent::NeverJoined { reason, nodes } => Line(format!(
            "{reason} before it joined: the round forms without it ({nodes} other node(s))"
        )),
        LaunchEvent::JobAlreadyOver => {
            Line("this run id's job has already finished; nothing to do".into())
        }
        _ => Quiet, // another family's, matched in launch_event
    }
}

/// Regrouping in place, and a node leaving or withdrawing from a job that goes on.
fn regroups(event: LaunchEvent) -> Said {
    match event {
        LaunchEvent::Regrouping { reason } => Line(format!(
            "{reason}; the workers keep running and regroup at the next round"
        )),
        // A warm worker's first group: it had no world before.
        LaunchEvent::Regrouped(r) if r.worker.world_size_before == 0 => Line(format!(
            "joined in place, its workers started warm: world size {}, from step {}, {} received, {:.2} s from the assignment. Cause: {}",
            r.worker.world_size,
            r.worker.step,
            megabytes(r.worker.bytes),
            r.worker.seconds,
            r.reason,
        )),
        LaunchEvent::Regrouped(r) => Line(format!(
            "regrouped in place: world size {} → {}, from step {}, {} steps dropped, {} streamed, paused {:.2} s; no worker restarted. Cause: {}",
            r.worker.world_size_before,
            r.worker.world_size,
            r.worker.step,
            r.worker.steps_dropped,
            megabytes(r.worker.bytes),
            r.worker.seconds,
            r.reason,
        )),
        LaunchEvent::Leaving {
            reason,
            nodes,
            world_size,
        } => Line(format!(
            "{reason}: the others go on at world size {world_size} ({nodes} node(s)); this node's workers leave after the step under way"
        )),
        LaunchEvent::LeaveRefused { node, signal, why } => Warning(format!(
            "node {node} was asked to go (signal {signal}) but cannot leave alone: {why}; stopping the whole job, which checkpoints once"
        )),
        LaunchEvent::Withdrawing { reason, nodes } => Line(format!(
            "{reason} while the job regroups: the next round forms without it ({nodes} other node(s), which hold the same state); this node's workers leave without saving"
        )),
        LaunchEvent::WithdrawRefused { node, signal, why } => Warning(format!(
            "node {node} was asked to go (signal {signal}) while the job regroups but cannot leave alone: {why}; its workers stop, saving a checkpoint if one of them was rank 0"
        )),
        LaunchEvent::RegroupFallback { failed } => Warning(format!(
            "{failed} regroups in a row failed (more than --max-restarts): restarting this node's workers instead, as --regroup restart does"
        )),
        LaunchEvent::LeftBehind {
            succeeded,
            warm: true,
        } => Line(format!(
            "the job {} before this node had a place in it; its warm workers leave",
            if succeeded { "finished" } else { "failed" }
        )),
        LaunchEvent::LeftBehind { succeeded, .. } => Warning(format!(
            "the job {} in a round without this node (it was cut off or stopped meanwhile); this \
             node's workers leave without saving: their state is behind the job's",
            if succeeded { "finished" } else { "failed" }
        )),
        _ => Quiet, // another family's, matched in launch_event
    }
}

/// A joining node starting its workers before it has a place.
fn warm_start(event: LaunchEvent) -> Said {
    match event {
        LaunchEvent::Warming => Line(
            "the job is under way and regroups in place: this node starts its workers warm, and asks for a place once they are ready".into(),
        ),
        LaunchEvent::WarmingWhileWaiting => Line(
            "the job now says its workers regroup in place: this node, waiting for a place, starts its workers warm, so that it takes one without their start".into(),
        ),
        LaunchEvent::Warm { seconds } => Line(format!(
            "its workers are ready after {seconds:.1} s (their start)"
        )),
        LaunchEvent::WarmStartFailed(why) => {
            Warning(format!("the warm start did not work: {why}"))
        }
        _ => Quiet, // another family's, matched in launch_event
    }
}

/// The node's health check before it joins, and its speed against the others'.
fn health(event: LaunchEvent) -> Said {
    match event {
        LaunchEvent::HealthChecked {
            health,
            against,
            far_below,
        } => match (against, far_below) {
            (Some(figures), true) => Warning(format!(
                "this node's health check is far below the other nodes': {figures}"
            )),
            (Some(figures), false) => Line(format!("health check passed: {figures}")),
            (None, _) => Line(format!(
                "health check: matrix multiply {:.1} GFLOP/s, loopback {} MB/s (no other node has measured yet)",
                health.gemm_mflops as f64 / 1e3,
                health.loopback_mbps
            )),
        },
        LaunchEvent::Straggler { slow: true, report } => {
            Warning(format!("the ranks found this node slow: {report}"))
        }
        LaunchEvent::Straggler {
            slow: false,
            report,
        } => Line(format!("this node is no longer a straggler: {report}")),
        LaunchEvent::EvictRefused { report, why } => {
            Warning(format!("this node is slow ({report}) but stays: {why}"))
        }
        _ => Quiet, // another family's, matched in launch_event
    }
}

/// The rendezvous store lost and back, and the end of the job (the exit barrier, the store
/// kept up for nodes cut off).
fn store_and_end(event: LaunchEvent) -> Said {
    match event {
        LaunchEvent::StoreUnreachable(e) => Warning(format!(
            "rendezvous store unreachable ({e}); the workers go on, membership changes wait for it"
        )),
        LaunchEvent::StoreLost {
            error,
            failure,
            wait,
        } => Warning(format!(
            "rendezvous store lost ({error}) after rank {} (pid {}) stopped with {}: \
             the node that hosted the store is probably gone; waiting up to {} s for a store at \
             the same endpoint (its replacement starts a fresh one), then the workers start again \
             from the last checkpoint",
            failure.rank,
            failure.pid,
            failure.exit,
            wait.as_secs()
        )),
        LaunchEvent::StoreLostRegrouping { error, wait } => Warning(format!(
            "rendezvous store lost ({error}): the node that hosted the store is probably gone; \
             waiting up to {} s for a store at the same endpoint (its replacement starts a fresh \
             one); the workers keep running and regroup then",
            wait.as_secs()
        )),
        LaunchEvent::StoreBack => Line("rendezvous store reachable again".into()),
        LaunchEvent::KeepingStore { nodes, up_to } => Line(format!(
            "the job is over; keeping the rendezvous store up to {} more for {}, \
             lost during the job without leaving: a node only cut off learns how the job ended",
            duration(up_to.as_secs_f64()),
            nodes.join(", ")
        )),
        LaunchEvent::AwaitingOthers { nodes, waited } => Line(format!(
            "this node's workers finished; waiting {} so far for {} to finish too \
             before exiting (exit_barrier_timeout in --rdzv-conf)",
            duration(waited.as_secs_f64()),
            nodes.join(", ")
        )),
        LaunchEvent::OthersUnfinished { nodes, waited } => Warning(format!(
            "{} had not finished after {} (exit_barrier_timeout in --rdzv-conf); this node exits \
             anyway, its own work done",
            nodes.join(", "),
            duration(waited.as_secs_f64())
        )),
        _ => Quiet, // another family's, matched in launch_event
    }
}

/// Workers started and restarted.
fn workers(event: LaunchEvent) -> Said {
    match event {
        LaunchEvent::Started(w) if w.warm => Line(format!(
            "started local rank {} warm (pid {}): no place in the job yet",
            w.local_rank, w.pid
        )),
        LaunchEvent::Started(w) => Line(format!("started rank {} (pid {})", w.rank, w.pid)),
        LaunchEvent::Restarting {
            failure,
            restart_count,
        } if failure.exit == launcher::ExitKind::Code(contract::exit::PEER_LOST) => Line(format!(
            "rank {} (pid {}) lost a peer (exit code {}); restarting all workers (not counted as a failure: restart count stays {restart_count})",
            failure.rank,
            failure.pid,
            contract::exit::PEER_LOST
        )),
        LaunchEvent::Restarting {
            failure,
            restart_count,
        } => Line(format!(
            "{}; restarting all workers (restart {restart_count})",
            failure.summary()
        )),
        _ => Quiet, // another family's, matched in launch_event
    }
}
