use super::*;
use proptest::prelude::*;

fn node(id: &str) -> Node {
    Node {
        id: id.into(),
        addr: format!("{id}.example"),
        port: 1000,
        nproc: 2,
        health: None,
    }
}

fn alive(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

const LIMITS: Limits = Limits { min: 2, max: 3 };

/// A watch with no clock running and no window: what the state alone decides.
const NOW: Watching<'static> = Watching {
    hold_admissions: false,
    announced: &[],
    running_for: Duration::ZERO,
    waiting_for: Duration::ZERO,
    gone_for: Duration::ZERO,
    window: Duration::ZERO,
    take_over: Duration::ZERO,
};

/// Plays `join_step` for `id` against `state` until it waits or is assigned.
fn join(state: &mut Option<State>, id: &str, live: &BTreeSet<String>, last_call: bool) -> JoinStep {
    for _ in 0..10 {
        match join_step(state.as_ref(), &node(id), live, LIMITS, last_call, None) {
            JoinStep::Write(next) => *state = Some(next),
            other => return other,
        }
    }
    panic!("join_step for {id} kept writing");
}

fn assigned(step: JoinStep) -> Assignment {
    match step {
        JoinStep::Assigned(a) => a,
        other => panic!("expected an assignment, got {other:?}"),
    }
}

#[test]
fn a_round_completes_at_min_after_the_last_call_and_ranks_follow_join_order() {
    let live = alive(&["a", "b"]);
    let mut state = None;
    assert_eq!(join(&mut state, "a", &live, false), JoinStep::Wait);
    assert_eq!(
        join(&mut state, "b", &live, false),
        JoinStep::Wait,
        "at MIN the last call starts, it does not end"
    );
    let b = assigned(join(&mut state, "b", &live, true));
    let a = assigned(join(&mut state, "a", &live, false));
    assert_eq!((a.node_rank, a.rank_offset), (0, 0));
    assert_eq!((b.node_rank, b.rank_offset), (1, 2));
    assert_eq!((a.nnodes, a.world_size), (2, 4));
    assert_eq!(b.master_addr, "a.example");
}

#[test]
fn a_full_round_completes_at_once_and_late_nodes_wait() {
    let live = alive(&["a", "b", "c", "d"]);
    let mut state = None;
    join(&mut state, "a", &live, false);
    join(&mut state, "b", &live, false);
    let c = assigned(join(&mut state, "c", &live, false));
    assert_eq!(c.nnodes, 3);
    assert_eq!(join(&mut state, "d", &live, true), JoinStep::Wait);
    let s = state.as_ref().unwrap();
    assert_eq!(s.waiting.len(), 1, "d waits for the next round");
    assert_eq!(
        watch_step(Some(s), "a", s.round, &live, LIMITS, &NOW),
        WatchStep::Healthy,
        "a full job does not restart for a spare node"
    );
}

fn running(ids: &[&str]) -> Option<State> {
    let live = alive(ids);
    let mut state = None;
    for id in ids {
        join(&mut state, id, &live, false);
    }
    let last = ids[ids.len() - 1];
    assigned(join(&mut state, last, &live, true));
    state
}

#[test]
fn a_new_node_reopens_the_round_and_the_next_one_completes_without_a_last_call() {
    let mut state = running(&["a", "b"]);
    let live = alive(&["a", "b", "c"]);
    assert_eq!(join(&mut state, "c", &live, false), JoinStep::Wait);
    let round = state.as_ref().unwrap().round;
    let WatchStep::Reopen(next, reason) =
        watch_step(state.as_ref(), "a", round, &live, LIMITS, &NOW)
    else {
        panic!("a waiting node must reopen the round");
    };
    assert!(reason.contains("c waiting"), "{reason}");
    state = Some(next);
    assert!(matches!(
        watch_step(state.as_ref(), "b", round, &live, LIMITS, &NOW),
        WatchStep::Restart(_)
    ));
    join(&mut state, "c", &live, false);
    join(&mut state, "a", &live, false);
    let b = assigned(join(&mut state, "b", &live, false));
    assert_eq!((b.nnodes, b.round), (3, round + 1));
    assert_eq!(b.restart_count, 0, "a membership change is not a failure");
    // The newcomer joined the round first, and still comes after the nodes it joins.
    let ranks: Vec<u32> = ["a", "b", "c"]
        .iter()
        .map(|id| assigned(join(&mut state, id, &live, false)).node_rank)
        .collect();
    assert_eq!(ranks, [0, 1, 2]);
}

#[test]
fn a_lost_node_reopens_the_round_and_the_survivors_go_on_at_once() {
    let mut state = running(&["a", "b", "c"]);
    let round = state.as_ref().unwrap().round;
    let live = alive(&["a", "c"]);
    let WatchStep::Reopen(next, reason) =
        watch_step(state.as_ref(), "c", round, &live, LIMITS, &NOW)
    else {
        panic!("a lost node must reopen the round");
    };
    assert!(reason.contains("node b is gone"), "{reason}");
    state = Some(next);
    join(&mut state, "c", &live, false);
    let a = assigned(join(&mut state, "a", &live, false));
    let c = assigned(join(&mut state, "c", &live, false));
    assert_eq!(
        (a.nnodes, a.node_rank, c.node_rank),
        (2, 0, 1),
        "c joined first this time, and the survivors keep their order"
    );
}

