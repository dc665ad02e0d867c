//! A rendezvous record written by anyone with access to the store: decoding it and running
//! every step of the state machine on it never panics.
#![no_main]
use std::collections::BTreeSet;

use libfuzzer_sys::fuzz_target;
use rendezvous::Limits;
use rendezvous::state::{self, Node, State};

fuzz_target!(|data: &[u8]| {
    let Ok(record) = serde_json::from_slice::<State>(data) else {
        return;
    };
    let me = Node {
        id: "me".into(),
        addr: "127.0.0.1".into(),
        port: 1,
        nproc: 1,
    };
    let alive: BTreeSet<String> = ["me".to_string()].into();
    for limits in [Limits { min: 1, max: 1 }, Limits { min: 2, max: 3 }] {
        for last_call in [false, true] {
            let _ = state::join_step(Some(&record), &me, &alive, limits, last_call);
        }
        let _ = state::watch_step(Some(&record), "me", record.round, &alive, limits);
    }
    let _ = state::fail_step(Some(&record), record.round, state::FailureKind::Counted, "x", 0, 3, &alive);
    let _ = state::close_step(Some(&record), true, None);
    for n in &record.participants {
        let _ = record.assignment(&n.id);
    }
});
