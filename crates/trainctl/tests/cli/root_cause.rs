//! The root cause of a failed job, on the first screen: what a worker's `@record` wrote to
//! TORCHELASTIC_ERROR_FILE (exception, message, the raising line), the earliest failure rather
//! than the first exit, the same block on every node, and in the termination message.
//!
//! The worker here writes its error file as torch's `ErrorHandler` does, without torch
//! (fixtures/records_like_torch.py), so these run in every suite; pytorch.rs runs PyTorch's
//! own `@record` where torch is installed.

use std::path::PathBuf;
use std::time::Duration;

use testkit::{EtcdServer, Network};

use crate::support::*;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/records_like_torch.py")
}

/// The line of the fixture that raises, as the traceback names it.
fn raising_line() -> String {
    let n = line_of(&fixture(), "raise ValueError");
    format!("records_like_torch.py:{n} in load_shard: raise ValueError(f\"bad shard {{n}}\")")
}

/// The number (from 1) of the first line of `file` that contains `needle`.
fn line_of(file: &PathBuf, needle: &str) -> usize {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .position(|l| l.contains(needle))
        .unwrap()
        + 1
}

#[test]
fn a_recorded_exception_is_the_root_cause_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let message = dir.path().join("termination-log");
    let out = run_failing(
        trainctl()
            .env("FAIL_PLAN", "1:0:0")
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--grace-period", "1", "--log-dir"])
            .arg(dir.path().join("logs"))
            .arg("--termination-log")
            .arg(&message)
            .args(["--rdzv-id", "rec", "--", "python3"])
            .arg(fixture()),
    );
    assert!(
        out.contains("trainctl run: rank 1 (pid ")
            && out.contains("failed: ValueError: bad shard 7 at "),
        "{out}"
    );
    assert!(
        out.contains("  rank       : 1 (local rank 1, node 0)"),
        "{out}"
    );
    assert!(
        out.contains("  error      : ValueError: bad shard 7"),
        "{out}"
    );
    assert!(out.contains(&raising_line()), "{out}");
    assert!(
        !out.contains("last lines of stderr"),
        "the error file says why; stderr stays in the log: {out}"
    );
    // torchrun's place for it, and the same report in the termination message.
    let error_file = dir.path().join("logs/rec/attempt_0/1/error.json");
    assert!(error_file.is_file(), "{}", error_file.display());
    let written = std::fs::read_to_string(&message).unwrap();
    assert!(
        written.starts_with("trainctl run: rank 1 (pid "),
        "{written}"
    );
    assert!(written.contains(&raising_line()), "{written}");
}

