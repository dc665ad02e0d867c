//! A Lightning script (fixtures/lightning_trainer.py: a small CNN on generated images)
//! converted to `trainctl.lightning` as docs/LIGHTNING.md says, under `trainctl run`, against
//! the same script on the stock `lightning.pytorch.Trainer` under plain torchrun: with nothing
//! failing the two end with bit-identical weights, steps and learning rate on every rank, and
//! what the integration cannot make exact is refused at once, saying what to do. (The script
//! through kills, leaves and a stop: `elastic::lightning`.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::*;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/lightning_trainer.py")
}

/// A Python with torch and lightning, or a loud skip.
macro_rules! python_or_skip {
    ($name:expr) => {
        match testkit::python_with_torch().filter(|p| testkit::python_imports(p, "lightning")) {
            Some(p) => p,
            None => {
                eprintln!(
                    "SKIPPED {}: no Python with torch and lightning (scripts/test installs them; or set TRAINCTL_TEST_PYTHON)",
                    $name
                );
                return;
            }
        }
    };
}

/// The script on two local workers under `trainctl run`, in `dir`.
fn two_workers(python: &Path, dir: &Path, flags: &[&str]) -> Command {
    let mut cmd = trainctl();
    cmd.current_dir(dir)
        .env("PYTHONPATH", testkit::python_package())
        .args(["run", "--standalone", "--nproc-per-node", "2"])
        .args(["--max-restarts", "1", "--"])
        .arg(python)
        .arg(fixture())
        .args(flags);
    cmd
}

/// The stock script under plain torchrun (torch's own launcher), two workers, in `dir`.
fn torchrun(python: &Path, dir: &Path, flags: &[&str]) -> Command {
    let mut cmd = Command::new(python);
    cmd.current_dir(dir)
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ])
        .arg(fixture())
        .arg("--stock")
        .args(flags);
    cmd
}

/// Every rank's `LIGHTNING rank R world W steps G lr L weights CRC buffers CRC`, sorted by
/// rank. (torchrun's workers share one pipe, and their lines may run into each other.)
fn ends(stdout: &[u8]) -> Vec<String> {
    let all = text(stdout);
    let mut ends: Vec<String> = all
        .split("LIGHTNING rank ")
        .skip(1)
        .filter_map(|rest| {
            let (head, crc) = rest.split_once(" buffers ")?;
            Some(format!("rank {head} buffers {}", crc.get(..8)?))
        })
        .collect();
    ends.sort();
    ends
}

/// With nothing failing, the converted script trains what Lightning's DDP trains, bit for bit,
/// on every rank (its parameters and each rank's BatchNorm statistics): Lightning's order
/// (`DistributedSampler` seeded by `PL_GLOBAL_SEED`), its warm-up schedule stepped every step;
/// with gradient accumulation and DataLoader workers, and with `max_steps` ending mid-epoch.
#[test]
fn the_converted_script_trains_as_the_stock_trainer_does() {
    let python = python_or_skip!("the_converted_script_trains_as_the_stock_trainer_does");
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
        let stock = run_ok(&mut torchrun(&python, dir.path(), &stock_args));
        let elastic = run_ok(&mut two_workers(&python, dir.path(), &elastic_args));
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
    let python = python_or_skip!("a_killed_worker_restarts_and_ends_as_the_uninterrupted_run_does");
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--epochs", "3", "--samples", "192", "--slow", "0.05"];
    let mut stock_args = flags.to_vec();
    stock_args.extend(["--out", "stock"]);
    let stock = run_ok(&mut torchrun(&python, dir.path(), &stock_args));
    let mut elastic_args = flags.to_vec();
    elastic_args.extend(["--out", "elastic"]);
    let mut run = Running::start(&mut two_workers(&python, dir.path(), &elastic_args));
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
    let elastic: Vec<String> = {
        let mut e: Vec<String> = out
            .lines()
            .filter_map(|l| l.split("LIGHTNING rank ").nth(1))
            .map(|rest| format!("rank {rest}"))
            .collect();
        e.sort();
        e
    };
    assert_eq!(elastic, ends(&stock.stdout), "{out}");
}

/// What the integration cannot make exact is refused before anything trains, with what to do:
/// a stream of samples (no index to re-shard or count by), a dropped last batch, manual
/// optimization (the boundary between steps is the user's), a strategy whose state is split
/// by world size.
#[test]
fn what_cannot_be_made_exact_is_refused_saying_what_to_do() {
    let python = python_or_skip!("what_cannot_be_made_exact_is_refused_saying_what_to_do");
    let dir = tempfile::tempdir().unwrap();
    for (flags, says) in [
        (&["--iterable"][..], "give a map-style dataset"),
        (&["--drop-last"][..], "leave drop_last off"),
        (&["--manual"][..], "use trainctl.torch.Elastic"),
        (&["--strategy", "fsdp"][..], "use strategy='ddp'"),
    ] {
        let out = two_workers(&python, dir.path(), flags).output().unwrap();
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{flags:?}:\n{all}");
        assert!(
            all.contains("UsageError") && all.contains(says),
            "{flags:?}:\n{all}"
        );
        assert!(
            !all.contains("restarting"),
            "a refusal is never retried:\n{all}"
        );
    }
}