/// A node cut off (no heartbeat) is lapsed, not left: the closed job's store waits for it
/// a while; once back it is told the job is over and that it was not in the round that
/// closed it (its workers' state is behind, theirs not to save).
#[test]
fn a_node_cut_off_is_lapsed_and_learns_it_was_not_in_the_round_that_closed_the_job() {
    let mut state = running(&["a", "b", "c"]);
    let round = state.as_ref().unwrap().round;
    let live = alive(&["a", "b"]);
    let WatchStep::Reopen(next, _) = watch_step(state.as_ref(), "a", round, &live, LIMITS, &NOW)
    else {
        panic!("a lost node must reopen the round");
    };
    assert_eq!(next.lapsed, vec!["c".to_string()]);
    state = Some(next);
    join(&mut state, "b", &live, false);
    assigned(join(&mut state, "a", &live, false));
    let survivors = assigned(join(&mut state, "b", &live, false));
    assert_eq!(survivors.nnodes, 2);
    state = finish_step(state.as_ref(), "a");
    state = finish_step(state.as_ref(), "b");
    let closed = state.as_ref().unwrap();
    assert_eq!(closed.lapsed_unfinished(), vec!["c".to_string()]);
    let back = alive(&["a", "b", "c"]);
    let member =
        |id: &str, round: u64| match watch_step(Some(closed), id, round, &back, LIMITS, &NOW) {
            WatchStep::Closed(c) => c.member,
            other => panic!("a closed job must be told: {other:?}"),
        };
    assert!(member("a", survivors.round), "a closed it");
    assert!(!member("c", round), "c was cut off in the round before");
    match join_step(Some(closed), &node("c"), &back, LIMITS, false, None) {
        JoinStep::Closed(c) => assert!(c.succeeded && !c.member, "{c:?}"),
        other => panic!("c rejoining must be told the job is over: {other:?}"),
    }
    // Back after every other node of the job has gone (etcd keeps the record): still told,
    // not handed a new job of the same run id that its workers would resume.
    match join_step(
        Some(closed),
        &node("c"),
        &alive(&["c"]),
        LIMITS,
        false,
        None,
    ) {
        JoinStep::Closed(c) => assert!(c.succeeded && !c.member, "{c:?}"),
        other => panic!("c back alone must be told the job is over: {other:?}"),
    }
    // A node that left by asking is not lapsed: nobody waits for it.
    let state = running(&["a", "b", "c"]);
    let round = state.as_ref().unwrap().round;
    let all = alive(&["a", "b", "c"]);
    let LeaveStep::Write { next, .. } =
        leave_step(state.as_ref(), "c", round, &all, LIMITS, "told to go")
    else {
        panic!("c may leave");
    };
    assert!(next.lapsed.is_empty());
}

#[test]
fn below_min_the_survivor_waits() {
    let mut state = running(&["a", "b"]);
    let live = alive(&["a"]);
    let round = state.as_ref().unwrap().round;
    let WatchStep::Reopen(next, _) = watch_step(state.as_ref(), "a", round, &live, LIMITS, &NOW)
    else {
        panic!("reopen expected");
    };
    state = Some(next);
    assert_eq!(join(&mut state, "a", &live, true), JoinStep::Wait);
}

#[test]
fn failures_count_once_per_round_and_the_first_is_the_root_cause() {
    let state = running(&["a", "b"]);
    let live = alive(&["a", "b"]);
    let round = state.as_ref().unwrap().round;
    let AfterFailure::Restart(Some(s1)) = fail_step(
        state.as_ref(),
        round,
        FailureKind::Counted,
        "rank 1 died",
        1_000,
        1,
        &live,
    ) else {
        panic!("first failure restarts");
    };
    assert_eq!(s1.failures, 1);
    let AfterFailure::Restart(s2) = fail_step(
        Some(&s1),
        round,
        FailureKind::Counted,
        "rank 3 died",
        2_000,
        1,
        &live,
    ) else {
        panic!("second report of the same round restarts too");
    };
    let s2 = s2.unwrap_or(s1);
    assert_eq!(s2.failures, 1, "one failure per round");
    assert_eq!(s2.root_cause.as_deref(), Some("rank 1 died"));
    // A peer that vanished is not counted.
    let AfterFailure::Restart(s3) = fail_step(
        Some(&s2),
        round + 1,
        FailureKind::Uncounted,
        "peer lost",
        3_000,
        1,
        &live,
    ) else {
        panic!("restart");
    };
    let s3 = s3.unwrap_or(s2);
    assert_eq!(s3.failures, 1);
    // The next counted one exceeds --max-restarts 1: the job is over, with the first cause.
    let AfterFailure::GiveUp(Some(s4), closed) = fail_step(
        Some(&s3),
        round + 2,
        FailureKind::Counted,
        "rank 0 died",
        4_000,
        1,
        &live,
    ) else {
        panic!("exceeding max restarts ends the job");
    };
    assert_eq!(closed.root_cause.as_deref(), Some("rank 1 died"));
    assert!(!closed.succeeded);
    assert!(matches!(
        watch_step(Some(&s4), "b", round + 2, &live, LIMITS, &NOW),
        WatchStep::Closed(_)
    ));
}