/// A train command line refused before any worker starts (exit 2): the reason is in the
/// termination message too, where a pod's status shows it (a typo in a job's settings, or
/// `--precision bf16` on a node without AVX512_BF16).
#[test]
fn a_refused_command_line_is_the_termination_message() {
    let dir = tempfile::tempdir().unwrap();
    let message = dir.path().join("termination-log");
    let out = trainctl()
        .args(["run", "--standalone", "--termination-log"])
        .arg(&message)
        .args(["train", "--epochs", "0", "--data"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--epochs 0: must be at least 1"));
    let written = std::fs::read_to_string(&message).unwrap();
    assert_eq!(written, "trainctl run: --epochs 0: must be at least 1\n");
}

/// Rank 0 raises first but takes two seconds to exit (a slow cleanup); rank 1 raises a second
/// later and exits at once. The root cause is rank 0's, by when each recorded its error, not
/// rank 1's, which exited first.
#[test]
fn the_earlier_of_two_failures_is_the_root_cause_not_the_first_exit() {
    let out = run_failing(
        trainctl()
            .env("FAIL_PLAN", "0:0:3,1:1:0")
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--grace-period", "5", "--", "python3"])
            .arg(fixture()),
    );
    assert!(out.contains("rank 0 (pid "), "{out}");
    assert!(
        out.contains("  error      : ValueError: bad shard 6"),
        "{out}"
    );
    assert!(!out.contains("bad shard 7"), "{out}");
}

/// A worker that leaves a broken error file: the report says so and falls back to stderr.
#[test]
fn a_malformed_error_file_is_named_and_stderr_stands_in() {
    let script = r#"if [ "$RANK" = 1 ]; then printf '{"message": ' > "$TORCHELASTIC_ERROR_FILE"; echo "half a record" >&2; exit 4; fi; exec sleep 60"#;
    let out = run_failing(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--grace-period",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]));
    assert!(out.contains("rank 1 (pid "), "{out}");
    assert!(
        out.contains("  error file : ") && out.contains("is not an error file torch writes"),
        "{out}"
    );
    assert!(out.contains("half a record"), "{out}");
}

/// Two hosts (network namespaces), one agent each, rendezvous over c10d (hosted by host 1's
/// agent) or a real etcd on host 0, each running `script` with `extra` flags. Both agents must
/// fail with the same root cause; returns each one's root-cause block.
fn two_hosts_fail(
    backend: &str,
    name: &str,
    script: &PathBuf,
    extra: &[&str],
) -> Option<Vec<String>> {
    let net = match Network::create(3) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("SKIPPED {name}: this kernel or user cannot create network namespaces ({e})");
            return None;
        }
    };
    let etcd = (backend == "etcd")
        .then(|| EtcdServer::start_at(Some(net.host(0)), &net.addr(0), 2379, 2380));
    let endpoint = match &etcd {
        Some(etcd) => etcd.url(),
        None => format!("{}:29400", net.addr(1)),
    };
    let agent = |host: usize| {
        let mut cmd = net.command(host, env!("CARGO_BIN_EXE_trainctl"));
        cmd.env("FAIL_PLAN", "1:1:0")
            .args(["run", "--nnodes", "2", "--nproc-per-node", "1"])
            .args(["--rdzv-backend", backend, "--rdzv-endpoint", &endpoint])
            .args(["--rdzv-id", name, "--job-token", "t", "--grace-period", "1"])
            .args(extra)
            .args(["--", "python3"])
            .arg(script);
        Running::start(&mut cmd)
    };
    let mut agents = [agent(1), agent(2)];
    let mut blocks = Vec::new();
    for a in agents.iter_mut() {
        let status = a.wait(Duration::from_secs(60));
        let out = a.output();
        assert_eq!(status.code(), Some(1), "{out}");
        let block = out
            .split("trainctl run: the job failed; root cause (first failure):\n")
            .nth(1)
            .unwrap_or_else(|| panic!("no root cause: {out}"))
            .to_string();
        blocks.push(block);
    }
    let first: Vec<&str> = blocks.iter().map(|b| b.lines().next().unwrap()).collect();
    assert_eq!(first[0], first[1], "the same root cause on both hosts");
    Some(blocks)
}

/// Rank 1 raises on one host; both hosts print the same root cause, shared through the
/// rendezvous record.
fn both_hosts_print_the_root_cause(backend: &str) {
    let name = format!("{backend}-rootcause");
    let Some(blocks) = two_hosts_fail(backend, &name, &fixture(), &[]) else {
        return;
    };
    for block in blocks {
        assert!(
            block.contains("failed: ValueError: bad shard 7 at "),
            "{block}"
        );
        assert!(block.contains(&raising_line()), "{block}");
    }
}

#[test]
fn c10d_both_hosts_print_the_same_root_cause() {
    both_hosts_print_the_root_cause("c10d");
}

#[test]
fn etcd_both_hosts_print_the_same_root_cause() {
    both_hosts_print_the_root_cause("etcd");
}

fn hang_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/hangs.py")
}

/// The torch-free twin of a DDP hang: rank 0 waits inside loss.backward() (the autograd
/// engine's `_engine_run_backward` in torch/autograd/graph.py, where DDP's gradient all-reduce
/// waits), rank 1 sleeps. The report blames the sleeping rank, not the one waiting for it.
#[test]
fn a_hang_in_ddps_backward_blames_the_rank_that_did_not_come() {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/hang_backward.py");
    let out = run_failing(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--hang-timeout", "3", "--grace-period", "1", "--"])
            .arg("python3")
            .arg(&script),
    );
    let sleep = format!(
        "hang_backward.py:{} in main: time.sleep(3600)",
        line_of(&script, "time.sleep(3600)")
    );
    let hung = out
        .lines()
        .find(|l| l.contains(" hung: no line of output"))
        .unwrap_or_else(|| panic!("no hang line: {out}"));
    assert!(
        hung.contains("; rank 1 at ") && hung.contains(&sleep),
        "the sleeping rank leads: {out}"
    );
    assert!(!hung.contains("; rank 0 at "), "{out}");
    // Rank 0's wait is still in the stacks, as a wait.
    assert!(
        out.contains("torch/autograd/graph.py:") && out.contains("in _engine_run_backward"),
        "{out}"
    );
}

