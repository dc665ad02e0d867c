//! Joining a round: [`join_step`], for a node that adds itself to the record or announces
//! itself for the round's writer to admit.

use std::collections::BTreeSet;

use super::{Closed, JoinStep, Limits, Node, Phase, State};

/// One step of joining. `state` is the record read (`None`: no rendezvous yet), `alive` the
/// nodes the backend reports alive (`me` among them), `last_call_over` whether this agent's
/// last-call timer for `state`'s round has run out.
///
/// `announced` says how nodes get into a joining round. `None`: each adds itself to the record
/// (a compare-and-set per node, racing the others). `Some(nodes)`: the backend keeps a key per
/// node that wants to join (no race) and the round's writer ([`State::writer`]) merges them,
/// many in one write, and completes the round; `nodes` are those announced for the round, read
/// by the writer only (the others pass an empty list and wait). A round with no live
/// participant yet is taken by whoever writes first.
pub fn join_step(
    state: Option<&State>,
    me: &Node,
    alive: &BTreeSet<String>,
    limits: Limits,
    last_call_over: bool,
    announced: Option<&[Node]>,
) -> JoinStep {
    let Some(state) = state else {
        return JoinStep::Write(
            State {
                participants: vec![me.clone()],
                ..State::default()
            }
            .written(),
        );
    };
    let live = |n: &Node| alive.contains(&n.id);
    match state.phase {
        Phase::Closed { .. } => {
            // A closed record whose nodes are all gone is a finished job's: a new job with the
            // same run id starts over instead of being told it is over. Unless this node was in
            // it: then it is this node's job that ended (the others finished before it looked).
            // Its members are those a reopened round expects too: a node that lost a peer
            // reopens the round, and the peer's node may close it before anyone rejoins.
            if state.members().any(|id| id == me.id || alive.contains(id)) {
                let closed = state.closed().unwrap_or(Closed {
                    succeeded: false,
                    root_cause: None,
                    member: false,
                });
                JoinStep::Closed(Closed {
                    member: state.is_participant(&me.id),
                    ..closed
                })
            } else {
                JoinStep::Write(
                    State {
                        version: state.version,
                        round: state.round.saturating_add(1),
                        participants: vec![me.clone()],
                        reason: Some("a new job with this run id".into()),
                        ..State::default()
                    }
                    .written(),
                )
            }
        }
        Phase::Running => {
            if let Some(a) = state.assignment(&me.id) {
                return JoinStep::Assigned(a);
            }
            if let Some(dead) = state.participants.iter().find(|n| !live(n)) {
                let reason = format!("node {} is gone", dead.id);
                return JoinStep::Write(state.reopened_without(&dead.id, reason, alive));
            }
            if announced.is_some() {
                // Announced for the next round: the round's writer sees it.
                return JoinStep::Wait;
            }
            let mut next = state.clone();
            next.waiting.retain(|n| live(n) && n.id != me.id);
            next.waiting.push(me.clone());
            if next.waiting == state.waiting {
                JoinStep::Wait
            } else {
                JoinStep::Write(next.written())
            }
        }
        Phase::Joining => {
            if let Some(nodes) = announced {
                return join_announced(state, me, alive, limits, last_call_over, nodes);
            }
            let mut next = state.clone();
            next.participants.retain(|n| live(n) || n.id == me.id);
            next.waiting.retain(|n| live(n) && n.id != me.id);
            if !next.is_participant(&me.id) && (next.participants.len() as u32) < limits.max {
                next.participants.push(me.clone());
            }
            if next != *state {
                return JoinStep::Write(next.written());
            }
            if !state.is_participant(&me.id) {
                // The round is full: wait for it to start, then wait for the next.
                return JoinStep::Wait;
            }
            if state.complete_without_last_call(limits, alive)
                || (state.last_call_due(limits) && last_call_over)
            {
                return JoinStep::Write(state.running());
            }
            JoinStep::Wait
        }
    }
}

/// [`join_step`] of a joining round with announcements. The round's writer completes it with
/// every announced node in one write once it is complete; until then nothing is written (the
/// others learn nothing from a half-merged list, and each write is read by every agent). A
/// round with no live participant is taken by whoever writes first.
fn join_announced(
    state: &State,
    me: &Node,
    alive: &BTreeSet<String>,
    limits: Limits,
    last_call_over: bool,
    announced: &[Node],
) -> JoinStep {
    match state.writer(alive) {
        Some(writer) if writer != me.id => JoinStep::Wait,
        Some(_) => {
            let next = state.merged(me, alive, announced, limits);
            if next.complete_without_last_call(limits, alive)
                || (next.last_call_due(limits) && last_call_over)
            {
                JoinStep::Write(next.running())
            } else {
                JoinStep::Wait
            }
        }
        None => {
            let next = state.merged(me, alive, &[], limits);
            if next.is_participant(&me.id) {
                JoinStep::Write(next.written())
            } else {
                JoinStep::Wait
            }
        }
    }
}
