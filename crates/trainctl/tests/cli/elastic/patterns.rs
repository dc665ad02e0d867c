//! The loops PyTorch users write, through kills, joins and leaves: fixtures/loop_patterns.py
//! (a per-step or per-epoch LR scheduler, gradient accumulation, fp16 autocast with a
//! GradScaler, DataLoader worker processes, an evaluation whose result is all-reduced) under
//! three agents. Every rank ends with the same weights, learning rate and scheduler place, a
//! per-step scheduler has stepped once per step the job applied, every epoch trained each
//! image once, and the survivors' workers are never restarted. (The same loop against plain
//! DDP, step for step, and the loops the package refuses are in `pytorch::patterns`.)

use super::*;

/// The three-agent cluster running the patterns loop with `flags`.
fn cluster(store: Store, name: &str, flags: Vec<&'static str>) -> Option<Cluster> {
    let mut c = Cluster::pytorch(store, name)?;
    if let Program::PyTorch { script, .. } = &mut c.program {
        *script = Script::Patterns(flags);
    }
    Some(c)
}

/// `PATTERNS rank R world W steps G lr L scheduler S weights CRC` of every rank.
#[derive(Debug, PartialEq)]
struct Ended {
    world: usize,
    steps: u64,
    lr: String,
    scheduler: String,
    weights: String,
    /// The EMA's CRC and its count of averages (`-` without one).
    ema: String,
}

fn ended(all: &str) -> Vec<Ended> {
    all.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split("PATTERNS ").nth(1)?.split_whitespace().collect();
            let field = |name: &str| {
                w.iter()
                    .position(|x| *x == name)
                    .and_then(|i| w.get(i + 1))
                    .map(|s| s.to_string())
            };
            Some(Ended {
                world: field("world")?.parse().ok()?,
                steps: field("steps")?.parse().ok()?,
                lr: field("lr")?,
                scheduler: field("scheduler")?,
                weights: field("weights")?,
                ema: field("ema")?,
            })
        })
        .collect()
}

/// The patterns' end on every rank alike (see the module's doc).
pub(super) fn verify(outputs: &[String], world_size: usize, flags: &[&str]) {
    let all = outputs.join("\n");
    let ends = ended(&all);
    assert_eq!(ends.len(), world_size, "a PATTERNS line per rank:\n{all}");
    assert!(
        ends.iter().all(|e| e == &ends[0] && e.world == world_size),
        "every rank ends with the same weights, learning rate and scheduler: {ends:#?}\n{all}"
    );
    if flags.contains(&"--ema") {
        assert_eq!(
            ends[0].ema.split('/').nth(1),
            Some(ends[0].steps.to_string().as_str()),
            "the EMA averaged once per update the job applied: {ends:#?}"
        );
    }
    if flags.contains(&"onecycle") {
        assert_eq!(
            ends[0].scheduler,
            ends[0].steps.to_string(),
            "a per-step scheduler steps once per update the job applied: {ends:#?}"
        );
    }
    if flags.contains(&"--evaluate") {
        let mut epochs: Vec<&str> = all
            .lines()
            .filter_map(|l| l.split("EVAL epoch ").nth(1)?.split(' ').next())
            .collect();
        let said = epochs.len();
        epochs.dedup();
        assert_eq!(said, epochs.len(), "each evaluation once:\n{all}");
        assert!(said >= 10, "an evaluation every epoch (12):\n{all}");
    }
    if flags.contains(&"--rescale-lr") && flags.contains(&"steplr") {
        // StepLR's 0.7 a epoch from 0.01, times the world size's changes (each survivor
        // says each regroup; the first one's lines are the job's).
        let changed: f64 = outputs[0]
            .lines()
            .filter_map(|l| {
                let sizes = l.split("regrouped in place: world size ").nth(1)?;
                let (from, to) = sizes.split_once(" → ")?;
                let to = to.split(',').next()?;
                Some(to.parse::<f64>().ok()? / from.parse::<f64>().ok()?)
            })
            .product();
        let expected = 0.01 * 0.7f64.powi(12) * changed;
        let lr: f64 = ends[0].lr.parse().unwrap();
        assert!(
            changed != 1.0 && ((lr - expected) / expected).abs() < 1e-9,
            "on_resize rescaled the learning rate by {changed}: {lr} against {expected}\n{all}"
        );
    }
    assert!(
        !all.contains("DivergedError") && !all.contains("UsageError"),
        "{all}"
    );
}

/// A node lost and another joining, under a per-step OneCycleLR, accumulation over two
/// micro-batches, fp16 autocast with a GradScaler (whose first scales overflow: skipped
/// updates), DataLoader worker processes, an evaluation every epoch and an EMA.
#[test]
fn c10d_pytorch_patterns_lost_and_added_stay_exact() {
    agent_lost_and_another_added(cluster(
        Store::C10d,
        "c10d-py-patterns-lost-added",
        EVERY_PATTERN.to_vec(),
    ));
}