/// Rank 1 sleeps while rank 0 waits for it: with --hang-timeout 3 the hang is declared a few
/// seconds after the last line, the report leads with the sleeping rank and its time.sleep
/// line and names rank 0's all_reduce frame, the stacks are in the log folder, and
/// --max-restarts 1 restarts once before the job fails.
#[test]
fn a_hang_is_declared_with_every_ranks_stack() {
    let dir = tempfile::tempdir().unwrap();
    let script = hang_fixture();
    let started = std::time::Instant::now();
    let mut run = Running::start(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--hang-timeout", "3", "--max-restarts", "1"])
            .args(["--grace-period", "1", "--rdzv-id", "hang", "--log-dir"])
            .arg(dir.path())
            .args(["--", "python3"])
            .arg(&script),
    );
    let restart = run.wait_for_line(Duration::from_secs(30), |l| {
        l.contains("restarting all workers (restart 1)")
    });
    let first_report = started.elapsed();
    let sleep = format!(
        "hangs.py:{} in main: time.sleep(3600)",
        line_of(&script, "time.sleep(3600)")
    );
    assert!(
        restart.contains("ranks 0, 1 hung: no line of output or CPU time for 3 s; rank 1 at "),
        "{restart}"
    );
    assert!(restart.contains(&sleep), "{restart}");
    let status = run.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1));
    let out = run.output();
    let wait = format!(
        "hangs.py:{} in all_reduce: done.wait()",
        line_of(&script, "done.wait()")
    );
    assert!(
        out.contains(
            "exit       : stopped after 3 s without a line of output or CPU time (--hang-timeout)"
        ),
        "{out}"
    );
    assert!(
        out.contains("  stuck      : (innermost frames first)"),
        "{out}"
    );
    assert!(
        out.contains("    rank 0 (pid ") && out.contains(&wait),
        "{out}"
    );
    assert!(out.contains(&sleep), "{out}");
    let stacks = dir.path().join("hang/attempt_1/stacks.txt");
    let text = std::fs::read_to_string(&stacks).unwrap();
    assert!(
        text.contains("thread MainThread") && text.contains(&wait),
        "{text}"
    );
    assert!(
        out.contains(&format!("stacks     : {}", stacks.display())),
        "{out}"
    );
    eprintln!(
        "first hang reported {:.1} s after the start (timeout 3 s)",
        first_report.as_secs_f64()
    );
}

/// A hang across two hosts (c10d, then etcd): each takes its own workers' stacks, and both
/// print the same root cause, the earliest of the two hosts' reports.
fn a_hang_on_two_hosts(backend: &str) {
    let name = format!("{backend}-hang");
    let extra = ["--hang-timeout", "3"];
    let Some(blocks) = two_hosts_fail(backend, &name, &hang_fixture(), &extra) else {
        return;
    };
    for block in blocks {
        let first = block.lines().next().unwrap();
        assert!(
            first.contains(" hung: no line of output or CPU time for 3 s; rank "),
            "{block}"
        );
        assert!(
            block.contains("  stuck      : (innermost frames first)"),
            "{block}"
        );
    }
}

#[test]
fn c10d_a_hang_on_two_hosts_is_reported_the_same_on_both() {
    a_hang_on_two_hosts("c10d");
}

#[test]
fn etcd_a_hang_on_two_hosts_is_reported_the_same_on_both() {
    a_hang_on_two_hosts("etcd");
}

/// torchrun's file-based timers: with TORCHELASTIC_ENABLE_FILE_TIMER=1 the worker that
/// overstays its timer is killed with the signal it asked for, a released one never fires, and
/// the report names the timer's scope.
#[test]
fn an_expired_file_timer_kills_the_worker_and_names_its_scope() {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/timer_like_torch.py");
    let started = std::time::Instant::now();
    let out = run_failing(
        trainctl()
            .env("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--grace-period", "1", "--", "python3"])
            .arg(script),
    );
    assert!(started.elapsed() < Duration::from_secs(50), "{out}");
    assert!(
        out.contains("failed: its timer \"load batch\" expired; the launcher sent SIGKILL"),
        "{out}"
    );
    assert!(
        out.contains("  rank       : 1 (local rank 1, node 0)"),
        "{out}"
    );
    assert!(out.contains("exit       : signal 9 (SIGKILL)"), "{out}");
    assert!(!out.contains("a step that finishes"), "{out}");
}