#[test]
fn a_failure_reported_later_that_happened_earlier_is_the_root_cause() {
    // Node b's worker raised first, but node a's agent (whose worker died of it) wrote first.
    let state = running(&["a", "b"]);
    let live = alive(&["a", "b"]);
    let round = state.as_ref().unwrap().round;
    let AfterFailure::Restart(Some(s1)) = fail_step(
        state.as_ref(),
        round,
        FailureKind::Counted,
        "on a: gloo lost its peer",
        5_400,
        1,
        &live,
    ) else {
        panic!("first report restarts");
    };
    let AfterFailure::Restart(s2) = fail_step(
        Some(&s1),
        round,
        FailureKind::Counted,
        "on b: ValueError",
        5_000,
        1,
        &live,
    ) else {
        panic!("second report restarts");
    };
    let s2 = s2.expect("the earlier failure is written");
    assert_eq!(s2.root_cause.as_deref(), Some("on b: ValueError"));
    assert_eq!(s2.root_cause_at, Some(5_000));
    assert_eq!(s2.failures, 1, "still one failure for the round");
    // A record from before root_cause_at existed keeps its cause.
    let old = State {
        root_cause_at: None,
        ..s1.clone()
    };
    let AfterFailure::Restart(s3) = fail_step(
        Some(&old),
        round,
        FailureKind::Counted,
        "later",
        1,
        1,
        &live,
    ) else {
        panic!("restart");
    };
    assert_eq!(
        s3.unwrap_or(old).root_cause.as_deref(),
        Some("on a: gloo lost its peer")
    );
}

#[test]
fn a_closed_job_is_final_while_its_nodes_live_and_forgotten_once_they_are_gone() {
    let state = running(&["a", "b"]);
    let closed = close_step(state.as_ref(), true, None).unwrap();
    assert_eq!(
        close_step(Some(&closed), false, None),
        None,
        "closing twice is a no-op"
    );
    let late = join_step(
        Some(&closed),
        &node("c"),
        &alive(&["b", "c"]),
        LIMITS,
        false,
        None,
    );
    assert!(matches!(
        late,
        JoinStep::Closed(Closed {
            succeeded: true,
            ..
        })
    ));
    // Everyone of that job is gone: the run id starts a new job, not an error.
    let JoinStep::Write(fresh) = join_step(
        Some(&closed),
        &node("c"),
        &alive(&["c"]),
        LIMITS,
        false,
        None,
    ) else {
        panic!("a stale closed record must not block a new job");
    };
    assert_eq!(fresh.phase, Phase::Joining);
    assert_eq!(fresh.participants, vec![node("c")]);
    assert!(fresh.version > closed.version && fresh.round > closed.round);
}

#[test]
fn a_node_that_was_in_the_closed_job_is_told_it_is_over_even_when_the_others_left() {
    let state = running(&["a", "b"]);
    let closed = close_step(state.as_ref(), true, None).unwrap();
    let step = join_step(
        Some(&closed),
        &node("a"),
        &alive(&["a"]),
        LIMITS,
        false,
        None,
    );
    assert!(
        matches!(
            step,
            JoinStep::Closed(Closed {
                succeeded: true,
                ..
            })
        ),
        "{step:?}"
    );
}

/// The race CI met: b's worker lost its peer and b reopened the round; then a's worker failure
/// exceeded --max-restarts and a closed the reopened round, which lists no participants yet.
/// b, joining the next round, is told the job is over, even once a has left; it must not start
/// a new job alone and wait for a second node that never comes.
#[test]
fn an_unrecoverable_failure_closes_the_job_at_once_with_its_cause() {
    let state = running(&["a", "b"]);
    let live = alive(&["a", "b"]);
    let round = state.as_ref().unwrap().round;
    // A program's own exception, retried (one of three restarts).
    let AfterFailure::Restart(Some(retried)) = fail_step(
        state.as_ref(),
        round,
        FailureKind::Counted,
        "on a: ValueError",
        1_000,
        3,
        &live,
    ) else {
        panic!("a counted failure within --max-restarts restarts");
    };
    // Two rounds later the safety net finds the ranks parted: no restart is left untried, the
    // job is over now, and this is why, not the failure the job already came back from.
    let AfterFailure::GiveUp(Some(closed), ended) = fail_step(
        Some(&retried),
        round + 2,
        FailureKind::Unrecoverable,
        "on b: DivergedError: the ranks no longer hold the same training state",
        9_000,
        3,
        &live,
    ) else {
        panic!("an unrecoverable failure closes the job whatever --max-restarts allows");
    };
    assert_eq!(closed.phase, Phase::Closed { succeeded: false });
    assert!(!ended.succeeded);
    assert_eq!(
        ended.root_cause.as_deref(),
        Some("on b: DivergedError: the ranks no longer hold the same training state")
    );
    // In the same round an earlier failure stays the root cause (it may have caused this one).
    let AfterFailure::GiveUp(_, same_round) = fail_step(
        Some(&retried),
        round,
        FailureKind::Unrecoverable,
        "on b: UsageError",
        2_000,
        3,
        &live,
    ) else {
        panic!("closed");
    };
    assert_eq!(same_round.root_cause.as_deref(), Some("on a: ValueError"));
}

