//! The launcher with arbitrary programs: environment contract, failures, signals.

use std::collections::HashMap;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;

const ENV_NAMES: &str = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS OMP_NUM_THREADS";

fn env_script() -> String {
    ENV_NAMES
        .split(' ')
        .map(|n| format!("echo {n}=${n};"))
        .collect()
}

/// `rank -> {NAME: value}` from `[rank]:NAME=value` lines.
fn env_by_rank(out: &str) -> HashMap<u32, HashMap<String, String>> {
    let mut map: HashMap<u32, HashMap<String, String>> = HashMap::new();
    for line in out.lines() {
        let Some((rank, rest)) = line.strip_prefix('[').and_then(|l| l.split_once("]:")) else {
            continue;
        };
        let Some((k, v)) = rest.split_once('=') else {
            continue;
        };
        map.entry(rank.parse().unwrap())
            .or_default()
            .insert(k.into(), v.into());
    }
    map
}

#[test]
fn workers_get_torchruns_environment() {
    let out = run_ok(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        &env_script(),
    ]));
    let env = env_by_rank(&text(&out.stdout));
    assert_eq!(env.len(), 3);
    for (rank, vars) in &env {
        assert_eq!(vars["RANK"], rank.to_string());
        assert_eq!(vars["LOCAL_RANK"], rank.to_string());
        assert_eq!(vars["WORLD_SIZE"], "3");
        assert_eq!(vars["LOCAL_WORLD_SIZE"], "3");
        assert_eq!(vars["GROUP_RANK"], "0");
        assert_eq!(vars["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(vars["TORCHELASTIC_RUN_ID"], "local");
        assert_eq!(vars["TORCHELASTIC_RESTART_COUNT"], "0");
        assert_eq!(vars["TORCHELASTIC_MAX_RESTARTS"], "2");
        assert_eq!(vars["OMP_NUM_THREADS"], "1");
        assert_eq!(vars["MASTER_PORT"], env[&0]["MASTER_PORT"]);
        assert_ne!(
            vars["MASTER_PORT"], "29500",
            "--standalone picks a free port"
        );
    }
}

#[test]
fn flags_read_their_pet_twins() {
    let out = run_ok(
        trainctl()
            .env("PET_NPROC_PER_NODE", "2")
            .env("PET_NNODES", "2")
            .env("PET_NODE_RANK", "1")
            .env("PET_MASTER_ADDR", "node-zero")
            .env("PET_MASTER_PORT", "23456")
            .env("PET_RDZV_ID", "job-7")
            .env("TRAINCTL_JOB_TOKEN", "s")
            .args(["run", "--", "sh", "-c", &env_script()]),
    );
    let env = env_by_rank(&text(&out.stdout));
    assert_eq!(
        env.keys()
            .copied()
            .collect::<std::collections::BTreeSet<_>>(),
        [2, 3].into()
    );
    assert_eq!(env[&3]["WORLD_SIZE"], "4");
    assert_eq!(env[&3]["LOCAL_RANK"], "1");
    assert_eq!(env[&3]["GROUP_RANK"], "1");
    assert_eq!(env[&3]["MASTER_ADDR"], "node-zero");
    assert_eq!(env[&3]["MASTER_PORT"], "23456");
    assert_eq!(env[&3]["TORCHELASTIC_RUN_ID"], "job-7");
}

#[test]
fn a_failing_worker_stops_the_others_and_is_reported() {
    let script = r#"if [ "$RANK" = 1 ]; then echo "about to fail" >&2; sleep 0.5; exit 3; fi; exec sleep 60"#;
    let mut run = Running::start(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--grace-period",
        "2",
        "--",
        "sh",
        "-c",
        script,
    ]));
    let status = run.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1));
    let out = run.output();
    assert!(out.contains("root cause (first failure)"), "{out}");
    assert!(
        out.contains("rank       : 1 (local rank 1, node 0)"),
        "{out}"
    );
    assert!(out.contains("exit       : exit code 3"), "{out}");
    assert!(
        out.contains("    [1]:about to fail") || out.contains("    about to fail"),
        "stderr tail in the report: {out}"
    );
    let pids = worker_pids(&run.seen);
    assert_eq!(pids.len(), 3, "{out}");
    for (_, pid) in pids {
        assert!(!alive(pid), "worker {pid} outlived the launcher");
    }
}