/// The built-in trainer's steps count as activity (its records on the telemetry pipe), not
/// only its printed lines: a run that prints nothing between epochs is not a hang.
#[test]
fn the_built_in_trainers_steps_keep_a_quiet_run_from_being_a_hang() {
    // An epoch of 3,000 images prints nothing for well over the 10 s allowed (measured: the
    // test fails when the records do not count), while steps come every fraction of a second.
    let job = Job::new(3000, 64);
    let mut args = train_args(&job, "runs", 1);
    let freq = args.iter().position(|a| a == "--print-freq").unwrap() + 1;
    args[freq] = "100000".into();
    let out = run_ok(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--hang-timeout", "10"])
            .args(&args),
    );
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("hung"), "{stderr}");
}

/// A worker that is not Python hangs: the report says where its threads wait in the kernel,
/// and the stacks file says why no Python stack was read.
#[test]
fn a_hung_program_that_is_not_python_is_described_by_its_threads() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_failing(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "1"])
            .args(["--hang-timeout", "2", "--grace-period", "1"])
            .args(["--rdzv-id", "native", "--log-dir"])
            .arg(dir.path())
            .args(["--", "sh", "-c", "echo started && exec sleep 60"]),
    );
    assert!(
        out.contains(
            "trainctl run: rank 0 hung: no line of output or CPU time for 2 s; rank 0 at kernel: "
        ),
        "{out}"
    );
    assert!(
        out.contains("rank 0 (pid ") && out.contains("): kernel: "),
        "{out}"
    );
    let stacks = std::fs::read_to_string(dir.path().join("native/attempt_0/stacks.txt")).unwrap();
    assert!(
        stacks.contains("(native stacks, innermost first)"),
        "{stacks}"
    );
    assert!(stacks.contains("python stacks unavailable: "), "{stacks}");
    assert!(stacks.contains("thread sleep (tid "), "{stacks}");
}

/// Without --log-dir a hang's stacks go beside the temporary folder, named after the whole run
/// id (dots included), and are kept.
#[test]
fn without_a_log_folder_the_stacks_are_kept_in_the_temporary_folder() {
    let out = run_failing(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "1"])
            .args(["--hang-timeout", "2", "--grace-period", "1"])
            .args(["--rdzv-id", "job.v2", "--"])
            .args(["sh", "-c", "echo started && exec sleep 60"]),
    );
    let path = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("stacks     : "))
        .unwrap_or_else(|| panic!("no stacks file: {out}"));
    let name = std::path::Path::new(path)
        .file_name()
        .unwrap()
        .to_string_lossy();
    assert!(
        name.starts_with("trainctl-job.v2-") && name.ends_with("-attempt_0.stacks.txt"),
        "{name}"
    );
    assert!(
        std::fs::read_to_string(path)
            .unwrap()
            .contains("thread sleep (tid ")
    );
    std::fs::remove_file(path).unwrap();
}

/// Starting is not hanging, whatever it prints: workers silent for 5 s before their first line
/// while they use the CPU (a program importing torch, loading a model) are not declared hung
/// by `--hang-timeout 2`. (Issue 68: progress is a line or CPU time, not the first line.)
#[test]
fn a_slow_start_is_not_a_hang() {
    let busy = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 5: pass\nprint('up', flush=True)\ntime.sleep(1)\nprint('done')";
    let out = run_ok(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "1"])
            .args(["--hang-timeout", "2", "--grace-period", "1", "--"])
            .args(["python3", "-c", busy]),
    );
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(all.contains("done") && !all.contains("hung"), "{all}");
}

/// A hang before the first line is a hang: the workers of `fixtures/hangs.py --silent` print
/// nothing (as a DDP program that prints only at its first epoch's end), rank 1 asleep and
/// rank 0 waiting for it; `--hang-timeout 3` names it with rank 1's stuck frame, well before
/// the 300 s a start used to be allowed.
#[test]
fn a_silent_hang_before_the_first_line_is_named() {
    let script = hang_fixture();
    let started = std::time::Instant::now();
    let out = run_failing(
        trainctl()
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args(["--hang-timeout", "3", "--grace-period", "1", "--"])
            .arg("python3")
            .arg(&script)
            .arg("--silent"),
    );
    assert!(started.elapsed() < Duration::from_secs(60), "{out}");
    let sleep = format!(
        "hangs.py:{} in main: time.sleep(3600)",
        line_of(&script, "time.sleep(3600)")
    );
    assert!(
        out.contains("ranks 0, 1 hung: no line of output or CPU time for 3 s; rank 1 at ")
            && out.contains(&sleep),
        "{out}"
    );
}
