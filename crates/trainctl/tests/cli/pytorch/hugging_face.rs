//! A Hugging Face Trainer script (fixtures/hf_trainer.py: a GPT-2 made from a config, random
//! tokens, some labels masked) converted to `trainctl.hf` as docs/HUGGINGFACE.md says, under
//! `trainctl run`, against the same script on the stock `transformers.Trainer` under plain
//! torchrun: with nothing failing the two end with
//! bit-identical weights, steps and learning rate, and what the integration cannot make exact is
//! refused at once, saying what to do. (The script through kills and leaves:
//! `elastic::hugging_face`.)

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::*;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/hf_trainer.py")
}

/// A Python with torch and transformers, or a loud skip.
macro_rules! python_or_skip {
    ($name:expr) => {
        match testkit::python_with_torch()
            .filter(|p| testkit::python_imports(p, "transformers, accelerate"))
        {
            Some(p) => p,
            None => {
                eprintln!(
                    "SKIPPED {}: no Python with torch and transformers (scripts/test installs them; or set TRAINCTL_TEST_PYTHON)",
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
        .args(["run", "--standalone", "--nproc-per-node", "2", "--"])
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

/// Every rank's `HF rank R world W steps G lr L weights CRC`, sorted by rank. (torchrun's
/// workers share one pipe, and their lines may run into each other.)
fn ends(stdout: &[u8]) -> Vec<String> {
    let all = text(stdout);
    let mut ends: Vec<String> = all
        .split("HF rank ")
        .skip(1)
        .filter_map(|rest| {
            let (head, crc) = rest.split_once(" weights ")?;
            Some(format!("rank {head} weights {}", crc.get(..8)?))
        })
        .collect();
    ends.sort();
    ends
}

/// With nothing failing, the converted script trains what the stock Trainer trains, bit for
/// bit: the Trainer's own order (randperm seeded by its seed + epoch, each micro-batch split
/// over the ranks in blocks as accelerate splits it), its loss normalised over every rank's
/// label tokens, its clipping, its linear schedule with warmup; with gradient accumulation and
/// DataLoader workers, with `max_steps` ending mid-epoch, and a T5 on the Seq2SeqTrainer; an
/// evaluation every epoch gives the same loss (each rank evaluates the whole set).
#[test]
fn the_converted_script_trains_as_the_stock_trainer_does() {
    let python = python_or_skip!("the_converted_script_trains_as_the_stock_trainer_does");
    let dir = tempfile::tempdir().unwrap();
    for (run, flags) in [
        &["--epochs", "2", "--evaluate"][..],
        &["--epochs", "2", "--accumulate", "2", "--workers", "1"][..],
        &["--max-steps", "5", "--average-tokens", "no"][..],
        &["--epochs", "1", "--seq2seq"][..],
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
            "{flags:?}: trainctl.hf against the stock Trainer"
        );
        // The job's own records: every step, and the epoch's sample digest.
        assert!(
            dir.path()
                .join(&elastic_out)
                .join("local/metrics/rank-0.jsonl")
                .is_file(),
            "{flags:?}: the job's records in OUTPUT_DIR/RUN_ID"
        );
    }
}

/// What the integration cannot make exact is refused when the Trainer is made, before
/// anything trains, with what to do: a stream of samples (no index to re-shard or count by),
/// the stock TrainingArguments (whose accelerate state starts a process group of its own), a
/// dropped last batch; and the Trainer's own checkpoints, which resume by a count of batches.
#[test]
fn what_cannot_be_made_exact_is_refused_saying_what_to_do() {
    let python = python_or_skip!("what_cannot_be_made_exact_is_refused_saying_what_to_do");
    let dir = tempfile::tempdir().unwrap();
    for (flags, says) in [
        (&["--iterable"][..], "Give a map-style dataset"),
        (
            &["--stock-arguments"][..],
            "use trainctl.hf.TrainingArguments",
        ),
        (&["--drop-last"][..], "dataloader_drop_last=True"),
        (
            &["--resume-from", "checkpoint-4"][..],
            "Drop resume_from_checkpoint",
        ),
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