#[test]
fn a_node_expected_by_a_reopened_round_that_closed_is_told_the_job_is_over() {
    let state = running(&["a", "b"]).unwrap();
    let both = alive(&["a", "b"]);
    let AfterFailure::Restart(Some(reopened)) = fail_step(
        Some(&state),
        state.round,
        FailureKind::Uncounted,
        "on b: peer lost",
        0,
        1,
        &both,
    ) else {
        panic!("a lost peer reopens the round");
    };
    assert!(reopened.participants.is_empty());
    let AfterFailure::GiveUp(Some(closed), _) = fail_step(
        Some(&reopened),
        state.round,
        FailureKind::Counted,
        "rank 0 died",
        1_000,
        0,
        &both,
    ) else {
        panic!("a failure past --max-restarts closes the job");
    };
    for live in [both, alive(&["b"])] {
        let step = join_step(Some(&closed), &node("b"), &live, LIMITS, false, Some(&[]));
        assert!(
            matches!(
                step,
                JoinStep::Closed(Closed {
                    succeeded: false,
                    ..
                })
            ),
            "alive {live:?}: {step:?}"
        );
    }
    // A node of another job (same run id, later) is not held by it once its nodes are gone.
    let step = join_step(
        Some(&closed),
        &node("c"),
        &alive(&["c"]),
        LIMITS,
        false,
        None,
    );
    assert!(matches!(step, JoinStep::Write(_)), "{step:?}");
}

#[test]
fn a_stale_running_record_of_a_crashed_job_is_reopened_by_a_newcomer() {
    let state = running(&["a", "b"]);
    let live = alive(&["c"]);
    let JoinStep::Write(next) = join_step(state.as_ref(), &node("c"), &live, LIMITS, false, None)
    else {
        panic!("must reopen");
    };
    assert_eq!(next.phase, Phase::Joining);
    assert!(next.expected.is_empty(), "dead nodes are not expected");
}

#[derive(Debug, Clone)]
enum Op {
    Join(usize, bool),
    Watch(usize),
    Fail(bool),
    Close(bool),
    Die(usize),
    Revive(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..5usize, any::<bool>()).prop_map(|(n, l)| Op::Join(n, l)),
        2 => (0..5usize).prop_map(Op::Watch),
        1 => any::<bool>().prop_map(Op::Fail),
        1 => any::<bool>().prop_map(Op::Close),
        1 => (0..5usize).prop_map(Op::Die),
        1 => (0..5usize).prop_map(Op::Revive),
    ]
}

proptest! {
    /// Whatever agents do in whatever order, every record written keeps the invariants.
    #[test]
    fn invariants_hold_under_any_interleaving(ops in proptest::collection::vec(op(), 1..80)) {
        let ids = ["n0", "n1", "n2", "n3", "n4"];
        let mut live: BTreeSet<String> = ids.iter().map(|s| s.to_string()).collect();
        let mut state: Option<State> = None;
        let mut version = 0;
        for op in ops {
            let round = state.as_ref().map_or(0, |s| s.round);
            let write = match op {
                Op::Join(n, l) => match join_step(state.as_ref(), &node(ids[n]), &live, LIMITS, l, None) {
                    JoinStep::Write(s) => Some(s),
                    _ => None,
                },
                Op::Watch(n) => match watch_step(state.as_ref(), ids[n], round, &live, LIMITS, &NOW) {
                    WatchStep::Reopen(s, _) => Some(s),
                    _ => None,
                },
                Op::Fail(counted) => match fail_step(state.as_ref(), round, if counted { FailureKind::Counted } else { FailureKind::Uncounted }, "x", 0, 3, &live) {
                    AfterFailure::Restart(s) | AfterFailure::GiveUp(s, _) => s,
                },
                Op::Close(ok) => close_step(state.as_ref(), ok, None),
                Op::Die(n) => { live.remove(ids[n]); None }
                Op::Revive(n) => { live.insert(ids[n].to_string()); None }
            };
            if let Some(s) = write {
                prop_assert!(s.version > version, "versions only grow");
                version = s.version;
                prop_assert!(s.round >= round, "rounds never go back");
                prop_assert!(s.participants.len() as u32 <= LIMITS.max);
                let unique: BTreeSet<_> = s.participants.iter().map(|n| &n.id).collect();
                prop_assert_eq!(unique.len(), s.participants.len(), "no node twice");
                prop_assert!(s.waiting.iter().all(|w| !s.participants.contains(w)));
                if s.phase == Phase::Running {
                    prop_assert!(s.participants.len() as u32 >= LIMITS.min);
                    let ranks: Vec<u32> = s.participants.iter()
                        .filter_map(|n| s.assignment(&n.id).map(|a| a.node_rank)).collect();
                    prop_assert_eq!(ranks, (0..s.participants.len() as u32).collect::<Vec<_>>());
                }
                prop_assert!(s.failures <= 4, "never counted past max_restarts + 1");
                state = Some(s);
            }
        }
    }
}

