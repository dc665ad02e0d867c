//! The loops PyTorch users write, converted to `trainctl.torch`, against the same loops in
//! plain DDP (fixtures/loop_patterns.py): with nothing failing, the two end with bit-identical
//! weights, learning rates and scheduler places, and print the same evaluations; the loops the
//! package cannot make exact are refused at once, saying what to do; and a run resumes the way
//! users resume. (The same loops through kills, joins and leaves: `elastic::patterns`.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::*;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/loop_patterns.py")
}

/// The patterns loop on two local workers under `trainctl run`, in `dir` (its data in
/// `dir/data`).
fn two_workers(python: &Path, dir: &Path, flags: &[&str]) -> Command {
    two_workers_run(python, dir, &[], flags)
}

/// [`two_workers`], with more of `trainctl run`'s flags (`run`).
fn two_workers_run(python: &Path, dir: &Path, run: &[&str], flags: &[&str]) -> Command {
    let mut cmd = trainctl();
    cmd.current_dir(dir)
        .env("PYTHONPATH", testkit::python_package())
        .args(["run", "--standalone", "--nproc-per-node", "2"])
        .args(run)
        .arg("--")
        .arg(python)
        .arg(fixture())
        .args(flags);
    cmd
}

/// The loop alone: no launcher, a world of one.
fn alone(python: &Path, dir: &Path, flags: &[&str]) -> Command {
    let mut cmd = Command::new(python);
    cmd.current_dir(dir)
        .env("PYTHONPATH", testkit::python_package())
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("TORCHELASTIC_RUN_ID")
        .arg(fixture())
        .args(flags);
    cmd
}

/// The lines both loops print for the comparison: rank 0's evaluations and every rank's end,
/// without the launcher's `[R]:` prefix, sorted by rank.
fn outcome(out: &Output) -> Vec<String> {
    let all = text(&out.stdout);
    let mut lines: Vec<String> = all
        .lines()
        .filter_map(|l| {
            let l = l.split_once("]:").map_or(l, |(_, rest)| rest);
            (l.starts_with("PATTERNS ") || l.starts_with("EVAL ")).then(|| l.to_string())
        })
        .collect();
    lines.sort();
    lines
}

macro_rules! python_or_skip {
    ($name:expr) => {
        match testkit::python_with_torch() {
            Some(p) => p,
            None => {
                eprintln!(
                    "SKIPPED {}: no Python with torch (scripts/test installs it; or set TRAINCTL_TEST_PYTHON)",
                    $name
                );
                return;
            }
        }
    };
}

/// With nothing failing, each pattern trains as plain DDP does, bit for bit: the same sample
/// order (DistributedSampler's), the gradients all-reduced once per update (accumulation),
/// the GradScaler's skipped and applied steps, a per-step or per-epoch scheduler stepped as
/// often, DataLoader workers, the same evaluation, an EMA (torch's AveragedModel updated after
/// every block, micro-batches included: the job gates it; one of the loop's own, updated `if
/// step.applied`) and a head the loss never uses (`find_unused_parameters`).
#[test]
fn each_pattern_trains_as_plain_ddp_does() {
    let python = python_or_skip!("each_pattern_trains_as_plain_ddp_does");
    let job = Job::new(160, 32);
    let common = ["--epochs", "2", "--data", "data"];
    for (run, flags) in [
        &EVERY_PATTERN[..],
        &["--scheduler", "plateau", "--accumulate", "3", "--evaluate"][..],
        &["--scheduler", "steplr", "--ema", "own", "--unused-head"][..],
    ]
    .into_iter()
    .enumerate()
    {
        // A run of its own each (the same folder would resume the last one's checkpoint).
        let out = format!("runs-{run}");
        let args: Vec<&str> = common
            .iter()
            .chain(flags)
            .copied()
            .chain(["--out", &out])
            .collect();
        let plain = run_ok(two_workers(&python, job.dir.path(), &args).arg("--plain"));
        let elastic = run_ok(&mut two_workers(&python, job.dir.path(), &args));
        let (plain, elastic) = (outcome(&plain), outcome(&elastic));
        assert_eq!(
            plain.len(),
            2 + flags.contains(&"--evaluate") as usize * 2,
            "{flags:?}: {plain:?}"
        );
        assert_eq!(
            elastic, plain,
            "{flags:?}: trainctl.torch against plain DDP"
        );
    }
}