#[test]
fn a_killed_training_worker_stops_the_job_with_a_report() {
    let job = Job::new(2000, 10);
    let mut run = Running::start(
        trainctl()
            .args([
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "train",
                "--data",
            ])
            .arg(job.data())
            .args([
                "--epochs",
                "20",
                "--batch-size",
                "16",
                "--print-freq",
                "1",
                "--threads",
                "1",
                "--out",
            ])
            .arg(job.path("runs")),
    );
    run.wait_for_line(Duration::from_secs(120), |l| l.contains("] loss: "));
    let pids = run.wait_for_workers(2, Duration::from_secs(20));
    let (_, victim) = pids.iter().find(|(rank, _)| *rank == 1).copied().unwrap();
    kill(Pid::from_raw(victim), Signal::SIGKILL).unwrap();
    let status = run.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(1));
    let out = run.output();
    assert!(out.contains("rank       : 1"), "{out}");
    assert!(out.contains("signal 9 (SIGKILL)"), "{out}");
    assert!(out.contains(&format!("pid        : {victim}")), "{out}");
    for (_, pid) in pids {
        assert!(!alive(pid), "worker {pid} outlived the launcher");
    }
}

/// When the launcher sees a failed worker and one that exited because it lost that peer
/// (contract::exit::PEER_LOST) in the same poll, the report names the failure, not its consequence.
/// The race behind a bystander named as the root cause: a failing worker closes its links
/// (its peer exits 75 at once) a moment before it exits itself, so a poll can see the peer's
/// exit 75 alone. The report still names the failure, not the bystander.
#[test]
fn a_peer_that_exits_75_first_is_not_the_root_cause() {
    let out = run_failing(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.02",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 75; else sleep 0.6; exit 3; fi",
    ]));
    assert!(
        out.contains("rank       : 0") && out.contains("exit code 3"),
        "{out}"
    );
}

#[test]
fn the_root_cause_is_the_failure_not_the_peer_that_lost_it() {
    // One poll a second: both exits land between two polls.
    let out = run_failing(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "1",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; else sleep 0.4; exit 75; fi",
    ]));
    assert!(out.contains("rank       : 1"), "{out}");
    assert!(out.contains("exit code 3"), "{out}");
}

#[test]
fn ctrl_c_stops_every_worker() {
    let mut run = Running::start(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--grace-period",
        "5",
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 60",
    ]));
    run.wait_for_line(Duration::from_secs(20), |l| l.ends_with("]:ready"));
    run.wait_for_line(Duration::from_secs(20), |l| l.ends_with("]:ready"));
    let pids = run.wait_for_workers(2, Duration::from_secs(20));
    kill(Pid::from_raw(run.child.id() as i32), Signal::SIGINT).unwrap();
    let status = run.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(130));
    for (_, pid) in pids {
        assert!(!alive(pid), "worker {pid} outlived the launcher");
    }
}

#[test]
fn a_worker_with_the_wrong_token_is_refused() {
    let job = Job::new(64, 10);
    let port = launcher::free_port().unwrap();
    let worker = |rank: &str, token: &str| {
        let mut cmd = trainctl();
        cmd.args(["train", "--data"])
            .arg(job.data())
            .args(["--epochs", "1", "--threads", "1", "--out"])
            .arg(job.path("runs"))
            .env("RANK", rank)
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("TRAINCTL_JOB_TOKEN", token)
            .env("TRAINCTL_COLLECTIVE_TIMEOUT", "5");
        Running::start(&mut cmd)
    };
    let mut leader = worker("0", "right");
    let mut intruder = worker("1", "wrong");
    assert_eq!(intruder.wait(Duration::from_secs(30)).code(), Some(1));
    assert!(
        intruder.output().contains("job token mismatch"),
        "{}",
        intruder.output()
    );
    // Rank 0 never gets a peer and gives up within its timeout instead of hanging.
    assert_eq!(leader.wait(Duration::from_secs(30)).code(), Some(1));
    assert!(
        leader.output().contains("did not answer") || leader.output().contains("lost"),
        "{}",
        leader.output()
    );
}

