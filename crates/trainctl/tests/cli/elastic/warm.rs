//! Warm joiners and spares (issue 69): a node joining a job under way starts its workers
//! before it asks for a place, so the others pause for the state's transfer and the new
//! group's start alone, not for the joiner's start; a node beyond `--nnodes` MAX waits warm as
//! a spare and takes a lost node's place in the same regroup.

use super::*;

/// The joiner's output says its workers were ready before it asked for a place: the round the
/// others regroup into formed after the joiner's start, not before it (they never waited for
/// it). Returns the joiner's output.
fn joined_warm(out: &str) -> &str {
    let ready = out
        .find("its workers are ready after ")
        .unwrap_or_else(|| panic!("the joiner started warm:\n{out}"));
    let round = out
        .find(": node rank 2 of 3,")
        .unwrap_or_else(|| panic!("the joiner got a place:\n{out}"));
    assert!(ready < round, "ready before it asked for a place:\n{out}");
    assert!(
        out.contains("joined in place, its workers started warm: world size 3"),
        "{out}"
    );
    assert!(!out.contains("started rank "), "no cold start:\n{out}");
    out
}

/// Two nodes train; a third joins, its program slow to start (`slow` seconds before
/// `Elastic(...)`, as torch's imports and a model load): it starts warm, and the two regroup
/// 2 → 3 in place once its workers are ready, never restarted, every image once an epoch.
fn a_warm_joiner(mut c: Cluster, slow: Option<&'static str>) {
    if let (Program::PyTorch { script, .. }, Some(slow)) = (&mut c.program, slow) {
        // Long enough for the joiner's slow start to end while the others still train.
        *script = Script::Patterns(vec!["--slow-start", slow, "--step-sleep", "0.05"]);
        c.epochs = 30;
    }
    let first = [c.start(1, 1), c.start(2, 1)];
    c.wait_for_progress(2);
    let late = c.start(3, 1);
    let mut outputs: Vec<String> = first.iter().map(|&a| c.succeeds(a)).collect();
    let joiner = c.succeeds(late);
    joined_warm(&joiner);
    let all = outputs.join("\n");
    for out in &outputs {
        assert!(out.contains("world size 2 → 3"), "{all}\n---\n{joiner}");
        let paused: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("world size 2 → 3"))
            .collect();
        eprintln!("{paused:?}");
    }
    for &a in &first {
        assert_eq!(workers_of(&c.agents[a]).len(), 1, "{all}");
    }
    outputs.push(joiner);
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
}

#[test]
fn c10d_a_warm_joiner_of_the_built_in_trainer() {
    if let Some(c) = Cluster::new(Store::C10d, "c10d-warm-builtin") {
        a_warm_joiner(c, None);
    }
}

#[test]
fn c10d_pytorch_a_warm_joiner_whose_start_is_slow() {
    if let Some(c) = Cluster::pytorch(Store::C10d, "c10d-py-warm") {
        a_warm_joiner(c, Some("8"));
    }
}

/// Three nodes at `--nnodes 2:3` and a fourth beyond MAX, which waits warm as a spare (and
/// says so, without timing out); one of the three is killed: the spare takes its place in the
/// same regroup, world size 3 → 3, no survivor's worker restarted, every image once an epoch.
fn a_spare_takes_a_lost_nodes_place(store: Store, name: &str) {
    let Some(mut c) = Cluster::new(store, name) else {
        return;
    };
    // Four nodes on the three agent hosts: the spare shares host 2.
    let agents: Vec<usize> = [1, 2, 3].iter().map(|&h| c.start(h, 1)).collect();
    c.wait_for_progress(2);
    let spare = c.start(2, 1);
    c.agents[spare].wait_for_line(JOB_TIMEOUT, |l| l.contains("trainctl run: a spare: "));
    c.kill(agents[2]);
    let mut outputs: Vec<String> = agents[..2].iter().map(|&a| c.succeeds(a)).collect();
    let spare_out = c.succeeds(spare);
    let all = outputs.join("\n");
    for out in &outputs {
        let regroups: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("regrouped in place"))
            .collect();
        assert_eq!(regroups.len(), 1, "one regroup:\n{all}\n---\n{spare_out}");
        assert!(regroups[0].contains("world size 3 → 3"), "{all}");
    }
    assert!(
        spare_out.contains("joined in place, its workers started warm: world size 3"),
        "{spare_out}"
    );
    for &a in &agents[..2] {
        assert_eq!(workers_of(&c.agents[a]).len(), 1, "{all}");
    }
    outputs.push(spare_out);
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
}

#[test]
fn c10d_a_spare_takes_a_lost_nodes_place_in_one_regroup() {
    a_spare_takes_a_lost_nodes_place(Store::C10d, "c10d-spare");
}

#[test]
fn etcd_a_spare_takes_a_lost_nodes_place_in_one_regroup() {
    a_spare_takes_a_lost_nodes_place(Store::Etcd, "etcd-spare");
}
