//! The worker's side of the elastic protocol, as pure decisions: what a worker that can regroup
//! in place raises at a step, what it does once every rank agreed the step, when a collective
//! fails, when a group's start fails, while it waits for the next round (and who saves if a
//! stop comes then), and when a checkpoint is due. No other place decides these.
//!
//! Both workers that speak the protocol follow these tables: the built-in trainer
//! (`trainer::train`) calls them, and the Python package (`python/trainctl/regroup.py`)
//! carries the same functions. Their cases are data, `vectors/regroup.json` at the
//! repository's root, which this crate's tests check for both languages (the Python side
//! under a plain `python3`), so a change one side does not follow fails CI.
//!
//! The messages that feed the tables are the control channel's ([`crate::control`]): an
//! assignment (the next round, [`ToWorker::Assign`](crate::control::ToWorker::Assign)) makes
//! the worker raise `pause`; its node asked to go ([`ToWorker::Leave`]
//! (crate::control::ToWorker::Leave)), `leave`; a SIGTERM, `stop`. A step's flags are summed
//! over the ranks with the step's own all-reduce, so every rank decides the same.
//!
//! Invariants the tables keep (and `vectors/regroup.json` shows case by case):
//! - every rank ends a step in the same decision (its inputs are the agreed flags, plus
//!   whether its own node leaves, which only splits `Leave` from `Regroup`);
//! - a stop wins over a pause, a pause over a scheduled checkpoint;
//! - exactly one rank saves on a stop at a step, or after a pause: rank 0, or, when rank 0's
//!   node leaves, the lowest rank that stays (its ranks consecutive); after a lost peer, which
//!   may be rank 0, every survivor writes if its step is newer than the file's, so the
//!   checkpoint ends holding the furthest state, written whole once per step;
//! - a state a stream cut off half-way is never saved;
//! - a checkpoint is due at every multiple of `--checkpoint-every` global steps, wherever the
//!   run resumed or regrouped;
//! - a worker waiting for a round leaves before it joins, and joins before it stops (a stop
//!   that came with an assignment rides the new group's first step).

use serde::{Deserialize, Serialize};

/// What one rank raises at a step; each is raised for all when any rank raises it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Raised {
    /// Stop after this step (SIGTERM).
    pub stop: bool,
    /// Leave the group after this step: the agent handed the next round, or this rank's node
    /// goes (the others regroup without it).
    pub pause: bool,
    /// This rank's node is asked to go: it leaves the job after this step.
    pub leave: bool,
    /// As `leave`, from rank 0 (the others then choose another saver).
    pub rank0_leaves: bool,
}

/// The flags rank `rank` raises, from what it knows before the step: a stop asked for, the
/// next round handed (`assigned`), its node asked to go (`leaving`).
pub fn raised(stop: bool, assigned: bool, leaving: bool, rank: u32) -> Raised {
    Raised {
        stop,
        pause: assigned || leaving,
        leave: leaving,
        rank0_leaves: leaving && rank == 0,
    }
}

/// A step's flags summed over the ranks (each count is how many ranks raised it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Agreed {
    pub stop: u32,
    pub pause: u32,
    pub leave: u32,
    pub rank0_leaves: u32,
}

/// What a worker does after a step every rank agreed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "do", rename_all = "snake_case")]
pub enum AfterStep {
    /// The next step.
    Continue,
    /// A checkpoint that was due (rank 0 writes it), then the next step.
    Checkpoint,
    /// Every rank stops: `saver` checkpoints, all wait for it, all exit.
    Stop { saver: u32 },
    /// This rank's node goes: it leaves the job holding the step every rank paused at (the
    /// others hold it too: nothing is saved).
    Leave,
    /// Every other rank leaves its group and waits for the next round; `saver` checkpoints
    /// should a stop come while it waits.
    Regroup { saver: u32 },
}

/// After a step whose flags summed to `agreed`: `me_leaving` is whether this rank's own node
/// goes, `checkpoint_due` whether the worker's schedule wants a checkpoint here.
pub fn after_step(agreed: Agreed, me_leaving: bool, checkpoint_due: bool) -> AfterStep {
    if agreed.stop > 0 {
        // Every rank stops at this step, rank 0 among them, whoever leaves.
        return AfterStep::Stop { saver: 0 };
    }
    if agreed.pause > 0 {
        if me_leaving {
            return AfterStep::Leave;
        }
        return AfterStep::Regroup {
            saver: saver(agreed),
        };
    }
    if checkpoint_due {
        return AfterStep::Checkpoint;
    }
    AfterStep::Continue
}

/// The rank that saves for the others: rank 0, or the lowest that stays when rank 0's node
/// leaves (its ranks, consecutive from 0, are `agreed.leave`).
fn saver(agreed: Agreed) -> u32 {
    if agreed.rank0_leaves > 0 {
        agreed.leave
    } else {
        0
    }
}

/// How a collective of the group failed, as the worker itself knows it (never from an error's
/// wording).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// A link to a peer closed or was broken (by the worker's own abort, on the agent's word).
    PeerLost,
    /// The collective ran past the group's timeout: a peer is silent (stopped, cut off).
    TimedOut,
    /// Anything else (the worker's own error): not the group's.
    Other,
}

