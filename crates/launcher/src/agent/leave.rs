//! A node's workers leaving: after the step under way, or without saving.

use std::time::{Duration, Instant};

use rendezvous::Rendezvous;

use crate::LaunchSpec;
use crate::supervise::Group;

/// This node leaves, the rendezvous already told: its workers leave after the step under way
/// and exit (stopped if they do not), then its store, if it hosts it, stays until the others
/// have formed their round. One budget for both waits: the pod's grace period bounds them
/// together. Workers that cannot leave at a step (still starting, a program without
/// `trainctl.torch`) are stopped as a stop signal stops them; the others restart theirs at the
/// new size. Returns [`Group::wait_exited`]'s word on how the workers ended.
pub(super) fn let_workers_go(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    group: Group,
) -> Option<bool> {
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
pub(super) fn leave_unsaved(mut group: Group, wait: Duration, grace: Duration) -> Option<bool> {
    group.leave();
    let finished = group.wait_exited(wait);
    group.stop(grace);
    finished
}

/// How long a leaving node may take to see its workers reach the end of their step and, when
/// it hosts the c10d store, the others form their next round: well inside Kubernetes' default
/// grace period of 30 s, after which the pod is killed.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(20);

pub(super) fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_string())
}
