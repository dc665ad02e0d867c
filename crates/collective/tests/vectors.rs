//! The worker's side of the elastic protocol against its shared cases (`vectors/regroup.json`
//! at the repository's root), which the Python package's tests check too
//! (python/tests/test_vectors.py): a change that one language does not follow fails here or
//! there.

use collective::regroup::{
    AfterFailure, AfterStep, Agreed, Failure, Raised, Waiting, after_failure, after_step, raised,
    waiting,
};
use serde::Deserialize;
use serde::de::DeserializeOwned;

#[derive(Deserialize)]
struct Case<I, O> {
    case: String,
    #[serde(rename = "in")]
    input: I,
    out: O,
}

#[derive(Deserialize)]
struct RaisedIn {
    stop: bool,
    assigned: bool,
    leaving: bool,
    rank: u32,
}

#[derive(Deserialize)]
struct AfterStepIn {
    agreed: Agreed,
    me_leaving: bool,
    checkpoint_due: bool,
}

#[derive(Deserialize)]
struct AfterFailureIn {
    failure: Failure,
    agent: bool,
    rank: u32,
}

#[derive(Deserialize)]
struct WaitingIn {
    leaving: bool,
    assigned: bool,
    stop: bool,
}

fn vectors() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../vectors/regroup.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The cases of table `name`, each checked by `check` (which returns what the code gives).
fn check_table<I: DeserializeOwned, O: DeserializeOwned + PartialEq + std::fmt::Debug>(
    name: &str,
    check: impl Fn(&I) -> O,
) {
    let cases: Vec<Case<I, O>> = serde_json::from_value(vectors()[name].clone())
        .unwrap_or_else(|e| panic!("vectors/regroup.json, table {name}: {e}"));
    assert!(!cases.is_empty(), "table {name} has no cases");
    for c in cases {
        assert_eq!(check(&c.input), c.out, "{name}: {}", c.case);
    }
}

#[test]
fn the_flags_a_rank_raises_follow_the_shared_cases() {
    check_table::<RaisedIn, Raised>("raised", |i| raised(i.stop, i.assigned, i.leaving, i.rank));
}

#[test]
fn what_follows_an_agreed_step_follows_the_shared_cases() {
    check_table::<AfterStepIn, AfterStep>("after_step", |i| {
        after_step(i.agreed, i.me_leaving, i.checkpoint_due)
    });
}

#[test]
fn what_follows_a_failed_collective_follows_the_shared_cases() {
    check_table::<AfterFailureIn, AfterFailure>("after_failure", |i| {
        after_failure(i.failure, i.agent, i.rank)
    });
}

#[test]
fn what_a_waiting_worker_does_follows_the_shared_cases() {
    check_table::<WaitingIn, Waiting>("waiting", |i| waiting(i.leaving, i.assigned, i.stop));
}