/// A node joining a job that steps ReduceLROnPlateau on its evaluation's loss after every
/// epoch, and accumulates over three micro-batches: the joiner takes the scheduler's state and
/// comes in where the others are, its evaluations and scheduler steps aligned with theirs.
#[test]
fn c10d_pytorch_patterns_joiner_follows_a_per_epoch_scheduler() {
    agent_added(cluster(
        Store::C10d,
        "c10d-py-patterns-join",
        vec!["--scheduler", "plateau", "--accumulate", "3", "--evaluate"],
    ));
}

/// A node told to go (SIGTERM) under a per-epoch StepLR, an evaluation every epoch, and
/// `on_resize` scaling the learning rate with the world size: every rank's rate follows it.
#[test]
fn c10d_pytorch_patterns_leaver_under_a_per_epoch_scheduler() {
    agent_told_to_go(
        cluster(
            Store::C10d,
            "c10d-py-patterns-leave",
            vec![
                "--scheduler",
                "steplr",
                "--evaluate",
                "--workers",
                "1",
                "--rescale-lr",
            ],
        ),
        3,
    );
}

/// A node lost while the ranks evaluate (killed while their all_reduce waits): the others'
/// collective fails inside `job.evaluate()`, they regroup in place and evaluate again in the
/// new group, which prints the evaluation once.
#[test]
fn c10d_pytorch_a_node_lost_while_evaluating_the_others_evaluate_again() {
    let Some(mut c) = cluster(
        Store::C10d,
        "c10d-py-patterns-eval-lost",
        vec!["--evaluate", "--slow-eval", "2"],
    ) else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    // Whichever rank host 1's worker is.
    c.agents[agents[0]].wait_for_line(JOB_TIMEOUT, |l| {
        l.contains("EVALUATING rank ") && l.ends_with(" of 3")
    });
    c.kill(agents[2]);
    let outputs = vec![c.succeeds(agents[0]), c.succeeds(agents[1])];
    let all = outputs.join("\n");
    c.verify_end(&outputs, 2);
    c.verify_exactly_once();
    assert!(
        outputs
            .iter()
            .all(|o| o.contains("regrouped in place") && o.contains("world size 3 → 2")),
        "{all}"
    );
    assert!(
        all.contains("EVALUATING rank 0 of 2"),
        "evaluated again at world size 2:\n{all}"
    );
    for &a in &agents[..2] {
        assert_eq!(
            workers_of(&c.agents[a]).len(),
            1,
            "no worker restarted:\n{all}"
        );
    }
}

/// The soak of [`kills_and_joins_at_random`] on the loop with every pattern at once: three
/// nodes killed at random steps, each replaced, under a per-step OneCycleLR, accumulation, a
/// GradScaler, DataLoader workers and an evaluation every epoch.
///
/// Seed 4099 (`TRAINCTL_SOAK_SEED=4099`) once ended with `DivergedError`: a node killed in the
/// epoch-end evaluation as a joiner came in left the survivor's model in eval mode (the
/// evaluation's `model.train()` never ran, and the survivor skipped it), so the survivor trained
/// on in eval mode and its AveragedModel parted from the joiner's. `job.evaluate()` now puts the
/// modules' modes back.
#[test]
fn c10d_pytorch_patterns_kills_and_joins_at_random_stay_exact() {
    let name = "c10d-py-patterns-soak";
    let Some(c) = cluster(Store::C10d, name, EVERY_PATTERN.to_vec()) else {
        return;
    };
    soak(c, name);
}

/// Rank 0's node lost (etcd: it hosts no store) and replaced, under an EMA of the loop's own
/// given as `state=` and updated after every block, unguarded: the survivors' dropped step is
/// followed by an update the job undoes (and says so), the new rank 0 holds the EMA every rank
/// holds, and at the end every rank's EMA has averaged exactly the updates applied.
#[test]
fn etcd_pytorch_rank_0s_node_lost_and_replaced_keeps_the_ema_exact() {
    let Some(mut c) = cluster(
        Store::Etcd,
        "etcd-py-ema-rank0",
        // Two nodes step slowly until the replacement (started warm: it joins once its
        // workers are ready) is in.
        vec![
            "--scheduler",
            "onecycle",
            "--ema",
            "own-unguarded",
            "--slow-below",
            "3:0.3",
        ],
    ) else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    // The node of rank 0 is the first to join: whichever it was.
    let mut rank0 = 0;
    for (i, &a) in agents.iter().enumerate() {
        let round = c.agents[a].wait_for_line(JOB_TIMEOUT, |l| {
            l.contains(": node rank ") && l.contains(" of 3,")
        });
        if round.contains(": node rank 0 of 3,") {
            rank0 = i;
        }
    }
    c.wait_for_progress(2);
    c.kill(agents[rank0]);
    let replacement = c.start(rank0 + 1, 1);
    let mut outputs: Vec<String> = (0..3)
        .filter(|&i| i != rank0)
        .map(|i| c.succeeds(agents[i]))
        .collect();
    outputs.push(c.succeeds(replacement));
    let all = outputs.join("\n");
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
    assert!(
        all.contains(
            "after a step that applied no update (a peer was lost and the step dropped); undone"
        ),
        "{all}"
    );
    for i in (0..3).filter(|&i| i != rank0) {
        assert_eq!(
            workers_of(&c.agents[agents[i]]).len(),
            1,
            "no worker restarted:\n{all}"
        );
    }
}
