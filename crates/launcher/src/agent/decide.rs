//! What the elastic agent does next, as a pure function of what it saw: [`next`] over one
//! [`Seen`] and the agent's [`Memory`], tested without a worker or a store (like the
//! rendezvous' `state`). The agent's loop (`super::run_rounds`) gathers what it sees, asks
//! here, and carries out the [`Next`] it gets.

use rendezvous::FailureKind;
use signal_hook::consts::SIGTERM;

/// What one turn of the agent's loop saw while this node's workers run in a round, the most
/// pressing first: a stop signal, a worker's word that its group lost a peer, the workers'
/// state, then the rendezvous round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seen {
    /// A stop signal came (SIGINT, SIGTERM, SIGHUP).
    Signal(i32),
    /// A worker left its group because a collective failed (a peer is gone).
    PeerLost,
    /// Every worker exited 0.
    WorkersDone,
    /// A worker failed, hung or did not answer; counted unless it was a consequence of
    /// another node (a lost peer, exit 75) or a save on request (exit 143), unrecoverable when
    /// the program said no retry can fix it (exit 76).
    WorkerFailed { kind: FailureKind },
    /// The ranks found this node a straggler and `--stragglers evict` asks to drop it.
    Straggler,
    /// The round, as the rendezvous saw it; not asked once another node closed the job.
    Round(Round),
}

/// The rendezvous round, as a watch saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Round {
    Healthy,
    /// The round is over (reopened elsewhere); `node_gone` when a node of it has no heartbeat.
    Reopened {
        node_gone: bool,
    },
    /// Another node closed the job; `member`: in this node's round (else the job went on
    /// without this node, which was cut off or stopped, and ended).
    Closed {
        succeeded: bool,
        member: bool,
    },
    /// The store could not be asked.
    Unreachable,
}

/// What the agent carries from turn to turn that bears on what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Memory {
    /// Another node finished the job: this node's workers finish too.
    pub(crate) closing: bool,
    /// Every worker runs and said it regroups in place (`--regroup in-process`).
    pub(crate) can_regroup: bool,
    /// The workers were handed a new round and have not yet said they train in it.
    pub(crate) regrouping: bool,
    /// Regroups in a row whose new group failed before it trained.
    pub(crate) failed_regroups: u32,
    pub(crate) max_restarts: u32,
}

/// What the agent does about what it saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing: look again after the monitor interval.
    Wait,
    /// SIGTERM: ask the rendezvous to let this node go alone (the others go on: in place when
    /// their workers regroup, else restarted at the new size, as torchrun's agents do); when it
    /// refuses, [`Next::Stop`].
    Leave,
    /// Stop the workers (a worker at a step boundary checkpoints for all) and end, interrupted.
    Stop,
    /// This node is a straggler: leave the job as [`Next::Leave`] does, unless the others
    /// cannot go on without it (then train on).
    Evict,
    /// The job succeeded: stop what still runs, count this node finished (closing the job
    /// for the others if it is the first), wait for the others' workers to finish (the exit
    /// barrier), and end.
    Succeed,
    /// Keep the workers running and join the next round; `abort` breaks their links first (a
    /// node of the group is gone: their collectives would wait for the timeout). `failed`:
    /// the regroup under way failed, which counts towards the fallback. `tell`: this node's
    /// workers found the peer lost, so this node reopens the round (uncounted).
    Regroup {
        abort: bool,
        failed: bool,
        tell: bool,
    },
    /// The workers cannot regroup (or too many regroups failed): stop them and start new ones
    /// at the next round. `fallback` when they could have regrouped; `tell` as for
    /// [`Next::Regroup`].
    Restart { fallback: bool, tell: bool },
    /// Record a worker failure with the rendezvous (`kind`: counted against --max-restarts,
    /// or unrecoverable), then restart at the next round, or end when the job gives up.
    RecordFailure { kind: FailureKind },
    /// Another node finished and this one's worker failed: this node's failure ends it.
    FailAlone,
    /// Another node finished the job: this node's workers finish too, and no round follows.
    Closing,
    /// Another node ended the job with a failure.
    JobFailed,
    /// The job ended in a round without this node (it was cut off or stopped meanwhile): its
    /// workers' state is behind the job's, so they leave without saving, and the launch ends
    /// as the job did.
    LeftBehind { succeeded: bool },
    /// The store cannot be asked: the workers go on without it.
    StoreDown,
    /// The store answers again after [`Next::StoreDown`].
    StoreBack,
}

/// What follows `seen`, given `memory`; `store_down` when the last watch could not reach the
/// store.
pub(crate) fn next(seen: &Seen, memory: &Memory, store_down: bool) -> Next {
    match *seen {
        // SIGTERM is what a deleted or evicted pod gets first (`kubectl delete pod`, a drain,
        // a spot interruption, `job scale` down): it asks a node to go, not the job to stop,
        // whether or not its workers can regroup (still starting, or a plain program).
        Seen::Signal(signal) => {
            if signal == SIGTERM && !memory.closing {
                Next::Leave
            } else {
                Next::Stop
            }
        }
        // Another node finished the job: there is no next round to regroup in.
        Seen::PeerLost if memory.closing => Next::Succeed,
        Seen::PeerLost => {
            let failed = memory.regrouping;
            if memory.failed_regroups + failed as u32 > memory.max_restarts {
                Next::Restart {
                    fallback: true,
                    tell: true,
                }
            } else {
                Next::Regroup {
                    abort: false,
                    failed,
                    tell: true,
                }
            }
        }
        // Only a regroup in place drops a node without restarting the others; a change
        // under way, or the job ending, comes first.
        Seen::Straggler if memory.can_regroup && !memory.regrouping && !memory.closing => {
            Next::Evict
        }
        Seen::Straggler => Next::Wait,
        Seen::WorkersDone => Next::Succeed,
        Seen::WorkerFailed { .. } if memory.closing => Next::FailAlone,
        Seen::WorkerFailed { kind } => Next::RecordFailure { kind },
        Seen::Round(Round::Healthy) if store_down => Next::StoreBack,
        Seen::Round(Round::Healthy) => Next::Wait,
        Seen::Round(Round::Reopened { node_gone }) if memory.can_regroup => Next::Regroup {
            abort: node_gone,
            failed: false,
            tell: false,
        },
        Seen::Round(Round::Reopened { .. }) => Next::Restart {
            fallback: false,
            tell: false,
        },
        Seen::Round(Round::Closed {
            succeeded,
            member: false,
        }) => Next::LeftBehind { succeeded },
        Seen::Round(Round::Closed {
            succeeded: true, ..
        }) => Next::Closing,
        Seen::Round(Round::Closed {
            succeeded: false, ..
        }) => Next::JobFailed,
        Seen::Round(Round::Unreachable) if store_down => Next::Wait,
        Seen::Round(Round::Unreachable) => Next::StoreDown,
    }
}

#[cfg(test)]
mod tests;