#[test]
fn bad_flags_get_clear_errors() {
    for (args, expect) in [
        (
            vec!["run", "--nproc-per-node", "zero", "--", "true"],
            "--nproc-per-node",
        ),
        (
            vec!["run", "--nnodes", "1:4", "--", "true"],
            "needs --rdzv-endpoint HOST[:PORT]",
        ),
        (
            vec!["run", "--nnodes", "3:2", "--", "true"],
            "MIN (3) is larger",
        ),
        (
            vec!["run", "--rdzv-backend", "etcd-v2", "--", "true"],
            "etcd's v3 API only",
        ),
        (
            vec![
                "run",
                "--nnodes",
                "1:2",
                "--rdzv-endpoint",
                "h:http",
                "--",
                "true",
            ],
            "port \"http\" is not a number",
        ),
        (
            vec![
                "run",
                "--nnodes",
                "1:2",
                "--rdzv-endpoint",
                "127.0.0.1:1",
                "--rdzv-conf",
                "join_timeout=soon",
                "--",
                "true",
            ],
            "join_timeout=\"soon\"",
        ),
        (
            vec![
                "run",
                "--rdzv-backend",
                "static",
                "--nnodes",
                "1:2",
                "--",
                "true",
            ],
            "needs an elastic rendezvous",
        ),
        (
            vec!["run", "--nnodes", "2", "--node-rank", "2", "--", "true"],
            "--node-rank 2",
        ),
        (
            vec!["run", "--nnodes", "2", "--max-restarts", "1", "--", "true"],
            "--max-restarts 1",
        ),
    ] {
        let out = trainctl().args(&args).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "a bad command line: {args:?}: {err}"
        );
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn a_failed_group_is_restarted_up_to_max_restarts() {
    // Rank 1 fails on the first two attempts and succeeds on the third.
    let script = r#"if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" -lt 2 ]; then exit 3; fi; echo "done at restart $TORCHELASTIC_RESTART_COUNT""#;
    let out = run_ok(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        script,
    ]));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        stderr.contains("failed with exit code 3; restarting all workers (restart 1)"),
        "{stderr}"
    );
    assert!(stderr.contains("(restart 2)"), "{stderr}");
    assert!(
        stdout.contains("[0]:done at restart 2") && stdout.contains("[1]:done at restart 2"),
        "{stdout}"
    );
    assert_eq!(
        worker_pids(&stderr.lines().map(String::from).collect::<Vec<_>>()).len(),
        6,
        "3 attempts of 2 workers"
    );

    // One restart allowed, two needed: the job fails and the report says which attempt.
    let stderr = run_failing(trainctl().args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]));
    assert!(
        stderr.contains("(restart 1)") && !stderr.contains("(restart 2)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("root cause") && stderr.contains("(restart count 1)"),
        "{stderr}"
    );
}

#[test]
fn a_port_in_use_is_reported_with_what_to_do() {
    let job = Job::new(64, 10);
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let err = run_failing(
        trainctl()
            .args([
                "run",
                "--nproc-per-node",
                "2",
                "--master-port",
                &port,
                "--collective-timeout",
                "10",
                "train",
                "--data",
            ])
            .arg(job.data())
            .args(["--epochs", "1", "--threads", "1", "--out"])
            .arg(job.path("runs")),
    );
    assert!(
        err.contains("rank       : 0"),
        "rank 0 hosts the store and is the root cause: {err}"
    );
    assert!(
        err.contains(&format!("cannot listen on 0.0.0.0:{port}"))
            && err.contains("--master-port 0"),
        "{err}"
    );
}

/// tracing's own warnings read like the rest of trainctl's output in a pod's log: one plain
/// `trainctl: warning:` line, no timestamp, level column, module path or `key=value`.
#[test]
fn diagnostics_are_plain_lines_like_the_rest_of_the_output() {
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let out = trainctl()
        .args(["run", "--nnodes", "2", "--rdzv-backend", "etcd"])
        .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "plain"])
        .args(["--job-token", "t", "--rdzv-conf", "join_timeout=1"])
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("trainctl: warning: rendezvous store not reachable yet")),
        "{err}"
    );
    assert!(
        !err.contains(" WARN ") && !err.contains("rendezvous::handler"),
        "{err}"
    );
    // The cause in words after the message, not tracing's `error=...` (issue 60, item 11).
    let line = err
        .lines()
        .find(|l| l.contains("not reachable yet"))
        .unwrap();
    assert!(
        !line.contains("error=") && line.contains("waiting ("),
        "{line}"
    );
}

