//! A Hugging Face Trainer script (fixtures/hf_trainer.py: a GPT-2 made from a config, random
//! tokens, some labels masked) converted to `trainctl.hf` as docs/HUGGINGFACE.md says, under
//! `trainctl run`, against the same script on the stock `transformers.Trainer` under plain
//! torchrun: with nothing failing the two end with
//! bit-identical weights, steps and learning rate, and what the integration cannot make exact is
//! refused at once, saying what to do. (The script through kills and leaves:
//! `elastic::hugging_face`.)

use super::*;

const SCRIPT: &str = "hf_trainer.py";

/// Every rank's `HF rank R world W steps G lr L weights CRC`, sorted by rank.
fn ends(stdout: &[u8]) -> Vec<String> {
    rank_ends(&text(stdout), "HF rank ", " weights ")
}

/// With nothing failing, the converted script trains what the stock Trainer trains, bit for
/// bit: the Trainer's own order (randperm seeded by its seed + epoch, each micro-batch split
/// over the ranks in blocks as accelerate splits it), its loss normalised over every rank's
/// label tokens, its clipping, its linear schedule with warmup; with gradient accumulation and
/// DataLoader workers, with `max_steps` ending mid-epoch, and a T5 on the Seq2SeqTrainer; an
/// evaluation every epoch gives the same loss (each rank evaluates the whole set).
#[test]
fn the_converted_script_trains_as_the_stock_trainer_does() {
    let Some(python) = python_importing(
        "transformers, accelerate",
        "the_converted_script_trains_as_the_stock_trainer_does",
    ) else {
        return;
    };
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
    let Some(python) = python_importing(
        "transformers, accelerate",
        "what_cannot_be_made_exact_is_refused_saying_what_to_do",
    ) else {
        return;
    };
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
        assert_refused(
            &mut on_two_workers(&python, dir.path(), SCRIPT, flags),
            flags,
            says,
        );
    }
}
