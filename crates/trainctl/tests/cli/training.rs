//! Training through `trainctl run`: learning, agreement between ranks, checkpoints, resume.

use std::time::Duration;

use crate::support::*;

#[test]
fn two_local_workers_learn_agree_and_save_an_evaluable_model() {
    let job = Job::new(320, 100);
    let logs = job.path("logs");
    let out = run_ok(
        trainctl()
            .args([
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--log-dir",
                logs.to_str().unwrap(),
            ])
            .args(train_args(&job, "runs", 3)),
    );
    let stdout = text(&out.stdout);

    let loss = losses(&stdout);
    assert_eq!(
        loss.len(),
        3 * 5,
        "one loss line per step (320 images / 2 ranks / 32):\n{stdout}"
    );
    let (first, last) = (
        loss[..3].iter().sum::<f32>(),
        loss[loss.len() - 3..].iter().sum::<f32>(),
    );
    assert!(last < first * 0.8, "loss must fall: {loss:?}");

    let finished = finished(&stdout);
    assert_eq!(finished.len(), 2, "{stdout}");
    assert_eq!(finished[0].1, 15);
    assert_eq!(
        finished[0].2, finished[1].2,
        "ranks must end with identical weights"
    );

    let model = job.path("runs/local/model.safetensors");
    assert!(exists(&model) && exists(&job.path("runs/local/checkpoint.ckpt")));
    assert!(
        stdout
            .lines()
            .all(|l| l.starts_with("[0]:") || l.starts_with("[1]:")),
        "{stdout}"
    );
    assert!(exists(&logs.join("local/attempt_0/0/stdout.log")));
    assert!(logs.join("local/attempt_0/1/stderr.log").is_file());

    // The training run's own evaluation and `trainctl eval` agree on the same model and data.
    let trained_report: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[0]:"))
        .filter(|l| l.starts_with("Accuracy") || l.starts_with("Top-5"))
        .collect();
    assert_eq!(trained_report.len(), 12, "{stdout}");
    let out = run_ok(trainctl().args([
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        job.data().to_str().unwrap(),
        "--batch-size",
        "4",
    ]));
    let eval = text(&out.stdout);
    assert_eq!(eval.lines().collect::<Vec<_>>(), trained_report);
    assert!(eval.contains("Accuracy for class: plane is"), "{eval}");
    // Its progress in plain lines (a test job's pod log says it is at work), once a tenth.
    let said = text(&out.stderr);
    let tenths: Vec<&str> = said
        .lines()
        .filter(|l| l.starts_with("evaluating: "))
        .collect();
    assert!(tenths.len() >= 5, "{said}");
    assert_eq!(
        tenths.last(),
        Some(&"evaluating: 100 of 100 images (100 %)"),
        "{said}"
    );
}

#[test]
fn an_interrupted_run_resumes_and_takes_the_same_steps() {
    interrupted_run_resumes_exactly(&[]);
}

/// The same in bf16: its kernels are as deterministic, and the checkpoint holds the fp32
/// weights and momentum, so resuming is as exact.
#[test]
fn an_interrupted_bf16_run_resumes_and_takes_the_same_steps() {
    if !std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains("avx512_bf16")) {
        eprintln!("SKIPPED: this CPU has no AVX512_BF16");
        return;
    }
    interrupted_run_resumes_exactly(&["--precision", "bf16"]);
}