/// The loops that would train a wrong model without a word are refused with what to do: run
/// alone (no launcher: a world of one, which also shows such a loop runs without one), and
/// the ranks' own divergence under `trainctl run`.
#[test]
fn loops_the_package_cannot_make_exact_are_refused() {
    let python = python_or_skip!("loops_the_package_cannot_make_exact_are_refused");
    let job = Job::new(64, 16);
    for (misuse, said) in [
        (
            "own-step",
            "optimizer.step() was called by the training loop: with trainctl.torch the job steps the optimizer",
        ),
        (
            "no-sync",
            "this step's gradients were not all-reduced: its backward ran under no_sync()",
        ),
        (
            "stray-scaler",
            "a GradScaler that was not given to Elastic scales the loss",
        ),
        (
            "stray-scheduler",
            "an LR scheduler was made for this optimizer but not given to Elastic: pass it as Elastic(..., scheduler=scheduler)",
        ),
        (
            "scheduler-inside",
            "scheduler.step() inside `with job.step():`",
        ),
        (
            "read-ahead",
            "the next batch was asked for before this one was trained: a DataLoader with worker processes reads job.batches() ahead",
        ),
    ] {
        let flags = [
            "--scheduler",
            "onecycle",
            "--misuse",
            misuse,
            "--out",
            misuse,
        ];
        // Alone, the worker's own exit: the code no launcher retries.
        let err = run_failing_with(&mut alone(&python, job.dir.path(), &flags), 76);
        assert!(
            err.contains(&format!("trainctl.torch.UsageError: {said}")),
            "{misuse}: {err}"
        );
    }
    for (misuse, said) in [
        ("diverge-weights", "  weights: rank 0: "),
        ("diverge-lr", "  lr: rank 0: "),
    ] {
        let flags = ["--data", "data", "--misuse", misuse, "--out", misuse];
        let err = run_failing(&mut two_workers(&python, job.dir.path(), &flags));
        assert!(
            err.contains("trainctl.torch.DivergedError: the ranks no longer hold the same training state at step ")
                && err.contains(said)
                && err.contains("The job stops here: training on would give a wrong model."),
            "{misuse}: {err}"
        );
    }
}

/// The loops adopters wrote that the package cannot make exact (issue 67), under `trainctl
/// run --max-restarts 3`: each is refused with its own cause, and the job fails at once, not
/// retried (the worker's exit 76), the refusal whole in the launcher's report: an EMA kept
/// without giving it, a GAN's second optimizer, state kept on rank 0 alone, a forgotten
/// `find_unused_parameters`, two Elastic jobs in one process, an IterableDataset.
#[test]
fn adopters_loops_that_cannot_be_made_exact_fail_the_job_at_once() {
    let python = python_or_skip!("adopters_loops_that_cannot_be_made_exact_fail_the_job_at_once");
    let job = Job::new(64, 16);
    for (misuse, said) in [
        (
            "stray-ema",
            "UsageError: an AveragedModel holding a copy of the model's parameters changes during training but was not given to Elastic",
        ),
        (
            "gan",
            "UsageError: a second optimizer (Adam over 2 parameter tensors) was stepped by the training loop",
        ),
        (
            "rank-state",
            "DivergedError: the ranks no longer hold the same training state",
        ),
        (
            "forgot-find-unused",
            "UsageError: this step's gradients were not all-reduced: 2 parameter(s) received no gradient (aux.weight, aux.bias)",
        ),
        (
            "two-elastic",
            "UsageError: a second Elastic was made in this process while the first one trains",
        ),
        (
            "iterable",
            "UsageError: job.loader() was given an IterableDataset (Stream)",
        ),
    ] {
        let flags = ["--data", "data", "--misuse", misuse, "--out", misuse];
        let err = run_failing(&mut two_workers_run(
            &python,
            job.dir.path(),
            &["--max-restarts", "3"],
            &flags,
        ));
        assert!(
            err.contains(&format!("trainctl.torch.{said}")),
            "{misuse}: {err}"
        );
        assert!(
            err.contains("not retried: the program found it cannot train right (exit 76)"),
            "{misuse}: {err}"
        );
        assert!(
            err.contains(&format!("  error      : {said}")),
            "{misuse}: {err}"
        );
        assert!(!err.contains("restarting all workers"), "{misuse}: {err}");
    }
}