/// A node waiting for the others says so while it waits, with how many joined and how long it
/// still waits, instead of being silent until its join timeout.
#[test]
fn a_join_that_waits_says_what_for_until_it_gives_up() {
    let port = testkit::free_port();
    let out = trainctl()
        .args(["run", "--nnodes", "2", "--rdzv-backend", "c10d"])
        .args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")])
        .args(["--rdzv-id", "alone", "--rdzv-conf", "join_timeout=2"])
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let still: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("trainctl run: still joining round 0 after"))
        .collect();
    assert!(still.len() >= 2, "{err}");
    assert!(
        still[0].contains("1 of at least 2 node(s) here")
            && still[0].contains("--rdzv-id")
            && still[0].contains("join_timeout in --rdzv-conf"),
        "{err}"
    );
    assert!(err.contains("did not complete within"), "{err}");
}

/// A command line that cannot work exits 2 (as clap's own refusals do), says which flag and
/// value, and starts nothing: `trainctl run`'s training arguments are checked once, in the
/// launcher, before any worker starts.
#[test]
fn bad_command_lines_exit_2_naming_the_flag_and_start_nothing() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "--nproc-per-node", "0", "--", "true"],
            "--nproc-per-node",
        ),
        (&["run", "--nnodes", "0", "--", "true"], "--nnodes"),
        (
            &["run", "--hang-timeout", "0", "--", "true"],
            "--hang-timeout",
        ),
        (&["run", "--rdzv-id", "a/b", "--", "true"], "--rdzv-id"),
        (
            &["run", "--collective-timeout", "0", "--", "true"],
            "--collective-timeout",
        ),
        (
            &[
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "train",
                "--epoch",
                "1",
            ],
            "--epochs",
        ),
        (&["run", "train", "--batch-size", "0"], "--batch-size 0"),
        (&["run", "train", "--model", "resnet19"], "resnet19"),
        (
            &["run", "train", "--learning-rate", "-1"],
            "--learning-rate -1",
        ),
        (
            &["run", "--max-restart", "3", "train"],
            "did you mean --max-restarts?",
        ),
        (
            &["run", "--evict-stragglers", "train"],
            "unknown flag --evict-stragglers",
        ),
        (&["train", "--threads", "0"], "--threads 0"),
        (&["train", "--momentum", "1.5"], "--momentum 1.5"),
        (&["bench", "--steps", "0"], "--steps 0"),
    ];
    for (argv, says) in cases {
        let out = trainctl().args(*argv).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{argv:?}:\n{err}");
        assert!(err.contains(says), "{argv:?} must say {says:?}:\n{err}");
        assert!(
            !err.contains("started rank") && !err.contains("[0]:"),
            "{argv:?} started a worker:\n{err}"
        );
    }
}

/// A rendezvous endpoint where another program listens (it accepts and never answers) is
/// named as such at once, with what to do, instead of a raw warning and silence until the join
/// timeout.
#[test]
fn a_foreign_listener_on_the_rendezvous_port_is_named_at_once() {
    let foreign = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = foreign.local_addr().unwrap().to_string();
    let out = trainctl()
        .args(["run", "--nnodes", "1:2", "--rdzv-backend", "c10d"])
        .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "foreign"])
        .args(["--rdzv-conf", "is_host=0,timeout=1", "--job-token", "t"])
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is not a trainctl rendezvous store")
            && err.contains("another program holds that port")
            && err.contains("--rdzv-endpoint"),
        "{err}"
    );
    drop(foreign);
}