fn interrupted_run_resumes_exactly(extra: &[&str]) {
    let job = Job::new(256, 20);
    let mut args = train_args(&job, "a", 2);
    args.extend(["--checkpoint-every".into(), "2".into(), "--no-eval".into()]);
    args.extend(extra.iter().map(|a| a.to_string()));
    let whole = text(&run_ok(two_local_workers().args(&args)).stdout);
    let expected = finished(&whole);
    assert_eq!(expected.len(), 2, "{whole}");

    let mut args_b = train_args(&job, "b", 2);
    args_b.extend(["--checkpoint-every".into(), "2".into(), "--no-eval".into()]);
    args_b.extend(extra.iter().map(|a| a.to_string()));
    let mut first = Running::start(two_local_workers().args(&args_b));
    first.wait_for_line(Duration::from_secs(120), |l| {
        l.contains("checkpoint saved at step 4")
    });
    // The launcher dies without a chance to clean up; its workers must die with it.
    first.kill_launcher(2);

    let resumed = text(&run_ok(two_local_workers().args(&args_b)).stdout);
    assert!(resumed.contains("resuming from checkpoint"), "{resumed}");
    let got = finished(&resumed);
    assert_eq!(
        got.iter().map(|f| f.1).collect::<Vec<_>>(),
        expected.iter().map(|f| f.1).collect::<Vec<_>>()
    );
    assert!(
        losses(&resumed).len() < losses(&whole).len(),
        "the resumed run must not start over"
    );
    assert_eq!(
        got[0].2, expected[0].2,
        "resuming is exact: same weights as the uninterrupted run"
    );
}