/// A running round of a, b and c (all live), as every agent sees it after joining.
fn running_round_of_three() -> State {
    let live = alive(&["a", "b", "c"]);
    let mut state = None;
    for id in ["a", "b", "c"] {
        join(&mut state, id, &live, false);
    }
    let state = state.unwrap();
    assert_eq!(state.phase, Phase::Running);
    state
}

#[test]
fn a_node_told_to_go_leaves_and_the_next_round_expects_only_the_others() {
    let state = running_round_of_three();
    let live = alive(&["a", "b", "c"]);
    let LeaveStep::Write {
        next,
        nodes,
        world_size,
    } = leave_step(
        Some(&state),
        "b",
        state.round,
        &live,
        LIMITS,
        "node b leaves (SIGTERM)",
    )
    else {
        panic!("b may leave: two nodes are left, the minimum");
    };
    assert_eq!((nodes, world_size), (2, 4));
    assert_eq!(next.round, state.round + 1);
    assert_eq!(next.phase, Phase::Joining);
    assert_eq!(next.expected, ["a", "c"], "the leaver is not waited for");
    assert_eq!(next.reason.as_deref(), Some("node b leaves (SIGTERM)"));
    assert_eq!(next.failures, state.failures, "a leave is not a failure");
    // The others see the round reopened (not a node gone: b still beats while it leaves) and
    // complete the next one as soon as both have joined, while b is still alive.
    assert_eq!(
        watch_step(Some(&next), "a", state.round, &live, LIMITS, &NOW),
        WatchStep::Restart("node b leaves (SIGTERM)".into())
    );
    let mut rejoin = Some(next);
    join(&mut rejoin, "a", &live, false);
    let c = assigned(join(&mut rejoin, "c", &live, false));
    let a = assigned(join(&mut rejoin, "a", &live, false));
    assert_eq!(
        (a.nnodes, a.world_size, a.node_rank, c.node_rank),
        (2, 4, 0, 1)
    );
    assert_eq!(a.restart_count, state.failures);
}

#[test]
fn a_second_node_told_to_go_at_once_is_refused_so_the_job_stops_whole() {
    let state = running_round_of_three();
    let live = alive(&["a", "b", "c"]);
    let LeaveStep::Write { next, .. } =
        leave_step(Some(&state), "b", state.round, &live, LIMITS, "b leaves")
    else {
        panic!("b may leave");
    };
    assert!(matches!(
        leave_step(Some(&next), "c", state.round, &live, LIMITS, "c leaves"),
        LeaveStep::Refused(why) if why.contains("between rounds") && why.contains("b leaves")
    ));
}

#[test]
fn a_leave_below_the_minimum_or_after_the_end_is_refused() {
    let state = running_round_of_three();
    // c is already gone: without b only a would be left, below MIN 2.
    let live = alive(&["a", "b"]);
    assert!(matches!(
        leave_step(Some(&state), "b", state.round, &live, LIMITS, "b leaves"),
        LeaveStep::Refused(why) if why.contains("1 node(s)") && why.contains("minimum of 2")
    ));
    // A fixed-size job (MIN = MAX) never shrinks.
    let fixed = Limits { min: 3, max: 3 };
    let all = alive(&["a", "b", "c"]);
    assert!(matches!(
        leave_step(Some(&state), "b", state.round, &all, fixed, "b leaves"),
        LeaveStep::Refused(_)
    ));
    let closed = close_step(Some(&state), true, None).unwrap();
    assert_eq!(
        leave_step(Some(&closed), "b", state.round, &all, LIMITS, "b leaves"),
        LeaveStep::Refused("the job is over".into())
    );
    assert!(matches!(
        leave_step(None, "b", 0, &all, LIMITS, "b leaves"),
        LeaveStep::Refused(_)
    ));
    // Not a participant of the round (a node still waiting to join) cannot leave it.
    assert!(matches!(
        leave_step(Some(&state), "d", state.round, &all, LIMITS, "d leaves"),
        LeaveStep::Refused(_)
    ));
}

/// a, b and c trained in a round; c was lost and a and b rejoin: the round gathers.
fn regroup_of_three_after_c_lost() -> (State, Vec<String>) {
    let state = running_round_of_three();
    let held = vec!["a".to_string(), "b".to_string(), "c".to_string()];
    let live = alive(&["a", "b"]);
    let mut next = Some(state.reopened("node c gone".into(), &live));
    join(&mut next, "a", &live, false);
    (next.unwrap(), held)
}