/// A DivergedError in an elastic job fails the job on every node at once, whatever
/// --max-restarts allows: both agents exit 1 with it as the root cause, and neither restarts
/// its workers (the bug: the agent restarted them from the checkpoint and the job ended 0).
#[test]
fn a_divergence_fails_an_elastic_job_on_every_node_unretried() {
    let python = python_or_skip!("a_divergence_fails_an_elastic_job_on_every_node_unretried");
    let job = Job::new(64, 16);
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let flags = ["--epochs", "2", "--misuse", "diverge-lr"];
    let run = ["--nnodes", "2", "--max-restarts", "3"];
    let agent = || {
        Running::start(&mut agent_command(
            &python, &job, &endpoint, "diverged", &run, &flags,
        ))
    };
    let (mut a, mut b) = (agent(), agent());
    let (a_status, b_status) = (
        a.wait(Duration::from_secs(120)),
        b.wait(Duration::from_secs(60)),
    );
    let (said_a, said_b) = (a.output(), b.output());
    for (status, said) in [(a_status, &said_a), (b_status, &said_b)] {
        assert_eq!(status.code(), Some(1), "{said_a}\n---\n{said_b}");
        assert!(
            said.contains(
                "DivergedError: the ranks no longer hold the same training state at step "
            ),
            "{said_a}\n---\n{said_b}"
        );
        assert!(
            said.contains("  lr: rank 0: ") && said.contains("not retried"),
            "the root cause whole, on every node:\n{said_a}\n---\n{said_b}"
        );
        assert!(
            !said.contains("restarting") && !said.contains("resuming from"),
            "{said_a}\n---\n{said_b}"
        );
    }
}

/// A node that joins while the others are at a step followed by an evaluation (a mid-epoch
/// evaluation after every step) waits for that evaluation: no rank skips it, and the loop's
/// unguarded use of its result (`loss, _ = job.evaluate(...)`) never meets a None (the bug: a
/// join there made every rank skip it, and the job failed on every retry).
#[test]
fn a_join_at_a_mid_epoch_evaluation_waits_for_it_and_no_rank_skips_it() {
    let python =
        python_or_skip!("a_join_at_a_mid_epoch_evaluation_waits_for_it_and_no_rank_skips_it");
    let job = Job::new(64, 16);
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    // A, alone, steps slowly: B (which starts its workers warm first) joins before A ends.
    let flags = ["--epochs", "6", "--eval-every", "1", "--slow-below", "2:1"];
    let mut a = one_of_two_agents(&python, &job, &endpoint, "mid-eval", &flags);
    a.wait_for_line(Duration::from_secs(120), |l| l.contains("[1,"));
    let mut b = one_of_two_agents(&python, &job, &endpoint, "mid-eval", &flags);
    let (a_status, b_status) = (
        a.wait(Duration::from_secs(300)),
        b.wait(Duration::from_secs(120)),
    );
    let (said_a, said_b) = (a.output(), b.output());
    assert!(
        a_status.success() && b_status.success(),
        "{said_a}\n---\n{said_b}"
    );
    assert!(
        said_a.contains("regrouped in place: world size 1 → 2"),
        "B joined A in place:\n{said_a}"
    );
    assert!(
        !said_a.contains("skips an evaluation") && !said_b.contains("skips an evaluation"),
        "{said_a}\n---\n{said_b}"
    );
}

