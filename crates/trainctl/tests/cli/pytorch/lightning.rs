//! A Lightning script (fixtures/lightning_trainer.py: a small CNN on generated images)
//! converted to `trainctl.lightning` as docs/LIGHTNING.md says, under `trainctl run`, against
//! the same script on the stock `lightning.pytorch.Trainer` under plain torchrun: with nothing
//! failing the two end with bit-identical weights, steps and learning rate on every rank, and
//! what the integration cannot make exact is refused at once, saying what to do. (The script
//! through kills, leaves and a stop: `elastic::lightning`.)

use std::time::Duration;

use super::*;

const SCRIPT: &str = "lightning_trainer.py";

/// Every rank's `LIGHTNING rank R world W steps G lr L weights CRC buffers CRC`, sorted by
/// rank.
fn ends(stdout: &[u8]) -> Vec<String> {
    rank_ends(&text(stdout), "LIGHTNING rank ", " buffers ")
}

/// With nothing failing, the converted script trains what Lightning's DDP trains, bit for bit,
/// on every rank (its parameters and each rank's BatchNorm statistics): Lightning's order
/// (`DistributedSampler` seeded by `PL_GLOBAL_SEED`), its warm-up schedule stepped every step;
/// with gradient accumulation and DataLoader workers, and with `max_steps` ending mid-epoch.
#[test]
fn the_converted_script_trains_as_the_stock_trainer_does() {
    let Some(python) = python_importing(
        "lightning",
        "the_converted_script_trains_as_the_stock_trainer_does",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (run, flags) in [
        &["--epochs", "2"][..],
        &["--epochs", "2", "--accumulate", "2", "--workers", "1"][..],
        &["--epochs", "3", "--max-steps", "17"][..],
    ]
    .into_iter()
    .enumerate()
    {
        let stock_out = format!("stock-{run}");
        let elastic_out = format!("elastic-{run}");
        let mut stock_args = flags.to_vec();
        stock_args.extend(["--out", &stock_out]);
        let mut elastic_args = flags.to_vec();
        elastic_args.extend(["--out", &elastic_out]);
        let stock = run_ok(&mut under_torchrun(
            &python,
            dir.path(),
            SCRIPT,
            &stock_args,
        ));
        let elastic = run_ok(&mut on_two_workers(
            &python,
            dir.path(),
            SCRIPT,
            &elastic_args,
        ));
        let (stock, elastic) = (ends(&stock.stdout), ends(&elastic.stdout));
        assert_eq!(stock.len(), 2, "{flags:?}: {stock:?}");
        assert_eq!(
            elastic, stock,
            "{flags:?}: trainctl.lightning against the stock Trainer"
        );
    }
}

/// A worker killed mid-epoch: rank 0, whose step fails with it, checkpoints the last step it
/// completed, both workers restart and resume there, and the run ends bit-identical to the
/// stock Trainer's uninterrupted one: weights, step, learning rate and every rank's BatchNorm
/// statistics (kept as they were before the failed step's forward).
#[test]
fn a_killed_worker_restarts_and_ends_as_the_uninterrupted_run_does() {
    let Some(python) = python_importing(
        "lightning",
        "a_killed_worker_restarts_and_ends_as_the_uninterrupted_run_does",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--epochs", "3", "--samples", "192", "--slow", "0.05"];
    let mut stock_args = flags.to_vec();
    stock_args.extend(["--out", "stock"]);
    let stock = run_ok(&mut under_torchrun(
        &python,
        dir.path(),
        SCRIPT,
        &stock_args,
    ));
    let mut elastic_args = flags.to_vec();
    elastic_args.extend(["--out", "elastic"]);
    let mut run = Running::start(&mut on_two_workers(
        &python,
        dir.path(),
        SCRIPT,
        &elastic_args,
    ));
    let records = dir.path().join("elastic/trained");
    testkit::eventually("a batch at step 10", Duration::from_secs(300), || {
        std::fs::read_dir(&records)
            .into_iter()
            .flatten()
            .flatten()
            .any(|f| {
                std::fs::read_to_string(f.path())
                    .unwrap_or_default()
                    .contains("\"step\": 10,")
            })
    });
    run.kill_worker(1, Duration::from_secs(60));
    let status = run.wait(Duration::from_secs(300));
    let out = run.output();
    assert!(status.success(), "{out}");
    assert!(
        out.contains("checkpointed step") && out.contains("resuming from"),
        "rank 0 checkpoints the last step and the restart resumes there:\n{out}"
    );
    assert_eq!(ends(out.as_bytes()), ends(&stock.stdout), "{out}");
}

/// What the integration cannot make exact is refused before anything trains, with what to do:
/// a stream of samples (no index to re-shard or count by), a dropped last batch, manual
/// optimization (the boundary between steps is the user's), a strategy whose state is split
/// by world size.
#[test]
fn what_cannot_be_made_exact_is_refused_saying_what_to_do() {
    let Some(python) = python_importing(
        "lightning",
        "what_cannot_be_made_exact_is_refused_saying_what_to_do",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (flags, says) in [
        (&["--iterable"][..], "give a map-style dataset"),
        (&["--drop-last"][..], "leave drop_last off"),
        (&["--manual"][..], "use trainctl.torch.Elastic"),
        (&["--strategy", "fsdp"][..], "use strategy='ddp'"),
    ] {
        assert_refused(
            &mut on_two_workers(&python, dir.path(), SCRIPT, flags),
            flags,
            says,
        );
    }
}