#[test]
fn a_node_told_to_go_while_it_rejoins_leaves_when_a_node_that_trained_with_it_goes_on() {
    let (gathering, held) = regroup_of_three_after_c_lost();
    let live = alive(&["a", "b"]);
    let one = Limits { min: 1, max: 3 };
    // b has not joined the gathering round yet (a has): it is only expected there.
    let WithdrawStep::Write { next, nodes } = withdraw_step(
        Some(&gathering),
        "b",
        Some(&held),
        &live,
        one,
        "node b leaves",
    ) else {
        panic!("a trained in the last round and goes on: b may go");
    };
    assert_eq!(nodes, 1);
    assert!(
        !next.expected.contains(&"b".to_string()) && !next.is_participant("b"),
        "the round does not wait for b: {next:?}"
    );
    assert_eq!(next.round, gathering.round, "the same round, gathering on");
    // a completes the round alone at once, while b still beats.
    let mut rest = Some(next);
    let mut done = None;
    for _ in 0..10 {
        match join_step(rest.as_ref(), &node("a"), &live, one, false, None) {
            JoinStep::Write(next) => rest = Some(next),
            other => {
                done = Some(other);
                break;
            }
        }
    }
    assert!(
        matches!(done, Some(JoinStep::Assigned(ref a)) if a.nnodes == 1),
        "{done:?}"
    );
    // b joined already: it is taken out of the participants too.
    let mut joined = Some(gathering.clone());
    join(&mut joined, "b", &live, false);
    let joined = joined.unwrap();
    if joined.phase == Phase::Joining {
        let WithdrawStep::Write { next, .. } =
            withdraw_step(Some(&joined), "b", Some(&held), &live, one, "node b leaves")
        else {
            panic!("b may go");
        };
        assert!(!next.is_participant("b"), "{next:?}");
    } else {
        // The round completed with b in it (its assignment not read): it reopens without b.
        let WithdrawStep::Write { next, .. } =
            withdraw_step(Some(&joined), "b", Some(&held), &live, one, "node b leaves")
        else {
            panic!("b may go");
        };
        assert_eq!((next.phase, next.round), (Phase::Joining, joined.round + 1));
        assert_eq!(next.expected, ["a"]);
    }
}

#[test]
fn a_node_told_to_go_while_it_rejoins_stays_when_it_alone_holds_the_state_or_below_min() {
    let (gathering, held) = regroup_of_three_after_c_lost();
    let live = alive(&["a", "b"]);
    // MIN 2: without b only a is left.
    assert!(matches!(
        withdraw_step(Some(&gathering), "b", Some(&held), &live, LIMITS, "b leaves"),
        WithdrawStep::Refused(why) if why.contains("1 node(s)") && why.contains("minimum of 2")
    ));
    // The others are all new (d arrived; a and c, which trained with b, are gone): only b's
    // workers hold the training's state, so they save it.
    let mut state = gathering.clone();
    state.expected = vec!["b".into(), "d".into()];
    state.participants = vec![node("d")];
    let live = alive(&["b", "d"]);
    let one = Limits { min: 1, max: 3 };
    assert!(matches!(
        withdraw_step(Some(&state), "b", Some(&held), &live, one, "b leaves"),
        WithdrawStep::Refused(why) if why.contains("no other node trained")
    ));
    // A node whose workers never trained (it is told to go as it starts) holds nothing: it
    // goes, and the round gathers without it.
    assert!(matches!(
        withdraw_step(Some(&state), "b", None, &live, one, "b leaves"),
        WithdrawStep::Write { .. }
    ));
    let closed = close_step(Some(&gathering), true, None).unwrap();
    assert_eq!(
        withdraw_step(Some(&closed), "b", Some(&held), &live, one, "b leaves"),
        WithdrawStep::Refused("the job is over".into())
    );
    assert!(matches!(
        withdraw_step(None, "b", Some(&held), &live, one, "b leaves"),
        WithdrawStep::Refused(_)
    ));
}

/// A spare (a node waiting while the job trains at MAX) told to go: it leaves the waiting list,
/// and the round that trains is not reopened for it (the others do not regroup).
#[test]
fn a_spare_told_to_go_leaves_without_reopening_the_round() {
    let mut state = Some(running_round_of_three());
    let live = alive(&["a", "b", "c", "d"]);
    assert!(matches!(
        join(&mut state, "d", &live, false),
        JoinStep::Wait
    ));
    let state = state.unwrap();
    assert!(state.waiting.iter().any(|n| n.id == "d"), "{state:?}");
    let WithdrawStep::Write { next, nodes } =
        withdraw_step(Some(&state), "d", None, &live, LIMITS, "node d leaves")
    else {
        panic!("a spare may go");
    };
    assert_eq!(nodes, 3);
    assert_eq!(
        (next.phase.clone(), next.round),
        (Phase::Running, state.round)
    );
    assert_eq!(next.participants, state.participants);
    assert!(!next.waiting.iter().any(|n| n.id == "d"), "{next:?}");
}