/// With no launcher the loop is a group of one: its collectives (its evaluation's all_reduce)
/// work, and two runs of it end with the same weights.
#[test]
fn a_loop_runs_alone_with_its_collectives() {
    let python = python_or_skip!("a_loop_runs_alone_with_its_collectives");
    let job = Job::new(64, 16);
    let flags = [
        "--scheduler",
        "onecycle",
        "--evaluate",
        "--epochs",
        "2",
        "--out",
    ];
    let first = run_ok(alone(&python, job.dir.path(), &flags).arg("first"));
    let second = run_ok(alone(&python, job.dir.path(), &flags).arg("second"));
    let (first, second) = (outcome(&first), outcome(&second));
    assert!(
        first.iter().any(|l| l.starts_with("EVAL epoch 1 ")),
        "{first:?}"
    );
    assert!(
        first
            .iter()
            .any(|l| l.starts_with("PATTERNS rank 0 world 1 ")),
        "{first:?}"
    );
    assert_eq!(first, second);
}

/// A run resumes the way users resume: under torchrun's `--standalone`, whose run id is new at
/// every launch, the checkpoint is `OUT/local/`'s and a relaunch resumes from it; a run seeded
/// from a checkpoint of the user's own (loaded by the loop, `start_epoch=` given) trains on as
/// the plain loop that wrote it would have; and that checkpoint given to the package as its
/// own is refused, saying how to start from it.
#[test]
fn runs_resume_the_way_users_resume() {
    let python = python_or_skip!("runs_resume_the_way_users_resume");
    let job = Job::new(96, 16);
    let torchrun = |epochs: &str| {
        let mut cmd = Command::new(&python);
        cmd.current_dir(job.dir.path())
            .env("PYTHONPATH", testkit::python_package())
            .args([
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
            ])
            .arg(fixture())
            .args(["--scheduler", "steplr", "--epochs", epochs]);
        run_ok(&mut cmd)
    };
    torchrun("1");
    assert!(job.path("runs/local/checkpoint.pt").is_file());
    let again = torchrun("2");
    let said = format!("{}{}", text(&again.stdout), text(&again.stderr));
    assert!(
        said.contains("resuming from") && said.contains("epoch 2, step "),
        "{said}"
    );

    // Plain DDP for one epoch saves its own checkpoint; the package's loop starts from it at
    // epoch 1 and ends where plain DDP's two epochs end.
    let flags = ["--scheduler", "steplr", "--data", "data", "--out", "seeded"];
    let two =
        run_ok(two_workers(&python, job.dir.path(), &flags).args(["--plain", "--epochs", "2"]));
    run_ok(two_workers(&python, job.dir.path(), &flags).args([
        "--plain",
        "--epochs",
        "1",
        "--save-own",
        "own.pt",
    ]));
    let seeded = run_ok(two_workers(&python, job.dir.path(), &flags).args([
        "--epochs",
        "2",
        "--start-from",
        "own.pt",
    ]));
    let ends = |o: &Output| -> Vec<String> {
        // The steps count from where each run began: the rest is compared.
        outcome(o)
            .iter()
            .filter_map(|l| {
                Some(
                    l.strip_prefix("PATTERNS ")?
                        .split_once(" lr ")?
                        .1
                        .to_string(),
                )
            })
            .collect()
    };
    assert_eq!(
        ends(&seeded),
        ends(&two),
        "seeded from the plain loop's epoch-1 checkpoint"
    );

    // A UsageError: the exit code no launcher retries.
    let err = run_failing_with(
        &mut alone(
            &python,
            job.dir.path(),
            &["--epochs", "1", "--checkpoint", "own.pt"],
        ),
        76,
    );
    assert!(
        err.contains("own.pt is not a trainctl.torch checkpoint (it holds epoch, model, optimizer, scheduler): to start from a checkpoint of your own, load it into the model and optimizer")
            && err.contains("pass start_epoch=THE_EPOCH_IT_REACHED"),
        "{err}"
    );
}

