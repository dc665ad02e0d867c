//! The Lightning script (fixtures/lightning_trainer.py through `trainctl.lightning`) under three
//! agents, through a node lost and another added, a node told to go and the whole job stopped.
//! Lightning's loop cannot regroup in place, so every worker restarts and resumes from the
//! job's checkpoint at the exact sample: every epoch trains each sample once (the script's own
//! record of the batches it trained), and every rank ends with the same weights, step and
//! learning rate. (Without faults, against the stock Trainer: `pytorch::lightning`.)

use std::collections::BTreeMap;

use super::*;

/// Every rank's `LIGHTNING rank R world W steps G lr L weights CRC buffers CRC` has the same
/// world, step, learning rate and weights (the buffers, BatchNorm's statistics, are each
/// rank's own).
pub(super) fn verify(outputs: &[String], world_size: usize) {
    verify_rank_ends(outputs, world_size, "LIGHTNING rank ", Some(" buffers "));
}

const SAMPLES: u64 = 192;

fn cluster(name: &str) -> Option<Cluster> {
    let flags = vec![
        "--samples",
        "192",
        "--batch-size",
        "4",
        "--slow",
        "0.05",
        "--checkpoint-every",
        "4",
    ];
    let mut c = Cluster::pytorch_script(Store::C10d, name, Script::Lightning(flags), "lightning")?;
    c.epochs = 3;
    Some(c)
}

/// A batch as the script recorded it as it started.
struct Trained {
    process: String,
    started: u64,
    step: u64,
    epoch: u64,
    world: usize,
    ids: Vec<u64>,
}

fn trained(c: &Cluster) -> Vec<Trained> {
    let dir = c.job.path("runs").join("trained");
    let Ok(files) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut all = Vec::new();
    for file in files.flatten() {
        let process = file.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(file.path()).unwrap_or_default();
        // A line cut short by a kill is left out.
        for v in text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            all.push(Trained {
                process: process.clone(),
                started: v["started"].as_u64().unwrap(),
                step: v["step"].as_u64().unwrap(),
                epoch: v["epoch"].as_u64().unwrap(),
                world: v["world"].as_u64().unwrap() as usize,
                ids: v["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap())
                    .collect(),
            });
        }
    }
    all
}

/// Waits for a batch at `step`; an agent that ends first, or the timeout, fails the test with
/// every agent's output.
fn wait_for_trained_step(c: &mut Cluster, step: u64) {
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    while !trained(c).iter().any(|t| t.step >= step) {
        let ended = c
            .agents
            .iter_mut()
            .any(|a| matches!(a.child.try_wait(), Ok(Some(_))));
        if ended || std::time::Instant::now() > deadline {
            let mut outputs = String::new();
            for a in 0..c.agents.len() {
                c.kill(a);
                c.agents[a].wait(Duration::from_secs(5));
                outputs += &c.agents[a].output();
            }
            panic!("no batch at step {step}:\n{outputs}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every epoch trained each sample exactly once: for each step, the batches of the last
/// processes that trained it (as many as their world size; a restart's processes start after
/// the last ones ended) are the ones that stand.
fn verify_every_sample_once(c: &Cluster) {
    let mut by_step: BTreeMap<u64, Vec<&Trained>> = BTreeMap::new();
    let records = trained(c);
    for t in &records {
        by_step.entry(t.step).or_default().push(t);
    }
    let mut epochs: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (step, mut batches) in by_step {
        batches.sort_by_key(|t| std::cmp::Reverse(t.started));
        let world = batches[0].world;
        let mut processes: Vec<&str> = batches.iter().map(|t| t.process.as_str()).collect();
        processes.dedup();
        let standing = &processes[..world.min(processes.len())];
        assert_eq!(standing.len(), world, "step {step}: a batch per rank");
        for t in batches
            .iter()
            .filter(|t| standing.contains(&t.process.as_str()))
        {
            epochs.entry(t.epoch).or_default().extend(&t.ids);
        }
    }
    assert_eq!(epochs.len() as u64, c.epochs, "{:?}", epochs.keys());
    for (epoch, mut ids) in epochs {
        ids.sort();
        // DistributedSampler's padding repeats the epoch's first samples in its last step.
        ids.dedup();
        assert_eq!(
            ids,
            (0..SAMPLES).collect::<Vec<_>>(),
            "epoch {epoch}: every sample trained"
        );
    }
}

/// A node killed mid-epoch and another started: every worker restarts at the new world (the
/// survivors' checkpoint of the last step, or the last scheduled one), and the job ends with
/// every sample once and one set of weights.
#[test]
fn c10d_lightning_node_lost_and_another_added_resumes_at_the_exact_sample() {
    let Some(mut c) = cluster("c10d-lightning-lost-added") else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 3)).collect();
    wait_for_trained_step(&mut c, 6);
    c.kill(agents[2]);
    let newcomer = c.start(3, 3);
    let outputs = vec![
        c.succeeds(agents[0]),
        c.succeeds(agents[1]),
        c.succeeds(newcomer),
    ];
    let all = outputs.join("\n");
    assert!(all.contains("trainctl.lightning: resuming from"), "{all}");
    verify(&outputs, 3);
    verify_every_sample_once(&c);
}

/// A node told to go (SIGTERM to its agent) exits 143; the others restart their workers at
/// world size 2 and resume at the exact sample.
#[test]
fn c10d_lightning_node_told_to_go_the_others_resume_without_it() {
    let Some(mut c) = cluster("c10d-lightning-leave") else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 3)).collect();
    wait_for_trained_step(&mut c, 6);
    sigterm(&c.agents[agents[2]]);
    let status = c.agents[agents[2]].wait(JOB_TIMEOUT);
    let left = c.agents[agents[2]].output();
    assert_eq!(status.code(), Some(143), "the leaver exits 143:\n{left}");
    let outputs = vec![c.succeeds(agents[0]), c.succeeds(agents[1])];
    let all = outputs.join("\n");
    assert!(all.contains("trainctl.lightning: resuming from"), "{all}");
    verify(&outputs, 2);
    verify_every_sample_once(&c);
}

/// The whole job stopped (SIGTERM to every agent): the ranks stop after the same step (a rank
/// that stops first fails the others' next one), rank 0 checkpoints it, every agent exits 143,
/// and the same command resumes at the exact sample.
#[test]
fn c10d_lightning_job_stopped_checkpoints_and_resumes_at_the_exact_sample() {
    let Some(mut c) = cluster("c10d-lightning-stop") else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    wait_for_trained_step(&mut c, 6);
    for &a in &agents {
        sigterm(&c.agents[a]);
    }
    let mut stopped = String::new();
    for &a in &agents {
        let status = c.agents[a].wait(JOB_TIMEOUT);
        stopped += &c.agents[a].output();
        assert_eq!(status.code(), Some(143), "agent {a} exits 143:\n{stopped}");
    }
    assert!(
        stopped.contains("checkpointed step") && stopped.contains(" on SIGTERM")
            || stopped.contains("is checkpointed already (on SIGTERM)"),
        "rank 0 checkpoints the step it stopped after:\n{stopped}"
    );
    c.nnodes = "3:3";
    let outputs = c.run_again_from_the_checkpoint();
    verify(&outputs, 3);
    verify_every_sample_once(&c);
}