/// Plays one agent of a backend with announcements: `announced` are the nodes with a key for
/// the round; only the round's writer is given them.
fn join_announced(
    state: &mut Option<State>,
    id: &str,
    live: &BTreeSet<String>,
    limits: Limits,
    announced: &[Node],
) -> JoinStep {
    for _ in 0..10 {
        let writer = state.as_ref().and_then(|s| s.writer(live)) == Some(id);
        let given: &[Node] = if writer { announced } else { &[] };
        match join_step(state.as_ref(), &node(id), live, limits, false, Some(given)) {
            JoinStep::Write(next) => *state = Some(next),
            other => return other,
        }
    }
    panic!("join_step for {id} kept writing");
}

#[test]
fn with_announcements_the_writer_admits_every_announced_node_in_one_write() {
    let ids: Vec<String> = (0..64).map(|i| format!("n{i:02}")).collect();
    let live: BTreeSet<String> = ids.iter().cloned().collect();
    let limits = Limits { min: 32, max: 64 };
    let announced: Vec<Node> = ids.iter().map(|id| node(id)).collect();
    let mut state = None;
    // The first agent takes the empty round; the others only wait, whatever their order.
    assert_eq!(
        join_announced(&mut state, "n05", &live, limits, &[]),
        JoinStep::Wait
    );
    let before = state.clone();
    for id in ["n17", "n63", "n00"] {
        assert_eq!(
            join_announced(&mut state, id, &live, limits, &announced),
            JoinStep::Wait
        );
    }
    assert_eq!(
        state, before,
        "agents that are not the writer write nothing"
    );
    // The writer merges all 63 others and, the round full, completes it in the same write.
    let version = state.as_ref().unwrap().version;
    let a = assigned(join_announced(&mut state, "n05", &live, limits, &announced));
    let s = state.as_ref().unwrap();
    assert_eq!(s.version, version + 1, "one write for 63 nodes");
    assert_eq!((a.nnodes, a.node_rank), (64, 0));
    assert_eq!(
        s.participants[1].id, "n00",
        "announcement order after the writer"
    );
    let b = assigned(join_announced(&mut state, "n63", &live, limits, &announced));
    assert_eq!(b.node_rank, 63);
}

#[test]
fn with_announcements_a_dead_writer_is_replaced_by_the_next_live_participant() {
    let live = alive(&["a", "b", "c"]);
    let announced = [node("a"), node("b"), node("c")];
    let mut state = None;
    join_announced(&mut state, "a", &live, LIMITS, &[]);
    // a dies before merging anyone: b (not yet a participant) cannot write for it...
    let live = alive(&["b", "c"]);
    assert_eq!(
        state.as_ref().unwrap().writer(&live),
        None,
        "a dead participant is no writer"
    );
    // ...so whoever writes first takes the round, drops a, and becomes the writer.
    assert_eq!(
        join_announced(&mut state, "b", &live, LIMITS, &announced[1..]),
        JoinStep::Wait,
        "at MIN the writer waits for the last call"
    );
    let s = state.as_ref().unwrap();
    assert_eq!(s.writer(&live), Some("b"));
    assert!(!s.is_participant("a"));
    let JoinStep::Write(next) = join_step(
        Some(s),
        &node("b"),
        &live,
        LIMITS,
        true,
        Some(&announced[1..]),
    ) else {
        panic!("the last call over, the writer completes the round");
    };
    let nodes: Vec<&str> = next.participants.iter().map(|n| n.id.as_str()).collect();
    assert_eq!((nodes, next.phase), (vec!["b", "c"], Phase::Running));
    assert!(
        next.expected.is_empty(),
        "a running record carries no expected list"
    );
}

#[test]
fn only_the_writer_reopens_for_a_gone_node_until_the_others_take_over() {
    let state = running(&["a", "b", "c"]).unwrap();
    let live = alive(&["a", "c"]);
    let seen = Watching {
        take_over: Duration::from_secs(1),
        gone_for: Duration::from_millis(100),
        ..NOW
    };
    assert_eq!(
        watch_step(Some(&state), "c", state.round, &live, LIMITS, &seen),
        WatchStep::Healthy,
        "c leaves the reopening to a, the writer"
    );
    assert!(matches!(
        watch_step(Some(&state), "a", state.round, &live, LIMITS, &seen),
        WatchStep::Reopen(..)
    ));
    let late = Watching {
        gone_for: Duration::from_secs(1),
        ..seen
    };
    assert!(
        matches!(
            watch_step(Some(&state), "c", state.round, &live, LIMITS, &late),
            WatchStep::Reopen(..)
        ),
        "after take_over anyone reopens"
    );
}

