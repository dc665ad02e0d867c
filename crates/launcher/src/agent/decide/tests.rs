use super::*;
use rendezvous::FailureKind::*;
use signal_hook::consts::SIGTERM;

fn regrouping_workers() -> Memory {
    Memory {
        can_regroup: true,
        max_restarts: 1,
        ..Memory::default()
    }
}

#[test]
fn sigterm_asks_a_node_to_leave_and_the_others_stop_the_job() {
    let m = regrouping_workers();
    assert_eq!(next(&Seen::Signal(SIGTERM), &m, false), Next::Leave);
    // Workers that cannot regroup (still starting, a user's program, --regroup restart): the
    // node leaves too, and the others restart at the new size instead of regrouping.
    let restarting = Memory {
        can_regroup: false,
        ..m
    };
    assert_eq!(
        next(&Seen::Signal(SIGTERM), &restarting, false),
        Next::Leave
    );
    // Ctrl-C and SIGHUP stop the job; so does SIGTERM once another node has finished it.
    assert_eq!(next(&Seen::Signal(2), &m, false), Next::Stop);
    assert_eq!(next(&Seen::Signal(1), &m, false), Next::Stop);
    let closing = Memory { closing: true, ..m };
    assert_eq!(next(&Seen::Signal(SIGTERM), &closing, false), Next::Stop);
}

#[test]
fn a_lost_peer_regroups_until_too_many_regroups_failed_in_a_row() {
    let m = regrouping_workers();
    assert_eq!(
        next(&Seen::PeerLost, &m, false),
        Next::Regroup {
            abort: false,
            failed: false,
            tell: true
        }
    );
    // A peer lost while the last regroup was under way: that regroup failed.
    let under_way = Memory {
        regrouping: true,
        ..m
    };
    assert_eq!(
        next(&Seen::PeerLost, &under_way, false),
        Next::Regroup {
            abort: false,
            failed: true,
            tell: true
        }
    );
    // One failed already, --max-restarts 1: the second is one too many.
    let again = Memory {
        failed_regroups: 1,
        ..under_way
    };
    assert_eq!(
        next(&Seen::PeerLost, &again, false),
        Next::Restart {
            fallback: true,
            tell: true
        }
    );
    let closing = Memory { closing: true, ..m };
    assert_eq!(next(&Seen::PeerLost, &closing, false), Next::Succeed);
}

#[test]
fn a_round_reopened_elsewhere_regroups_in_place_or_restarts() {
    let m = regrouping_workers();
    let gone = Seen::Round(Round::Reopened { node_gone: true });
    let joining = Seen::Round(Round::Reopened { node_gone: false });
    assert_eq!(
        next(&gone, &m, false),
        Next::Regroup {
            abort: true,
            failed: false,
            tell: false
        },
        "a node gone: the workers' links are broken at once"
    );
    assert_eq!(
        next(&joining, &m, false),
        Next::Regroup {
            abort: false,
            failed: false,
            tell: false
        },
        "a node joining or leaving: they train on until the assignment"
    );
    let restarting = Memory {
        can_regroup: false,
        ..m
    };
    assert_eq!(
        next(&gone, &restarting, false),
        Next::Restart {
            fallback: false,
            tell: false
        }
    );
}

#[test]
fn failures_are_recorded_with_the_rendezvous_unless_the_job_is_closing() {
    let m = regrouping_workers();
    assert_eq!(
        next(&Seen::WorkerFailed { kind: Counted }, &m, false),
        Next::RecordFailure { kind: Counted }
    );
    assert_eq!(
        next(&Seen::WorkerFailed { kind: Uncounted }, &m, false),
        Next::RecordFailure { kind: Uncounted }
    );
    assert_eq!(
        next(
            &Seen::WorkerFailed {
                kind: Unrecoverable
            },
            &m,
            false
        ),
        Next::RecordFailure {
            kind: Unrecoverable
        }
    );
    let closing = Memory { closing: true, ..m };
    assert_eq!(
        next(&Seen::WorkerFailed { kind: Counted }, &closing, false),
        Next::FailAlone
    );
    assert_eq!(next(&Seen::WorkersDone, &m, false), Next::Succeed);
}

#[test]
fn the_store_going_and_coming_back_is_said_once_each_and_the_workers_go_on() {
    let m = regrouping_workers();
    assert_eq!(
        next(&Seen::Round(Round::Unreachable), &m, false),
        Next::StoreDown
    );
    assert_eq!(next(&Seen::Round(Round::Unreachable), &m, true), Next::Wait);
    assert_eq!(
        next(&Seen::Round(Round::Healthy), &m, true),
        Next::StoreBack
    );
    assert_eq!(next(&Seen::Round(Round::Healthy), &m, false), Next::Wait);
    let closed = |succeeded, member| Seen::Round(Round::Closed { succeeded, member });
    assert_eq!(
        next(&closed(true, true), &m, false),
        Next::Closing,
        "another node finished: this node's workers finish too"
    );
    assert_eq!(next(&closed(false, true), &m, false), Next::JobFailed);
    for succeeded in [true, false] {
        assert_eq!(
            next(&closed(succeeded, false), &m, true),
            Next::LeftBehind { succeeded },
            "the job ended without this node (cut off): its workers are behind, not to save"
        );
    }
}

#[test]
fn a_straggler_is_evicted_only_by_a_regroup_in_place_with_nothing_else_under_way() {
    let ready = Memory {
        can_regroup: true,
        ..Memory::default()
    };
    assert_eq!(next(&Seen::Straggler, &ready, false), Next::Evict);
    for memory in [
        Memory::default(),
        Memory {
            regrouping: true,
            ..ready
        },
        Memory {
            closing: true,
            ..ready
        },
    ] {
        assert_eq!(
            next(&Seen::Straggler, &memory, false),
            Next::Wait,
            "{memory:?}"
        );
    }
}