/// The package's own unit tests (python/tests: the flow of a rank that came into a group, the
/// epoch's plan, the safety net's slots and message, the guards), with the standard library's
/// unittest and this Python's torch.
#[test]
fn the_packages_unit_tests_pass() {
    let python = python_or_skip!("the_packages_unit_tests_pass");
    let package = testkit::python_package();
    let out = Command::new(&python)
        .current_dir(&package)
        .env("PYTHONPATH", &package)
        .args(["-m", "unittest", "discover", "-s", "tests"])
        .output()
        .unwrap();
    let said = text(&out.stderr);
    assert!(out.status.success(), "{said}");
    let ran: usize = said
        .split("Ran ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(ran >= 15, "{said}");
}

/// The package's type hints hold: mypy (from PyPI, scripts/requirements-test.txt) with the
/// settings of python/pyproject.toml (every function annotated) finds nothing. Where the
/// suite's Python has no mypy, the test says so and passes.
#[test]
fn the_package_type_checks() {
    let python = python_or_skip!("the_package_type_checks");
    let package = testkit::python_package();
    let has_mypy = Command::new(&python)
        .args(["-c", "import mypy"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_mypy {
        eprintln!(
            "SKIPPED the_package_type_checks: no mypy in {python:?} (scripts/test installs it)"
        );
        return;
    }
    let out = Command::new(&python)
        .current_dir(&package)
        .args(["-m", "mypy", "-p", "trainctl"])
        .output()
        .unwrap();
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}{}", text(&out.stderr));
    assert!(said.contains("Success: no issues found"), "{said}");
}

/// README's whole program ("Your own PyTorch program, elastic"), as written, on two workers:
/// every name it uses is defined, and it trains to the end with every rank's weights the same.
#[test]
fn readmes_program_runs_as_written() {
    let python = python_or_skip!("readmes_program_runs_as_written");
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let program = readme
        .split("A whole program, with what real loops have")
        .nth(1)
        .and_then(|rest| rest.split("```python\n").nth(1))
        .and_then(|block| block.split("```").next())
        .expect("README's program");
    let job = Job::new(256, 32);
    std::fs::write(job.path("program.py"), program).unwrap();
    let paths =
        std::env::join_paths([testkit::python_package(), repo.join("examples/pytorch")]).unwrap();
    let out = run_ok(
        trainctl()
            .current_dir(job.dir.path())
            .env("PYTHONPATH", paths)
            .args(["run", "--standalone", "--nproc-per-node", "2", "--"])
            .arg(&python)
            .arg("program.py"),
    );
    let said = text(&out.stdout);
    assert!(said.contains("[0]:epoch 9: test accuracy "), "{said}");
    let ends = finished(&said);
    assert_eq!(ends.len(), 2, "{said}");
    assert_eq!(ends[0].2, ends[1].2, "{said}");
}

/// Issue 60, item 9: a node whose worker has finished training (its `finish()` returned, the
/// program's own end still running) is not restarted when the other node dies afterwards: its
/// worker told the agent training is over, so the agent waits for it to exit and ends 0. (It
/// used to form a new round and start the worker again, which "resumed" the finished run.)
#[test]
fn a_finished_worker_is_not_restarted_when_a_peer_dies_afterwards() {
    let python = python_or_skip!("a_finished_worker_is_not_restarted_when_a_peer_dies_afterwards");
    let job = Job::new(64, 16);
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let flags = ["--epochs", "1", "--linger", "4"];
    let agent = || one_of_two_agents(&python, &job, &endpoint, "finished", &flags);
    let mut a = agent();
    let mut b = agent();
    a.wait_for_line(Duration::from_secs(300), |l| l.contains("LINGER rank"));
    b.wait_for_line(Duration::from_secs(60), |l| l.contains("LINGER rank"));
    b.child.kill().unwrap();
    let status = a.wait(Duration::from_secs(120));
    let said = a.output();
    assert!(status.success(), "{said}");
    assert_eq!(
        said.matches("finished after").count(),
        1,
        "the worker finished once, and was not started again:\n{said}"
    );
    for restarted in ["restarting the workers", "resuming", "new rendezvous round"] {
        assert!(!said.contains(restarted), "{restarted}:\n{said}");
    }
}

/// Issue 60, item 10: a node that arrives while the first round's workers are still starting
/// (a PyTorch program's imports) is taken in place once they can regroup, instead of costing
/// them a restart: agent A forms a round of one, B arrives while A's worker starts (6 s), and
/// A's worker, never restarted, regroups 1 → 2 with B's.
#[test]
fn a_joiner_while_the_first_workers_start_is_taken_in_place() {
    let python = python_or_skip!("a_joiner_while_the_first_workers_start_is_taken_in_place");
    joiner_while_a_starts(&python, "starting", "--slow-start");
}

/// The first group's round ends while that group starts: agent A's worker said it regroups in
/// place, then its first `init_process_group` takes 6 s more; B, which arrived meanwhile, is
/// admitted at once, and A's worker is handed round 1 mid-start. The failed first start is a
/// regroup's failed start: the worker waits for the round and takes it in place (before, it
/// died: "a collective outside `with job.step():` ... lost a peer", and the job failed).
#[test]
fn a_joiner_while_the_first_group_starts_is_taken_in_place() {
    let python = python_or_skip!("a_joiner_while_the_first_group_starts_is_taken_in_place");
    let said_a = joiner_while_a_starts(&python, "first-group", "--slow-first-group");
    assert!(
        said_a.contains("the first group's round ended as it started"),
        "A's first start was overtaken by B's round:\n{said_a}"
    );
}

/// Agent A forms a round of one, its worker's start slowed by 6 s (`slow`: the fixture's flag);
/// B arrives meanwhile. Both must finish, B taken in place by A's worker, never restarted.
/// Returns A's output.
fn joiner_while_a_starts(python: &Path, id: &str, slow: &str) -> String {
    let job = Job::new(64, 16);
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let flags = ["--epochs", "8", slow, "6", "--step-sleep", "0.05"];
    let agent = || one_of_two_agents(python, &job, &endpoint, id, &flags);
    let mut a = agent();
    a.wait_for_line(Duration::from_secs(60), |l| {
        l.contains("round 0: node rank 0 of 1")
    });
    let mut b = agent();
    let (a_status, b_status) = (
        a.wait(Duration::from_secs(300)),
        b.wait(Duration::from_secs(120)),
    );
    let (said_a, said_b) = (a.output(), b.output());
    assert!(
        a_status.success() && b_status.success(),
        "{said_a}\n---\n{said_b}"
    );
    assert!(
        !said_a.contains("restarting the workers"),
        "A's starting workers were not restarted:\n{said_a}"
    );
    assert!(
        said_a.contains("regrouped in place: world size 1 → 2"),
        "B was taken in place:\n{said_a}"
    );
    said_a
}

/// One of two agents (`--nnodes 1:2`, c10d on loopback at `endpoint`) running the patterns
/// loop with `flags` in `job`'s folder.
fn one_of_two_agents(
    python: &Path,
    job: &Job,
    endpoint: &str,
    id: &str,
    flags: &[&str],
) -> Running {
    Running::start(&mut agent_command(
        python,
        job,
        endpoint,
        id,
        &["--nnodes", "1:2"],
        flags,
    ))
}

/// An agent (c10d on loopback at `endpoint`, `run`: more of `trainctl run`'s flags) running the
/// patterns loop with `flags` in `job`'s folder.
fn agent_command(
    python: &Path,
    job: &Job,
    endpoint: &str,
    id: &str,
    run: &[&str],
    flags: &[&str],
) -> Command {
    let mut cmd = trainctl();
    cmd.current_dir(job.dir.path())
        .env("PYTHONPATH", testkit::python_package())
        .args(["run", "--rdzv-backend", "c10d"])
        .args(run)
        .args(["--rdzv-endpoint", endpoint, "--rdzv-id", id])
        .args(["--health-check", "off", "--"])
        .arg(python)
        .arg(fixture())
        .args(["--data", "data", "--out", "runs"])
        .args(flags);
    cmd
}