#[test]
fn waiting_nodes_are_admitted_together_after_the_window_and_a_growing_cooldown() {
    let limits = Limits { min: 2, max: 8 };
    let live = alive(&["a", "b", "c", "d"]);
    let s = State {
        phase: Phase::Running,
        participants: vec![node("a"), node("b")],
        ..State::default()
    };
    let newcomers = [node("c"), node("d")];
    let window = Duration::from_secs(2);
    let seen = |waiting: u64, running: u64| Watching {
        announced: &newcomers,
        waiting_for: Duration::from_secs(waiting),
        running_for: Duration::from_secs(running),
        window,
        ..NOW
    };
    // Not full with them: they wait for the window, and the round for its cooldown.
    assert_eq!(
        watch_step(Some(&s), "a", s.round, &live, limits, &seen(1, 60)),
        WatchStep::Healthy
    );
    assert_eq!(
        watch_step(Some(&s), "a", s.round, &live, limits, &seen(2, 1)),
        WatchStep::Healthy
    );
    assert_eq!(
        watch_step(Some(&s), "b", s.round, &live, limits, &seen(9, 60)),
        WatchStep::Healthy,
        "only the writer admits"
    );
    let WatchStep::Reopen(next, reason) =
        watch_step(Some(&s), "a", s.round, &live, limits, &seen(2, 2))
    else {
        panic!("both admitted after the window");
    };
    assert!(reason.contains("c, d waiting"), "{reason}");
    assert_eq!(next.expected, ["a", "b", "c", "d"]);
    assert_eq!(next.admissions, 1);
    // Each admission in a row doubles the next cooldown, up to 30 s.
    assert_eq!(admission_cooldown(window, 0), Duration::from_secs(2));
    assert_eq!(admission_cooldown(window, 3), Duration::from_secs(16));
    assert_eq!(admission_cooldown(window, 9), Duration::from_secs(30));
    let grown = State {
        admissions: 3,
        ..s.clone()
    };
    assert_eq!(
        watch_step(Some(&grown), "a", s.round, &live, limits, &seen(5, 15)),
        WatchStep::Healthy
    );
    // Nodes that fill the job are admitted at once: nobody else can come.
    let full = Limits { min: 2, max: 4 };
    assert!(matches!(
        watch_step(Some(&grown), "a", s.round, &live, full, &seen(0, 0)),
        WatchStep::Reopen(..)
    ));
    // A round opened for anything else starts the count again.
    assert_eq!(grown.reopened("node x is gone".into(), &live).admissions, 0);
}

#[test]
fn a_finished_node_waits_for_every_live_participant_and_the_first_closes_the_job() {
    let state = running(&["a", "b", "c"]);
    let live = alive(&["a", "b", "c"]);
    assert_eq!(
        unfinished(state.as_ref().unwrap(), &live),
        Vec::<String>::new(),
        "a job not over waits for nobody"
    );
    let b_done = finish_step(state.as_ref(), "b").unwrap();
    assert_eq!(b_done.phase, Phase::Closed { succeeded: true });
    assert_eq!(unfinished(&b_done, &live), ["a", "c"]);
    assert_eq!(finish_step(Some(&b_done), "b"), None, "counted once");
    // A node gone is not waited for; the last live one to finish ends the wait.
    assert_eq!(unfinished(&b_done, &alive(&["a", "b"])), ["a"]);
    let a_done = finish_step(Some(&b_done), "a").unwrap();
    assert_eq!(
        unfinished(&a_done, &alive(&["a", "b"])),
        Vec::<String>::new()
    );
    assert!(a_done.version > b_done.version);
    // A job closed as failed is not finished by anyone.
    let failed = close_step(state.as_ref(), false, Some("boom")).unwrap();
    assert_eq!(finish_step(Some(&failed), "a"), None);
    assert_eq!(unfinished(&failed, &live), Vec::<String>::new());
}

#[test]
fn a_record_without_finished_nodes_reads_as_before() {
    let state = running(&["a", "b"]).unwrap();
    let json = serde_json::to_string(&state).unwrap();
    assert!(!json.contains("finished"), "{json}");
    let back: State = serde_json::from_str(&json).unwrap();
    assert_eq!(back, state);
}

/// Issue 60, item 10: while the writer's workers are still starting, a node waiting to join
/// waits for them (then it is taken in place, not by a restart of starting workers); a node
/// gone still reopens the round.
#[test]
fn admissions_wait_while_the_writers_workers_start_but_a_gone_node_does_not() {
    let limits = Limits { min: 1, max: 2 };
    let s = State {
        phase: Phase::Running,
        participants: vec![node("a")],
        ..State::default()
    };
    let newcomer = [node("b")];
    let live = alive(&["a", "b"]);
    let seen = |hold| Watching {
        announced: &newcomer,
        waiting_for: Duration::from_secs(9),
        running_for: Duration::from_secs(60),
        window: Duration::from_secs(2),
        hold_admissions: hold,
        ..NOW
    };
    assert_eq!(
        watch_step(Some(&s), "a", s.round, &live, limits, &seen(true)),
        WatchStep::Healthy
    );
    assert!(matches!(
        watch_step(Some(&s), "a", s.round, &live, limits, &seen(false)),
        WatchStep::Reopen(..)
    ));
    let two = running(&["a", "c"]).unwrap();
    assert!(matches!(
        watch_step(
            Some(&two),
            "a",
            two.round,
            &alive(&["a"]),
            limits,
            &seen(true)
        ),
        WatchStep::Reopen(..)
    ));
}