impl Failure {
    /// How `e` involves the group, by its kind: a link closed, reset or refused (a peer gone,
    /// or one of an overtaken round) is [`Failure::PeerLost`]; a wait past the group's timeout
    /// (a collective, a connect, a handshake), [`Failure::TimedOut`]; anything else (a port
    /// this worker cannot bind, a malformed frame, collectives out of step) is the worker's
    /// own, [`Failure::Other`].
    pub fn of(e: &crate::CollectiveError) -> Failure {
        use crate::CollectiveError as E;
        use crate::wire::WireError as W;
        use std::io::ErrorKind as K;
        let io = |e: &std::io::Error| match e.kind() {
            K::TimedOut | K::WouldBlock => Failure::TimedOut,
            K::ConnectionReset
            | K::ConnectionAborted
            | K::ConnectionRefused
            | K::BrokenPipe
            | K::UnexpectedEof => Failure::PeerLost,
            _ => Failure::Other,
        };
        match e {
            E::PeerLost(_) | E::Refused(_) | E::Wire(W::Truncated) => Failure::PeerLost,
            E::Timeout { .. } | E::Connect { .. } => Failure::TimedOut,
            E::Io(e) | E::Wire(W::Io(e)) => io(e),
            E::Bind { .. } | E::Desync(_) | E::Wire(_) => Failure::Other,
        }
    }
}

/// What a worker does when a collective of its step fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "do", rename_all = "snake_case")]
pub enum AfterFailure {
    /// The step is dropped (nothing was applied) and the worker waits for the next round.
    Regroup,
    /// The worker fails; `save` when rank 0 first saves the last step every rank completed,
    /// so that the restart resumes there rather than at the last scheduled checkpoint.
    Fail { save: bool },
}

/// A collective of the step failed (`failure`): `agent` is whether an agent regroups this
/// worker (`trainctl run` with a control channel), `rank` the worker's.
pub fn after_failure(failure: Failure, agent: bool, rank: u32) -> AfterFailure {
    match failure {
        Failure::PeerLost | Failure::TimedOut if agent => AfterFailure::Regroup,
        Failure::PeerLost => AfterFailure::Fail { save: rank == 0 },
        Failure::TimedOut | Failure::Other => AfterFailure::Fail { save: false },
    }
}

/// What a worker waiting for its next round does, as of the messages read so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Waiting {
    /// Its node goes: it leaves the job (nothing saved: the others hold its state).
    Leave,
    /// Join the round it was handed.
    Join,
    /// Stop (SIGTERM) with no round in hand: the saver checkpoints.
    Stop,
    /// Wait for the next message.
    Wait,
}

/// While waiting for a round: `leaving` (its node asked to go), `assigned` (a round handed),
/// `stop` (SIGTERM).
pub fn waiting(leaving: bool, assigned: bool, stop: bool) -> Waiting {
    if leaving {
        Waiting::Leave
    } else if assigned {
        Waiting::Join
    } else if stop {
        Waiting::Stop
    } else {
        Waiting::Wait
    }
}

/// Whether a worker saves the checkpoint when a stop (SIGTERM) comes while it waits for a
/// round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Save {
    Yes,
    No,
    /// Only when the checkpoint holds an earlier step: several ranks may each hold the job's
    /// state and none knows it is the lowest one left, so each writes (under a lock), and the
    /// furthest wins.
    IfNewer,
}

/// A worker waits for the next round and a stop comes: `lost` after a lost peer or a failed
/// group start (else after a pause), `saver` whether the pause's agreement named it
/// ([`after_step`]), `live` whether its state is one it trained or took whole (not what a
/// stream cut off half-way left). After a lost peer the saver is unknown: the lost rank may
/// be rank 0, and no survivor knows whether it is the lowest one left, so every survivor
/// saves if its step is newer than the checkpoint's.
pub fn saver_while_waiting(lost: bool, saver: bool, live: bool) -> Save {
    if !live {
        Save::No
    } else if lost {
        Save::IfNewer
    } else if saver {
        Save::Yes
    } else {
        Save::No
    }
}

/// What a worker does when a group's start fails (the first, a warm one, or a round's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterStartFailure {
    /// The group failed (a peer lost or silent): wait for the next round.
    Regroup,
    /// Its own error, or no agent to hand it a round: the worker fails.
    Fail,
}

/// A group's start failed (`failure`); `agent` is whether an agent regroups this worker.
pub fn after_start_failure(failure: Failure, agent: bool) -> AfterStartFailure {
    match failure {
        Failure::PeerLost | Failure::TimedOut if agent => AfterStartFailure::Regroup,
        _ => AfterStartFailure::Fail,
    }
}

/// Whether the step just applied (global step `global_step`) checkpoints on schedule: every
/// `every` global steps (0: never), counted from the run's start, so that a regroup or a
/// resume never moves the schedule; not at the epoch's last step, whose end checkpoints
/// anyway.
pub fn checkpoint_due(global_step: u64, every: u64, epoch_ends: bool) -> bool {
    every > 0 && global_step.is_multiple_of(every) && !epoch_ends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_wins_over_a_pause_and_a_pause_over_a_checkpoint() {
        let all = Agreed {
            stop: 1,
            pause: 2,
            leave: 1,
            rank0_leaves: 1,
        };
        assert_eq!(after_step(all, true, true), AfterStep::Stop { saver: 0 });
        let pause = Agreed { stop: 0, ..all };
        assert_eq!(
            after_step(pause, false, true),
            AfterStep::Regroup { saver: 1 }
        );
        assert_eq!(after_step(pause, true, true), AfterStep::Leave);
        assert_eq!(
            after_step(Agreed::default(), false, true),
            AfterStep::Checkpoint
        );
        assert_eq!(
            after_step(Agreed::default(), false, false),
            AfterStep::Continue
        );
    }
}