/// SIGTERM to the launcher mid-epoch (an eviction, a spot interruption, `job delete`): the
/// workers finish the step they are in, rank 0 checkpoints it, the launcher exits with
/// 128 + SIGTERM saying so, and the rerun resumes at that very step and ends with the
/// uninterrupted run's weights.
#[test]
fn sigterm_mid_epoch_checkpoints_the_step_and_the_rerun_resumes_there() {
    let job = Job::new(256, 20);
    let args_for = |out: &str| two_epochs_no_eval(&job, out);
    let expected = uninterrupted(&args_for("a"));

    let mut first = Running::start(two_local_workers().args(args_for("b")));
    // Mid-epoch, with no checkpoint yet (no --checkpoint-every): all would be lost without it.
    first.wait_for_line(Duration::from_secs(120), |l| l.contains("[1,     2] loss:"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = first.wait(Duration::from_secs(60));
    let output = first.output();
    assert_eq!(status.code(), Some(128 + 15), "{output}");
    assert!(output.contains("saved a checkpoint"), "{output}");
    let taken = losses(&output).len() as u64;
    assert!((2..8).contains(&taken), "{output}");

    let ckpt = job.path("b").join("local").join("checkpoint.ckpt");
    let progress: serde_json::Value = serde_json::from_slice(
        &run_ok(trainctl().arg("checkpoint").arg(&ckpt).arg("--json")).stdout,
    )
    .unwrap();
    assert_eq!(
        progress["global_step"].as_u64(),
        Some(taken),
        "the checkpoint holds the last step taken: {progress}\n{output}"
    );

    let resumed = text(&run_ok(two_local_workers().args(args_for("b"))).stdout);
    assert!(resumed.contains("resuming from checkpoint"), "{resumed}");
    assert_eq!(
        losses(&resumed).len() as u64,
        8 - taken,
        "no step is taken twice or skipped:\n{resumed}"
    );
    assert_eq!(
        finished(&resumed)[0].2,
        expected[0].2,
        "the same weights as the uninterrupted run"
    );

    // Each epoch trained every one of the 256 images exactly once (2 ranks × batch 32 divide
    // it: no padding), the interrupted epoch across both attempts included.
    for out in ["a", "b"] {
        assert_eq!(
            epoch_digests(&job.path(out).join("local")),
            [(1, every_image(256)), (2, every_image(256))],
            "run {out}"
        );
    }
}

/// 256 images, 2 workers × batch 32: 4 steps an epoch, 8 in all, without the evaluation.
fn two_epochs_no_eval(job: &Job, out: &str) -> Vec<String> {
    let mut args = train_args(job, out, 2);
    args.push("--no-eval".into());
    args
}

/// The ranks' finish lines (rank, steps, weights fingerprint) of an uninterrupted standalone
/// run of `args` on two workers.
fn uninterrupted(args: &[String]) -> Vec<(u32, u64, String)> {
    let whole = text(&run_ok(two_local_workers().args(args)).stdout);
    let expected = finished(&whole);
    assert_eq!(expected.len(), 2, "{whole}");
    expected
}

/// A worker killed mid-epoch with no checkpoint due (no `--checkpoint-every`): rank 0, which
/// loses its peer, saves the last step it completed before the restart, so the job goes on from
/// there rather than from the epoch's start, and ends with the uninterrupted run's weights,
/// each epoch having trained every image exactly once.
#[test]
fn a_lost_worker_costs_at_most_the_step_in_flight() {
    let job = Job::new(256, 20);
    let args_for = |out: &str| two_epochs_no_eval(&job, out);
    let expected = uninterrupted(&args_for("a"));

    let out = two_local_workers_one_killed(&args_for("b"), |l| l.contains("[1,     2] loss:"));
    // "resuming from checkpoint: epoch 1, N samples into it, step S (...)"
    let resumed_step: u64 = out
        .lines()
        .find_map(|l| l.split("resuming from checkpoint: epoch 1, ").nth(1))
        .and_then(|rest| rest.split(", step ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|step| step.parse().ok())
        .unwrap_or_else(|| panic!("no resume inside epoch 1:\n{out}"));
    assert!(
        (2..4).contains(&resumed_step),
        "the restart went back to step {resumed_step}, not to the last one completed (2 or 3):\n{out}"
    );
    let done = finished(&out);
    assert_eq!(done.len(), 2, "{out}");
    assert!(done.iter().all(|(_, steps, _)| *steps == 8), "{out}");
    assert_eq!(
        done[0].2, expected[0].2,
        "the same weights as the uninterrupted run:\n{out}"
    );
    assert_eq!(
        epoch_digests(&job.path("b").join("local")),
        [(1, every_image(256)), (2, every_image(256))]
    );
}

/// Each epoch's `samples_digest` as rank 0's metrics recorded it, the last record of an epoch
/// winning (an epoch recorded twice was trained again after a restart).
fn epoch_digests(run_dir: &std::path::Path) -> Vec<(usize, String)> {
    use telemetry::metrics::{Record, rank_file, read_metrics};
    let mut epochs = std::collections::BTreeMap::new();
    for record in read_metrics(&rank_file(run_dir, 0)).unwrap().records {
        if let Record::Epoch(e) = record {
            epochs.insert(e.epoch, e.samples_digest.expect("a digest"));
        }
    }
    epochs.into_iter().collect()
}

#[test]
fn a_corrupt_checkpoint_is_reported_not_used() {
    let job = Job::new(64, 10);
    let ckpt = job.path("ckpt");
    std::fs::write(&ckpt, b"TRAINCTL-CKPT\0v1 but then garbage").unwrap();
    let err = run_failing(
        trainctl()
            .args(train_args(&job, "r", 1))
            .args(["--checkpoint-file", ckpt.to_str().unwrap()]),
    );
    assert!(
        err.contains("checkpoint") && err.contains("not used"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&ckpt).unwrap(),
        b"TRAINCTL-CKPT\0v1 but then garbage",
        "the file is left alone"
    );
}

#[test]
fn a_diverging_run_stops_and_names_the_step() {
    let job = Job::new(128, 10);
    let err = run_failing(trainctl().args(train_args_lr(&job, "r", 3, "1e12")));
    assert!(
        err.contains("loss is") && err.contains("step") && err.contains("--learning-rate"),
        "{err}"
    );
}

#[test]
fn python_layout_trains_and_predict_classifies_images() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    run_ok(trainctl().args([
        "data",
        "synth",
        "--python",
        "--train",
        "64",
        "--test",
        "20",
        "--out",
        data.to_str().unwrap(),
    ]));
    let model = dir.path().join("m.safetensors");
    run_ok(trainctl().args([
        "train",
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--threads",
        "1",
        "--model-file",
        model.to_str().unwrap(),
        "--out",
        dir.path().to_str().unwrap(),
    ]));
    // An image of another size, in both formats.
    let img = image::RgbImage::from_fn(50, 40, |x, y| {
        image::Rgb([(x * 5) as u8, (y * 6) as u8, 128])
    });
    let png = dir.path().join("a.png");
    let jpg = dir.path().join("b.jpg");
    img.save(&png).unwrap();
    img.save(&jpg).unwrap();
    let out = text(
        &run_ok(
            trainctl()
                .args(["predict", "--model", model.to_str().unwrap()])
                .arg(&png)
                .arg(&jpg),
        )
        .stdout,
    );
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(
        out.lines().all(|l| l.matches(" %").count() == 3),
        "top-3 per image: {out}"
    );

    let bad = dir.path().join("bad.png");
    std::fs::write(&bad, b"not an image").unwrap();
    let err = run_failing(
        trainctl()
            .args(["predict", "--model", model.to_str().unwrap()])
            .arg(&bad),
    );
    assert!(err.contains("bad.png"), "{err}");
}

#[test]
fn two_launchers_form_one_static_job() {
    // torchrun's static multi-node mode: two nodes (here both on 127.0.0.1), one worker each.
    let job = Job::new(128, 20);
    let port = launcher::free_port().unwrap();
    let node = |rank: &str| {
        let mut cmd = trainctl();
        cmd.args([
            "run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
        ])
        .args([
            "--master-port",
            &port.to_string(),
            "--rdzv-id",
            "static-job",
        ])
        .env("TRAINCTL_JOB_TOKEN", "shared-secret")
        .args(train_args(&job, &format!("node{rank}"), 1))
        .arg("--no-eval");
        Running::start(&mut cmd)
    };
    let (mut a, mut b) = (node("0"), node("1"));
    assert!(a.wait(Duration::from_secs(120)).success(), "{}", a.output());
    assert!(b.wait(Duration::from_secs(120)).success(), "{}", b.output());
    let (fa, fb) = (finished(&a.output()), finished(&b.output()));
    assert_eq!(
        (fa.len(), fb.len()),
        (1, 1),
        "{}\n{}",
        a.output(),
        b.output()
    );
    assert_eq!((fa[0].0, fb[0].0), (0, 1));
    assert_eq!(fa[0].1, 2, "128 images / (2 ranks x 32) = 2 steps");
    assert_eq!(fa[0].2, fb[0].2, "both nodes end with identical weights");
    assert!(
        exists(&job.path("node0/static-job/model.safetensors")),
        "rank 0 saves the model"
    );
}

#[test]
fn a_killed_worker_is_restarted_and_the_job_resumes_where_it_was() {
    let job = Job::new(256, 20);
    let mut args = train_args(&job, "r", 2);
    args.extend(["--checkpoint-every".into(), "2".into(), "--no-eval".into()]);
    let out = two_local_workers_one_killed(&args, |l| l.contains("checkpoint saved at step 2"));
    assert!(out.contains("restarting all workers (restart 1)"), "{out}");
    assert!(out.contains("resuming from checkpoint"), "{out}");
    // 256 images / (2 ranks x 32) = 4 steps an epoch, 2 epochs: the restart lost nothing and
    // repeated nothing beyond the last checkpoint.
    let done = finished(&out);
    assert_eq!(done.len(), 2, "{out}");
    assert!(done.iter().all(|(_, steps, _)| *steps == 8), "{out}");
    assert_eq!(done[0].2, done[1].2);
}

/// The same command again after a run finished (trained, saved, evaluated) does not resume
/// the finished run and call that a success: it fails at once, saying so and how to train
/// again (`--train-again`) or on (`--epochs`); both of which then work.
#[test]
fn a_finished_run_is_not_resumed_unless_asked() {
    let job = Job::new(64, 16);
    let args = train_args(&job, "runs", 1);
    run_ok(trainctl().args(&args));
    let again = run_failing(trainctl().args(&args));
    assert!(
        again.contains("holds a finished run (1 epochs")
            && again.contains("--train-again")
            && again.contains("raise --epochs"),
        "{again}"
    );
    assert!(!again.contains("resuming from checkpoint"), "{again}");

    let mut on = train_args(&job, "runs", 2);
    let longer = run_ok(trainctl().args(&on));
    assert!(
        text(&longer.stdout).contains("resuming from checkpoint: epoch 2, 0 samples into it"),
        "more epochs train on from the finished run:\n{}",
        text(&longer.stdout)
    );
    on.push("--train-again".into());
    let fresh = run_ok(trainctl().args(&on));
    let said = format!("{}{}", text(&fresh.stdout), text(&fresh.stderr));
    assert!(
        said.contains("--train-again trains from scratch")
            && !said.contains("resuming from checkpoint"),
        "{said}"
    );
}

/// An --out that cannot be written is found before training, not after an epoch, and the
/// error says which folder and which flag to change.
#[test]
fn an_unwritable_out_is_refused_before_training() {
    let job = Job::new(64, 16);
    // A folder under a regular file cannot be made, whoever runs the test (root included).
    std::fs::write(job.path("file"), b"").unwrap();
    let args = train_args(&job, "file/out", 1);
    let out = trainctl().args(&args).output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot write the run's files") && err.contains("--out"),
        "{err}"
    );
    assert!(!text(&out.stdout).contains("loss:"), "nothing was trained");
}

/// `--precision bf16`: two workers in bf16 end with identical weights (the bf16 GEMM is
/// deterministic whatever the thread count), learn the data as well as fp32 does from the same
/// seed (test accuracy within a point), and write an fp32 model file that `trainctl eval`
/// reads. A wrong value is a usage error naming the choices.
#[test]
fn bf16_training_agrees_between_ranks_and_learns_as_fp32_does() {
    let refused = trainctl()
        .args(["train", "--data", "nowhere", "--precision", "fp16"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let err = text(&refused.stderr);
    assert!(
        err.contains("--precision") && err.contains("choose fp32 or bf16"),
        "{err}"
    );
    if !std::process::Command::new("grep")
        .args(["-q", "avx512_bf16", "/proc/cpuinfo"])
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("SKIPPED the bf16 run: this CPU has no AVX512_BF16");
        return;
    }

    let job = Job::new(640, 200);
    let accuracy = |precision: &str| -> (f64, Vec<(u32, u64, String)>, String) {
        let out = run_ok(
            trainctl()
                .args(["run", "--standalone", "--nproc-per-node", "2"])
                .args(train_args(&job, precision, 2))
                .args(["--precision", precision]),
        );
        let stdout = text(&out.stdout);
        let loss = losses(&stdout);
        assert!(
            loss[loss.len() - 3..].iter().sum::<f32>() < loss[..3].iter().sum::<f32>() * 0.8,
            "{precision}: the loss must fall: {loss:?}"
        );
        let accuracy = stdout
            .lines()
            .find_map(|l| {
                l.split("Accuracy of the network on the 200 test images: ")
                    .nth(1)
            })
            .and_then(|a| a.trim_end_matches(" %").trim().parse().ok())
            .unwrap_or_else(|| panic!("no accuracy in\n{stdout}"));
        (accuracy, finished(&stdout), stdout)
    };
    let (fp32, fp32_finished, _) = accuracy("fp32");
    let (bf16, finished, stdout) = accuracy("bf16");
    assert_eq!(finished.len(), 2, "{stdout}");
    assert_eq!(
        finished[0].2, finished[1].2,
        "bf16 ranks must end with identical weights"
    );
    // From the same seed and data, only the arithmetic differs: so must the weights.
    assert_ne!(
        finished[0].2, fp32_finished[0].2,
        "the bf16 run computed in fp32"
    );
    let metrics = std::fs::read_to_string(job.path("bf16/local/metrics/rank-0.jsonl")).unwrap();
    assert!(
        metrics
            .lines()
            .next()
            .unwrap()
            .contains(r#""precision":"bf16""#),
        "the run records its precision: {}",
        metrics.lines().next().unwrap()
    );
    assert!(
        bf16 >= fp32 - 1.0,
        "bf16 reached {bf16} % where fp32 reached {fp32} %"
    );

    // The model file is fp32, as every reader of it expects.
    let model = job.path("bf16/local/model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
    assert!(
        header.contains("\"F32\"") && !header.contains("BF16"),
        "{header}"
    );
    let eval = run_ok(trainctl().args([
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        job.data().to_str().unwrap(),
    ]));
    assert!(
        text(&eval.stdout).contains(&format!("{bf16:.1} %")),
        "eval of the bf16 model: {}\ntraining said {bf16} %",
        text(&eval.stdout)
    );
}
