//! A real PyTorch DDP script under `trainctl run`: the environment contract is torchrun's.
//!
//! Needs a Python with torch: `TRAINCTL_TEST_PYTHON`, or `bench/.venv` (made by `bench/run.sh`).
//! Without one the test says so loudly and passes, since PyTorch is a multi-GB download that the
//! default suite does not make.

use std::path::PathBuf;

use crate::support::*;

#[allow(clippy::disallowed_methods)] // a test knob, not the worker contract
fn python_with_torch() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("TRAINCTL_TEST_PYTHON").map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/.venv/bin/python")),
    ];
    candidates.into_iter().flatten().find(|p| {
        std::process::Command::new(p)
            .args(["-c", "import torch.distributed, safetensors"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn a_pytorch_ddp_script_runs_under_trainctl() {
    let Some(python) = python_with_torch() else {
        eprintln!(
            "SKIPPED a_pytorch_ddp_script_runs_under_trainctl: no Python with torch (set TRAINCTL_TEST_PYTHON or run bench/run.sh)"
        );
        return;
    };
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/ddp_allreduce.py");
    let out = run_ok(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "2", "--"])
            .arg(python)
            .arg(script),
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("[0]:ddp rank 0/2 local 0 sum 3"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[1]:ddp rank 1/2 local 1 sum 3"),
        "{stdout}"
    );
}

/// The CPU DDP example (examples/ddp_gloo.py, the program the Kubernetes walk-through runs)
/// trains under `trainctl run`: the loss falls and rank 0 saves the model.
#[test]
fn the_cpu_ddp_example_trains_under_trainctl() {
    let Some(python) = python_with_torch() else {
        eprintln!(
            "SKIPPED the_cpu_ddp_example_trains_under_trainctl: no Python with torch (set TRAINCTL_TEST_PYTHON or run bench/run.sh)"
        );
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/ddp_gloo.py");
    let out_dir = tempfile::tempdir().unwrap();
    let out = run_ok(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "2", "--"])
            .arg(python)
            .arg(script)
            .args(["--epochs", "3", "--out"])
            .arg(out_dir.path()),
    );
    let stdout = text(&out.stdout);
    let losses: Vec<f64> = stdout
        .lines()
        .filter_map(|l| {
            l.split(" loss ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(losses.len(), 3, "{stdout}");
    assert!(losses[2] < losses[0] / 2.0, "{losses:?}\n{stdout}");
    assert!(stdout.contains("world 2"), "{stdout}");
    assert!(out_dir.path().join("model.pt").is_file(), "{stdout}");
}

#[test]
fn pytorch_loads_the_model_file_into_the_seed_network() {
    let Some(python) = python_with_torch() else {
        eprintln!(
            "SKIPPED pytorch_loads_the_model_file_into_the_seed_network: no Python with torch and safetensors (set TRAINCTL_TEST_PYTHON or run bench/run.sh)"
        );
        return;
    };
    let job = Job::new(320, 50);
    let model = job.path("m.safetensors");
    run_ok(
        trainctl()
            .args(["train", "--data"])
            .arg(job.data())
            .args([
                "--epochs",
                "3",
                "--batch-size",
                "32",
                "--threads",
                "1",
                "--no-eval",
                "--model-file",
            ])
            .arg(&model)
            .arg("--out")
            .arg(job.path("runs")),
    );
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = run_ok(
        std::process::Command::new(python)
            .arg(root.join("tests/cli/fixtures/load_in_pytorch.py"))
            .arg(&model)
            .arg(job.data().join("data_batch_1.bin"))
            .arg(root.join("../../bench")),
    );
    let stdout = text(&out.stdout);
    let accuracy: f64 = stdout
        .split("accuracy ")
        .nth(1)
        .and_then(|s| s.trim().trim_end_matches(" %").parse().ok())
        .unwrap();
    assert!(
        accuracy > 50.0,
        "PyTorch computes with the loaded weights what trainctl learned: {stdout}"
    );
}
