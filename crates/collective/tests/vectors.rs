//! The worker's side of the elastic protocol against its shared cases (`vectors/regroup.json`
//! at the repository's root), which the Python package's tests check too
//! (python/tests/test_vectors.py): a change that one language does not follow fails here or
//! there.

use collective::regroup::{
    AfterFailure, AfterStartFailure, AfterStep, Agreed, Failure, Raised, Save, Waiting,
    after_failure, after_start_failure, after_step, checkpoint_due, raised, saver_while_waiting,
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

#[derive(Deserialize)]
struct SaverIn {
    lost: bool,
    saver: bool,
    live: bool,
}

#[derive(Deserialize)]
struct StartFailureIn {
    failure: Failure,
    agent: bool,
}

#[derive(Deserialize)]
struct CheckpointDueIn {
    global_step: u64,
    every: u64,
    epoch_ends: bool,
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

#[test]
fn who_saves_on_a_stop_while_waiting_follows_the_shared_cases() {
    check_table::<SaverIn, Save>("saver_while_waiting", |i| {
        saver_while_waiting(i.lost, i.saver, i.live)
    });
}

#[test]
fn what_follows_a_failed_group_start_follows_the_shared_cases() {
    check_table::<StartFailureIn, AfterStartFailure>("after_start_failure", |i| {
        after_start_failure(i.failure, i.agent)
    });
}

#[test]
fn when_a_checkpoint_is_due_follows_the_shared_cases() {
    check_table::<CheckpointDueIn, bool>("checkpoint_due", |i| {
        checkpoint_due(i.global_step, i.every, i.epoch_ends)
    });
}

/// Every table of the file is checked by a test here (a table added on one side only, or
/// renamed, fails).
#[test]
fn every_shared_table_is_checked() {
    let mut tables: Vec<String> = vectors()
        .as_object()
        .expect("an object")
        .keys()
        .filter(|k| *k != "about")
        .cloned()
        .collect();
    tables.sort();
    assert_eq!(
        tables,
        [
            "after_failure",
            "after_start_failure",
            "after_step",
            "checkpoint_due",
            "raised",
            "saver_while_waiting",
            "waiting"
        ]
    );
}

/// The Python half of these tables, and the package's other parts that need no torch (the
/// sampler, the straggler watch, the loop's flow, the run's progress), under a plain
/// `python3`, with torch made unimportable: they run in every suite run, with or without a
/// Python that has torch, and none of them may come to need it.
#[test]
fn the_python_side_passes_under_a_plain_python_without_torch() {
    let package = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python");
    let shadow = std::env::temp_dir().join(format!("trainctl-no-torch-{}", std::process::id()));
    std::fs::create_dir_all(shadow.join("torch")).unwrap();
    std::fs::write(
        shadow.join("torch/__init__.py"),
        "raise ImportError('torch is blocked: this test runs the parts that must not need it')\n",
    )
    .unwrap();
    let out = std::process::Command::new("python3")
        .current_dir(&package)
        .env("PYTHONPATH", &shadow)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .args([
            "-m",
            "unittest",
            "tests.test_vectors",
            "tests.test_stragglers",
            "tests.test_flow",
            "tests.test_progress",
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!("python3: {e} (the suite needs a python3 on PATH: install python3)")
        });
    let _ = std::fs::remove_dir_all(&shadow);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("OK"), "{said}");
}