/// The same with `--rdzv-backend etcd`: a listener that takes the connection and says nothing,
/// and an HTTP server that is not etcd, are named at once, not waited on until the join
/// timeout.
#[test]
fn a_foreign_listener_at_the_etcd_endpoint_is_named_at_once() {
    use std::io::{Read, Write};
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web_addr = web.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut stream in web.incoming().flatten() {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
            );
        }
    });
    for (endpoint, says) in [
        (
            silent.local_addr().unwrap(),
            "took the connection but sent nothing",
        ),
        (web_addr, "HTTP 404 Not Found, not etcd's status"),
    ] {
        let started = std::time::Instant::now();
        let out = trainctl()
            .args(["run", "--nnodes", "1:2", "--rdzv-backend", "etcd"])
            .args([
                "--rdzv-endpoint",
                &endpoint.to_string(),
                "--rdzv-id",
                "foreign",
            ])
            .args(["--rdzv-conf", "timeout=1", "--job-token", "t"])
            .args(["--", "true"])
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("is not a trainctl rendezvous store or etcd")
                && err.contains(says)
                && err.contains("--rdzv-endpoint"),
            "{err}"
        );
        // Named, not waited on: the join timeout is 600 s.
        assert!(started.elapsed() < Duration::from_secs(60), "{err}");
    }
    drop(silent);
}

/// The exit barrier: a node whose workers finished first waits for the other node's workers
/// to finish before it exits 0, so that any node's exit 0 says the whole job is done (a
/// Kubernetes Job's successPolicy ends the job on the first pod that succeeds). Node rank 0's
/// worker (rank 0 saves the model) takes 3 s longer; when node rank 1's agent exits, it has
/// finished. (Rank 0's node hosts the c10d store, which lingers for the others anyway: the
/// fast node is the one that needs the barrier. With `exit_barrier_timeout=0.01` it exits
/// before rank 0's worker is done.)
#[test]
fn a_node_whose_workers_finished_first_waits_for_the_others_before_it_exits() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let program = format!(
        "if [ \"$GROUP_RANK\" = 0 ]; then sleep 3; fi; touch {}/done-$GROUP_RANK",
        dir.path().display()
    );
    let agent = || {
        let mut cmd = trainctl();
        cmd.args(["run", "--nnodes", "2", "--rdzv-backend", "c10d"])
            .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "barrier"])
            .args(["--health-check", "off", "--", "sh", "-c", &program]);
        cmd.spawn().unwrap()
    };
    let mut agents = [agent(), agent()];
    let done = |rank: u32| dir.path().join(format!("done-{rank}")).exists();
    // Whichever agent exits first: every node's worker has finished by then.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let first = loop {
        if let Some(i) = agents
            .iter_mut()
            .position(|a| a.try_wait().unwrap().is_some())
        {
            break i;
        }
        assert!(std::time::Instant::now() < deadline, "no agent exited");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        done(0) && done(1),
        "agent {first} exited before every worker finished"
    );
    for mut a in agents {
        assert!(a.wait().unwrap().success());
    }
}

/// A SIGTERM that comes while the agent starts (a pod deleted as its container comes up: the
/// agent still waits for the rendezvous store), to `trainctl run` as PID 1, a container's
/// init, for which the kernel drops a signal it has no handler for: the agent never joins and
/// exits 143 at once, saying so. (It used to lose the signal, join, and train until SIGKILL.)
#[test]
fn a_sigterm_as_the_agent_starts_is_kept_even_as_pid_1() {
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_trainctl"))
        .args(["run", "--nnodes", "1:2", "--rdzv-backend", "c10d"])
        .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "pid1"])
        .args(["--rdzv-conf", "is_host=0", "--job-token", "t"])
        .args(["--", "sleep", "600"]);
    let mut run = Running::start(&mut cmd);
    // Inside the new namespace trainctl is PID 1; outside, unshare's one child.
    let children = format!("/proc/{}/task/{}/children", run.pid(), run.pid());
    let waiting = run.wait_for_line(Duration::from_secs(30), |l| {
        l.contains("rendezvous store not reachable yet; waiting") || l.contains("unshare:")
    });
    if waiting.contains("unshare:") {
        eprintln!("SKIPPED a_sigterm_as_the_agent_starts_is_kept_even_as_pid_1: {waiting}");
        return;
    }
    let agent: i32 = std::fs::read_to_string(&children)
        .ok()
        .and_then(|c| c.split_whitespace().next()?.parse().ok())
        .expect("unshare's child");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = run.wait(Duration::from_secs(30));
    let out = run.output();
    assert_eq!(status.code(), Some(143), "{out}");
    assert!(
        out.contains("stopped (signal 15) while waiting for the rendezvous at")
            && out.contains("this node never joined"),
        "{out}"
    );
    assert!(!out.contains("started rank"), "{out}");
}
