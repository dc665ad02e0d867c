//! The Kubernetes and EKS commands as a user runs them: settings and their sources, rendering,
//! eksctl run or printed, the doctor's checks between processes, and the PET_* contract that
//! Kubeflow's training operator injects.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use crate::support::*;

pub(crate) fn kube_cmd(dir: &std::path::Path) -> std::process::Command {
    let mut cmd = trainctl();
    cmd.current_dir(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("TRAINCTL_") {
            cmd.env_remove(k);
        }
    }
    // Never a real cluster from the developer's machine.
    cmd.env("KUBECONFIG", dir.join("no-kubeconfig"));
    cmd
}

/// Runs `cmd`, which must be refused as a bad command line (exit 2, nothing on stdout), and
/// returns its stderr.
fn run_refused(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{cmd:?}\nstdout:\n{}\nstderr:\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    text(&out.stderr)
}

#[test]
fn config_show_names_each_value_and_its_source() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("trainctl.toml"),
        "image = \"123.dkr.ecr.us-west-2.amazonaws.com/trainctl:1\"\n[cluster]\nnodes = 4\nregion = \"eu-west-1\"\n",
    )
    .unwrap();
    let out = run_ok(
        kube_cmd(dir.path())
            .args(["config", "show", "--nodes", "3"])
            .env("TRAINCTL_CLUSTER_REGION", "eu-central-1"),
    );
    let text = text(&out.stdout);
    let line = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| panic!("no {key} in\n{text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(line("cluster.nodes"), "cluster.nodes 3 flag --nodes");
    assert_eq!(
        line("cluster.region"),
        "cluster.region eu-central-1 environment TRAINCTL_CLUSTER_REGION"
    );
    assert_eq!(
        line("image"),
        "image 123.dkr.ecr.us-west-2.amazonaws.com/trainctl:1 file trainctl.toml"
    );
    assert_eq!(line("cluster.version"), "cluster.version 1.33 default");
    assert_eq!(
        line("job.nnodes"),
        "job.nnodes 3 derived from cluster.nodes"
    );
}

#[test]
fn bad_settings_are_refused_before_anything_is_rendered() {
    let dir = tempfile::tempdir().unwrap();
    let err =
        run_refused(kube_cmd(dir.path()).args(["job", "render", "--instance-type", "c5.mega"]));
    assert!(
        err.contains(
            "cluster.instance_type = \"c5.mega\" (from flag --instance-type): unknown instance type"
        ),
        "{err}"
    );
    let err = run_refused(kube_cmd(dir.path()).args(["job", "render", "--name", "Bad_Name"]));
    assert!(err.contains("not a valid job name"), "{err}");
    std::fs::write(dir.path().join("trainctl.toml"), "[cluster]\nnode = 2\n").unwrap();
    let err = run_refused(kube_cmd(dir.path()).args(["config", "show"]));
    assert!(err.contains("unknown setting `cluster.node`"), "{err}");
    let err =
        run_refused(kube_cmd(dir.path()).args(["config", "show", "--config", "missing.toml"]));
    assert!(err.contains("cannot read missing.toml"), "{err}");
}

#[test]
fn cluster_create_runs_eksctl_or_prints_the_command() {
    let dir = tempfile::tempdir().unwrap();
    // Without eksctl on PATH: the config is written and the exact command printed.
    let out = run_ok(
        kube_cmd(dir.path())
            .args([
                "cluster",
                "create",
                "--preset",
                "g4dn",
                "--az",
                "us-west-2b,us-west-2a",
            ])
            .env("PATH", dir.path().join("empty")),
    );
    let file = dir.path().join("eksctl-trainctl.yaml");
    let yaml = std::fs::read_to_string(&file).unwrap();
    assert!(yaml.contains("instanceType: g4dn.metal"), "{yaml}");
    assert!(yaml.contains("efaEnabled: true"), "{yaml}");
    assert_eq!(
        text(&out.stdout).trim(),
        "eksctl create cluster -f eksctl-trainctl.yaml"
    );
    assert!(text(&out.stderr).contains("eksctl is not installed here"));

    // With eksctl on PATH: it is run with that command line, and its exit code is ours.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let fake = bin.join("eksctl");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\necho \"$@\" > {}\nexit 3\n",
            dir.path().join("eksctl-args").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = kube_cmd(dir.path())
        .args([
            "cluster",
            "delete",
            "--cluster-name",
            "demo",
            "--region",
            "eu-west-1",
        ])
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("eksctl-args"))
            .unwrap()
            .trim(),
        "delete cluster --name demo --region eu-west-1 --wait"
    );
}

/// `cluster addons --launcher KIND --dry-run` says how to install the operator that launcher
/// needs, from the launchers' table (none for `indexed`).
#[test]
fn cluster_addons_says_how_to_install_each_launchers_operator() {
    let dir = tempfile::tempdir().unwrap();
    for (launcher, says) in [
        ("indexed", None),
        ("pytorchjob", Some("kubeflow/training-operator.git")),
        ("trainjob", Some("kubeflow/trainer.git")),
        ("mpijob", Some("mpi-operator")),
    ] {
        let out = run_ok(
            kube_cmd(dir.path())
                .args(["cluster", "addons", "--dry-run", "--launcher", launcher])
                .env("PATH", dir.path().join("empty")),
        );
        let stdout = text(&out.stdout);
        match says {
            Some(s) => assert!(stdout.contains(s), "{launcher}: {stdout}"),
            None => assert!(!stdout.contains("kubectl apply"), "{launcher}: {stdout}"),
        }
    }
}

#[test]
fn an_odcr_preset_without_a_reservation_says_what_to_give() {
    let dir = tempfile::tempdir().unwrap();
    let err =
        run_refused(kube_cmd(dir.path()).args(["cluster", "config", "--preset", "p4de-odcr"]));
    assert!(err.contains("--capacity-reservation-id cr-"), "{err}");
}

#[test]
fn renders_print_yaml_and_api_commands_without_a_cluster_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(kube_cmd(dir.path()).args([
        "job",
        "render",
        "--launcher",
        "pytorchjob",
        "--nnodes",
        "1:3",
        "--nodes",
        "3",
        "--efs",
        "fs-0123",
    ]));
    let yaml = text(&out.stdout);
    assert!(yaml.contains("kind: PyTorchJob"), "{yaml}");
    assert!(yaml.contains("elasticPolicy:"), "{yaml}");
    assert!(yaml.contains("maxReplicas: 3"), "{yaml}");
    let out = run_ok(kube_cmd(dir.path()).args(["storage", "--efs", "fs-0123", "--dry-run"]));
    assert!(text(&out.stdout).contains("kind: PersistentVolumeClaim"));
    let err = run_refused(kube_cmd(dir.path()).args(["storage", "--dry-run"]));
    assert!(err.contains("no shared storage is configured"), "{err}");
    let err = run_failing(kube_cmd(dir.path()).args(["job", "status"]));
    assert!(err.contains("cannot reach the Kubernetes API"), "{err}");
    assert!(err.contains("KUBECONFIG"), "{err}");
}

#[test]
fn doctor_check_between_two_pods() {
    let port = testkit::free_port();
    let claim = tempfile::tempdir().unwrap();
    let peers = "127.0.0.1,127.0.0.2";
    let start = |me: &str| {
        Running::start(trainctl().args([
            "doctor",
            "check",
            "--peers",
            peers,
            "--port",
            &port.to_string(),
            "--claim",
            claim.path().to_str().unwrap(),
            "--me",
            me,
            "--listen",
            me,
            "--timeout",
            "30",
        ]))
    };
    let mut a = start("127.0.0.1");
    let mut b = start("127.0.0.2");
    for p in [&mut a, &mut b] {
        let status = p.wait(Duration::from_secs(60));
        let out = p.output();
        assert!(status.success(), "{out}");
        assert!(
            out.contains("ok   connect  rendezvous host 127.0.0.1 accepts connections"),
            "{out}"
        );
        assert!(out.contains("is mounted read-write"), "{out}");
        assert!(out.contains("all checks passed"), "{out}");
    }
    // A peer that never comes: exit 1, and the failed check says what to do.
    let mut lonely = Running::start(trainctl().args([
        "doctor",
        "check",
        "--peers",
        "127.0.0.1,127.0.0.3",
        "--port",
        &port.to_string(),
        "--claim",
        claim.path().to_str().unwrap(),
        "--me",
        "127.0.0.1",
        "--listen",
        "127.0.0.1",
        "--timeout",
        "2",
    ]));
    let status = lonely.wait(Duration::from_secs(30));
    let out = lonely.output();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("FAIL connect  worker 127.0.0.3 does not accept connections"),
        "{out}"
    );
    assert!(out.contains("1 check(s) failed"), "{out}");
}

/// An elastic PyTorchJob's pods run `trainctl run --rdzv-id NAME train ...` with only what the
/// training operator injects (elastic.go: PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_NNODES,
/// PET_MAX_RESTARTS, PET_NPROC_PER_NODE): two such "pods" form one job.
#[test]
fn the_operators_pet_variables_are_enough_to_form_a_job() {
    let port = testkit::free_port();
    // Each worker waits (up to 30 s) until both ranks have started, as a training worker waits
    // for its peers in the collective: a worker that finished alone would end the job before
    // the other node's worker ran.
    let meet = tempfile::tempdir().unwrap();
    let script = format!(
        "touch {d}/$RANK; i=0; while [ ! -e {d}/0 ] || [ ! -e {d}/1 ]; do \
         i=$((i+1)); [ $i -gt 600 ] && exit 9; sleep 0.05; done; \
         echo worker rank=$RANK world=$WORLD_SIZE",
        d = meet.path().display()
    );
    let start = || {
        Running::start(
            trainctl()
                .args(["run", "--rdzv-id", "cifar10", "--", "sh", "-c", &script])
                .env("PET_RDZV_ENDPOINT", format!("127.0.0.1:{port}"))
                .env("PET_RDZV_BACKEND", "c10d")
                .env("PET_NNODES", "2:2")
                .env("PET_MAX_RESTARTS", "3")
                .env("PET_NPROC_PER_NODE", "1")
                .env("PYTHONUNBUFFERED", "0")
                .env("TRAINCTL_JOB_TOKEN", "from-the-secret"),
        )
    };
    let mut a = start();
    let mut b = start();
    let mut ranks = Vec::new();
    for p in [&mut a, &mut b] {
        let status = p.wait(Duration::from_secs(60));
        let out = p.output();
        assert!(status.success(), "{out}");
        let line = out
            .lines()
            .find(|l| l.contains("worker rank="))
            .unwrap_or_else(|| panic!("{out}"))
            .to_string();
        assert!(line.contains("world=2"), "{line}");
        ranks.push(line);
    }
    assert!(ranks.iter().any(|l| l.contains("rank=0")), "{ranks:?}");
    assert!(ranks.iter().any(|l| l.contains("rank=1")), "{ranks:?}");
}

/// `trainctl install DIR` (the init container's command) copies a working binary, whole; a
/// folder that is not there is refused with what it must be.
#[test]
fn install_copies_a_binary_that_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(trainctl().arg("install").arg(dir.path()));
    assert!(
        text(&out.stdout).starts_with("installed "),
        "{}",
        text(&out.stdout)
    );
    let copy = dir.path().join("trainctl");
    let version = run_ok(std::process::Command::new(&copy).arg("--version"));
    assert!(text(&version.stdout).starts_with("trainctl "));
    assert_eq!(
        std::fs::metadata(&copy).unwrap().len(),
        std::fs::metadata(env!("CARGO_BIN_EXE_trainctl"))
            .unwrap()
            .len()
    );
    // Nothing but the binary is left (no temporary file).
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    let err = run_failing(trainctl().arg("install").arg(dir.path().join("missing")));
    assert!(err.contains("not a directory"), "{err}");
}

#[test]
fn tensorboard_renders_or_says_it_needs_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(kube_cmd(dir.path()).args(["tensorboard", "--dry-run", "--name", "exp1"]));
    let yaml = text(&out.stdout);
    assert!(yaml.contains("kind: Deployment"), "{yaml}");
    assert!(yaml.contains("name: exp1-tensorboard"), "{yaml}");
    let err = run_failing(kube_cmd(dir.path()).args(["tensorboard"]));
    assert!(err.contains("cannot reach the Kubernetes API"), "{err}");
}

/// The binary the init container copies into users' images must run in their bases: it links
/// only glibc (libc, libm, libgcc_s) and needs no symbol newer than glibc 2.35 (Ubuntu 22.04,
/// the base of PyTorch's official images; Debian 12 has 2.36). The version names it needs are
/// strings in its dynamic section, so a scan of the file finds them.
#[test]
fn the_binary_runs_on_glibc_2_35() {
    let bytes = std::fs::read(env!("CARGO_BIN_EXE_trainctl")).unwrap();
    let needle = b"GLIBC_2.";
    let mut newest = 0u32;
    for at in 0..bytes.len().saturating_sub(needle.len()) {
        if &bytes[at..at + needle.len()] == needle {
            let digits: String = bytes[at + needle.len()..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .map(|b| *b as char)
                .collect();
            newest = newest.max(digits.parse().unwrap_or(0));
        }
    }
    assert!(newest > 0, "no glibc symbol versions found");
    assert!(
        newest <= 35,
        "trainctl needs GLIBC_2.{newest}: it would not run in Ubuntu 22.04-based images \
         (PyTorch's); update docs/KUBERNETES.md or build on an older base"
    );
}

/// A Kubernetes API on 127.0.0.1 (plain HTTP) that answers GETs by path, query left out, from
/// `routes` (path, status code, JSON or text body) and 404 otherwise, as the API server does,
/// until the test ends; returns a kubeconfig that points at it.
fn mock_api(dir: &std::path::Path, routes: Vec<(&'static str, u16, String)>) -> std::path::PathBuf {
    mock_api_recording(dir, routes, Default::default())
}

/// What a client sent the mock API besides GETs: method, path and body.
type Writes = std::sync::Arc<std::sync::Mutex<Vec<(String, String, String)>>>;

/// [`mock_api`] that also takes writes (a server-side apply's PATCH, a POST): each is recorded
/// in `writes` and answered 200 with the object it sent, given a uid, as if stored.
fn mock_api_recording(
    dir: &std::path::Path,
    routes: Vec<(&'static str, u16, String)>,
    writes: Writes,
) -> std::path::PathBuf {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let server = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            // The rest of the head, and the body it announces (a GET has none).
            let mut header = String::new();
            let mut length = 0;
            while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                if let Some((name, value)) = header.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    length = value.trim().parse().unwrap_or(0);
                }
                header.clear();
            }
            let mut sent = vec![0; length];
            if reader.read_exact(&mut sent).is_err() {
                continue;
            }
            let method = request.split_whitespace().next().unwrap_or("");
            let target = request.split_whitespace().nth(1).unwrap_or("");
            let path = target.split('?').next().unwrap_or("");
            if method != "GET" {
                let sent = String::from_utf8_lossy(&sent).into_owned();
                writes
                    .lock()
                    .unwrap()
                    .push((method.into(), path.into(), sent.clone()));
                let mut stored: serde_json::Value = serde_json::from_str(&sent).unwrap_or_default();
                stored["metadata"]["uid"] = format!("uid-{}", path.len()).into();
                let body = stored.to_string();
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(body.as_bytes());
                continue;
            }
            let (code, body) = routes
                .iter()
                .find(|(p, _, _)| *p == path)
                .map(|(_, code, body)| (*code, body.clone()))
                .unwrap_or_else(|| {
                    let message = format!("{path} not found");
                    (404, serde_json::json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": message, "reason": "NotFound", "code": 404,
                    })
                    .to_string())
                });
            let head = format!(
                "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(body.as_bytes());
        }
    });
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: mock\n  cluster:\n    server: {server}\n\
             contexts:\n- name: mock\n  context:\n    cluster: mock\n    user: me\n\
             current-context: mock\nusers:\n- name: me\n  user: {{}}\n"
        ),
    )
    .unwrap();
    kubeconfig
}

/// `job logs` during a kubelet outage on one of two nodes (before the node turns NotReady): the
/// other pod's lines, the unread pod named with the kubelet's error, exit 1 only at the end,
/// and none of the Kubernetes client's own ERROR lines unless RUST_LOG asks for them.
#[test]
fn job_logs_go_on_past_a_kubelet_that_does_not_answer() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let pod = |index: u32, node: &str| {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": format!("cifar10-{index}-abcde"), "namespace": "default",
                "uid": format!("uid-{index}"),
                "labels": {
                    "job-name": "cifar10",
                    "batch.kubernetes.io/job-completion-index": index.to_string(),
                    "trainctl.dev/job": "cifar10",
                    "app.kubernetes.io/managed-by": "trainctl",
                },
            },
            "spec": { "containers": [{ "name": "pytorch" }], "nodeName": node },
            "status": { "phase": "Running" },
        })
    };
    let ready = |name: &str| {
        json!({
            "apiVersion": "v1", "kind": "Node", "metadata": { "name": name },
            "status": { "conditions": [{ "type": "Ready", "status": "True" }] },
        })
        .to_string()
    };
    let dial = "Get \"https://10.0.1.12:10250/containerLogs/default/cifar10-1-abcde/pytorch?\
                timestamps=true\": dial tcp 10.0.1.12:10250: connect: connection refused";
    let kubeconfig = mock_api(
        dir.path(),
        vec![
            (
                "/apis/batch/v1/namespaces/default/jobs/cifar10",
                200,
                json!({
                    "apiVersion": "batch/v1", "kind": "Job",
                    "metadata": { "name": "cifar10", "namespace": "default" },
                    "spec": { "template": { "spec": { "containers": [] } } },
                    "status": { "active": 2 },
                })
                .to_string(),
            ),
            (
                "/api/v1/namespaces/default/pods",
                200,
                json!({
                    "apiVersion": "v1", "kind": "PodList", "metadata": {},
                    "items": [pod(0, "n1"), pod(1, "n2")],
                })
                .to_string(),
            ),
            ("/api/v1/nodes/n1", 200, ready("n1")),
            ("/api/v1/nodes/n2", 200, ready("n2")),
            (
                "/api/v1/namespaces/default/pods/cifar10-0-abcde/log",
                200,
                "2026-11-21T10:00:01.000000000Z epoch 1 step 10\n".into(),
            ),
            (
                "/api/v1/namespaces/default/pods/cifar10-1-abcde/log",
                500,
                json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": dial, "code": 500,
                })
                .to_string(),
            ),
        ],
    );
    let out = kube_cmd(dir.path())
        .args(["job", "logs"])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert_eq!(
        stdout,
        format!(
            "[cifar10-0-abcde pod 0] epoch 1 step 10\n[cifar10-1-abcde pod 1] (no logs: the \
             kubelet on node n2 did not answer (500: {dial}))\n"
        )
    );
    assert!(
        stderr.starts_with("error: could not read the logs of 1 of the job's 2 pods"),
        "{stderr}"
    );
    assert!(stderr.contains("--follow"), "{stderr}");
    assert_eq!(
        stderr.lines().count(),
        1,
        "one error line, nothing else: {stderr}"
    );
    assert!(!stderr.contains("Status {"), "{stderr}");

    // The client's own line is there for whoever asks: the default filter is what hides it.
    let out = kube_cmd(dir.path())
        .args(["job", "logs"])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "kube_client=error")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("kube_client") && stderr.contains("500"),
        "{stderr}"
    );
}

/// What `job render` says about settings that cannot run (exit 2, the figures, nothing
/// rendered) or may not run as meant (warnings on stderr, the YAML on stdout).
#[test]
fn job_render_refuses_what_cannot_run_and_warns_about_what_may_not() {
    let dir = tempfile::tempdir().unwrap();
    let render = |args: &[&str]| {
        let mut cmd = kube_cmd(dir.path());
        cmd.args(["job", "render", "--efs", "fs-0123"]).args(args);
        cmd
    };
    let err = run_refused(&mut render(&["--cpu", "200"]));
    assert!(
        err.contains(r#"job.cpu = "200" (from flag --cpu): a c5.4xlarge node has 16 vCPUs"#)
            && err.contains("ask for at most 13"),
        "{err}"
    );
    let err = run_refused(&mut render(&["--nnodes", "4"]));
    assert!(
        err.contains("4 pods of 13 CPU and 25Gi memory, but 2 c5.4xlarge nodes")
            && err.contains("give --nnodes 2,"),
        "{err}"
    );
    // An elastic Indexed Job starts at what fits and grows: said, and rendered.
    let out = run_ok(&mut render(&["--nnodes", "1:4"]));
    assert!(
        text(&out.stderr).contains("the job starts with the pods that fit")
            && text(&out.stdout).contains("succeededIndexes: \"0\""),
        "{}",
        text(&out.stderr)
    );
    // The g4dn preset with the built-in trainer: rendered without GPUs, and said why; the
    // default image is said to be in no registry.
    let out = run_ok(&mut render(&[
        "--preset",
        "g4dn",
        "--az",
        "us-west-2b,us-west-2a",
    ]));
    let (yaml, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        yaml.contains("kind: Job") && !yaml.contains("nvidia.com/gpu:"),
        "{yaml}"
    );
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("warning: "))
        .collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(
        warnings[0].contains("trainctl:latest is the default, which no registry serves")
            && warnings[0].contains("--image"),
        "{stderr}"
    );
    assert!(
        warnings[1].contains("CPUs only") && warnings[1].contains("-- PROGRAM ARGS..."),
        "{stderr}"
    );
    // A program of the user's takes the GPUs, and nothing is said about them.
    let out = run_ok(&mut render(&[
        "--preset",
        "g4dn",
        "--az",
        "us-west-2b,us-west-2a",
        "--image",
        "ecr/trainctl:1",
        "--trainctl-image",
        "ecr/trainctl:1",
        "--",
        "python",
        "train.py",
    ]));
    assert!(text(&out.stdout).contains("nvidia.com/gpu: \"8\""));
    assert!(
        !text(&out.stderr).contains("warning:"),
        "{}",
        text(&out.stderr)
    );
}

/// `job render` prints the token Secret without its token: the same YAML on every render (so
/// `kubectl diff` sees nothing change) and no secret on stdout. `job launch` writes a random
/// 128-bit token into it, a new one at every launch, and prints none.
#[test]
fn the_job_token_is_never_printed_and_each_launch_gets_a_new_one() {
    use serde_json::{Value, json};
    let dir = tempfile::tempdir().unwrap();
    let settings = ["--efs", "fs-0123", "--image", "ecr/trainctl:1"];
    let render = || run_ok(kube_cmd(dir.path()).args(["job", "render"]).args(settings));
    let (first, second) = (render(), render());
    assert_eq!(text(&first.stdout), text(&second.stdout));
    let yaml = text(&first.stdout);
    assert!(yaml.contains("kind: Secret\n") && yaml.contains("name: cifar10-token\n"));
    assert!(
        !yaml.contains("stringData") && !yaml.contains("\ndata:"),
        "{yaml}"
    );
    let stderr = text(&first.stderr);
    assert!(
        stderr.contains("kubectl create secret generic cifar10-token -n default"),
        "{stderr}"
    );

    let version = json!({
        "major": "1", "minor": "33", "gitVersion": "v1.33.0", "gitCommit": "", "gitTreeState": "",
        "buildDate": "", "goVersion": "", "compiler": "", "platform": "linux/amd64",
    });
    let namespace =
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": "default" } });
    let writes = Writes::default();
    let kubeconfig = mock_api_recording(
        dir.path(),
        vec![
            ("/version", 200, version.to_string()),
            ("/api/v1/namespaces/default", 200, namespace.to_string()),
        ],
        writes.clone(),
    );
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let out = run_ok(
            kube_cmd(dir.path())
                .args(["job", "launch"])
                .args(settings)
                .env("KUBECONFIG", &kubeconfig),
        );
        let said = text(&out.stdout) + &text(&out.stderr);
        assert!(said.contains("applied Secret cifar10-token"), "{said}");
        let sent = std::mem::take(&mut *writes.lock().unwrap());
        let (_, _, body) = sent
            .iter()
            .find(|(method, path, _)| {
                method == "PATCH" && path == "/api/v1/namespaces/default/secrets/cifar10-token"
            })
            .unwrap_or_else(|| panic!("no Secret applied: {sent:?}"));
        let secret: Value = serde_json::from_str(body).unwrap();
        let token = secret["stringData"]["token"].as_str().unwrap().to_string();
        assert!(
            token.len() == 32 && token.chars().all(|c| c.is_ascii_hexdigit()),
            "{token}"
        );
        assert!(!said.contains(&token), "{said}");
        tokens.push(token);
    }
    assert_ne!(tokens[0], tokens[1]);
}

/// `description` without clap's bracketed notes (`[default: 1]`, `[env: X]`, `[aliases: --a]`,
/// `[possible values: ...]`), whitespace collapsed: what the argument's help says.
fn said(description: &str) -> String {
    let mut out = String::new();
    let mut depth = 0;
    for c in description.chars() {
        match c {
            '[' => depth += 1,
            ']' if depth > 0 => depth -= 1,
            c if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every argument of every command says what it is in its `--help`: the walk goes through
/// the whole command tree as a user would, `trainctl --help`, then each command's.
#[test]
fn every_argument_of_every_command_has_help() {
    let mut missing = Vec::new();
    let mut walked = Vec::new();
    let mut queue = vec![Vec::<String>::new()];
    while let Some(path) = queue.pop() {
        let out = run_ok(trainctl().args(&path).arg("--help"));
        let (entries, commands) = help_entries(&text(&out.stdout));
        for command in commands.into_iter().filter(|c| c != "help") {
            queue.push([path.clone(), vec![command]].concat());
        }
        for (spec, description) in entries {
            if said(&description).is_empty() {
                missing.push(format!("trainctl {} {spec}", path.join(" ")));
            }
        }
        walked.push(path.join(" "));
    }
    // The walk reached the leaves, not only the top.
    for command in [
        "cluster addons",
        "doctor check",
        "data synth",
        "job render",
        "bench",
    ] {
        assert!(walked.iter().any(|w| w == command), "{walked:?}");
    }
    assert!(
        missing.is_empty(),
        "arguments without help:\n{}",
        missing.join("\n")
    );
}

/// The argument `flag` of a `--help` text, spec and description, whitespace collapsed.
fn help_of(help: &str, flag: &str) -> Option<String> {
    help_entries(help)
        .0
        .into_iter()
        .find(|(spec, _)| spec.split([',', ' ']).any(|word| word == flag))
        .map(|(spec, description)| {
            format!("{spec} {description}")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
}

/// Each Kubernetes command's `--help` lists the project settings it reads, with defaults and
/// units, and not the others (which it still accepts, so one set of flags serves every
/// command); `config show --help` lists them all. The learning rate's flag is the trainer's
/// `--learning-rate`, and the old `--lr` still works.
#[test]
fn kubernetes_commands_list_the_settings_they_read() {
    let help = |args: &[&str]| text(&run_ok(trainctl().args(args).arg("--help")).stdout);
    let tensorboard = help(&["tensorboard"]);
    for flag in [
        "--tensorboard-image",
        "--name",
        "--namespace",
        "--claim",
        "--runs-dir",
    ] {
        assert!(
            help_of(&tensorboard, flag).is_some(),
            "{flag}:\n{tensorboard}"
        );
    }
    for flag in [
        "--epochs",
        "--lr",
        "--learning-rate",
        "--cpu",
        "--efs",
        "--region",
    ] {
        assert!(
            help_of(&tensorboard, flag).is_none(),
            "{flag}:\n{tensorboard}"
        );
    }
    let delete = help(&["cluster", "delete"]);
    assert!(help_of(&delete, "--region").is_some(), "{delete}");
    assert!(help_of(&delete, "--image").is_none(), "{delete}");
    let status = help(&["job", "status"]);
    assert!(help_of(&status, "--name").is_some() && help_of(&status, "--nnodes").is_none());

    let render = help(&["job", "render"]);
    let of = |flag: &str| help_of(&render, flag).unwrap_or_else(|| panic!("{flag}:\n{render}"));
    let lr = of("--learning-rate");
    assert!(
        lr.contains("[alias: --lr]") && lr.contains("[default: 0.001]"),
        "{lr}"
    );
    let cpu = of("--cpu");
    assert!(
        cpu.contains("in cores (14, 0.5) or millicores (500m)")
            && cpu.contains("[default: 13, from --instance-type]")
            && cpu.contains("[env: TRAINCTL_JOB_CPU]"),
        "{cpu}"
    );
    let memory = of("--memory");
    assert!(
        memory.contains("quantity in bytes (24Gi, 512Mi)")
            && memory.contains("[default: 25Gi, from --instance-type]"),
        "{memory}"
    );
    let shm = of("--shm-size");
    assert!(
        shm.contains("quantity in bytes (2Gi, 512Mi)")
            && shm.contains("[default: 3Gi, from --instance-type]"),
        "{shm}"
    );
    assert!(of("--instance-type").contains("[default: c5.4xlarge with --preset cpu]"));
    let storage = help(&["storage"]);
    let size = help_of(&storage, "--storage-size").unwrap();
    assert!(
        size.contains("quantity in bytes (100Gi, 1Ti, 500G)") && size.contains("[default: 100Gi]"),
        "{size}"
    );
    assert!(help_of(&storage, "--epochs").is_none(), "{storage}");

    let all = help(&["config", "show"]);
    for s in deploy::config::SETTINGS {
        assert!(help_of(&all, s.flag).is_some(), "{}:\n{all}", s.flag);
    }

    // Settings a command does not list still work there; so does the old --lr.
    let dir = tempfile::tempdir().unwrap();
    run_ok(kube_cmd(dir.path()).args(["tensorboard", "--dry-run", "--epochs", "3"]));
    let out = run_ok(kube_cmd(dir.path()).args(["config", "show", "--lr", "0.05"]));
    let shown = text(&out.stdout);
    let line = shown
        .lines()
        .find(|l| l.starts_with("job.learning_rate "))
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert_eq!(line, "job.learning_rate 0.05 flag --learning-rate");
}

/// `job scale` outside the job's `--nnodes` bounds is a bad command line (exit 2, the bounds
/// named, nothing patched); inside them it patches the Job and says what happens to the pods.
#[test]
fn job_scale_keeps_to_the_jobs_bounds() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let job = json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {
            "name": "cifar10", "namespace": "default",
            "annotations": { "trainctl.dev/nnodes": "2:4", "trainctl.dev/trainer": "program" },
        },
        "spec": {
            "completions": 3, "parallelism": 3, "completionMode": "Indexed",
            "template": { "spec": { "containers": [] } },
        },
        "status": { "active": 3 },
    });
    let writes = Writes::default();
    let kubeconfig = mock_api_recording(
        dir.path(),
        vec![(
            "/apis/batch/v1/namespaces/default/jobs/cifar10",
            200,
            job.to_string(),
        )],
        writes.clone(),
    );
    let said = run_refused(
        kube_cmd(dir.path())
            .args(["job", "scale", "5"])
            .env("KUBECONFIG", &kubeconfig),
    );
    assert!(
        said.contains("--nnodes 2:4") && said.contains("not 5"),
        "{said}"
    );
    assert!(writes.lock().unwrap().is_empty(), "nothing patched");

    let out = run_ok(
        kube_cmd(dir.path())
            .args(["job", "scale", "2"])
            .env("KUBECONFIG", &kubeconfig),
    );
    let said = text(&out.stdout);
    assert!(
        said.contains("3 → 2 nodes: pod 2 leaves (its agent leaves"),
        "{said}"
    );
    assert!(said.contains("only if it uses trainctl.torch"), "{said}");
    let sent = writes.lock().unwrap().clone();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].0, "PATCH");
    let body: serde_json::Value = serde_json::from_str(&sent[0].2).unwrap();
    assert_eq!(
        body,
        json!({ "spec": { "completions": 2, "parallelism": 2 } })
    );
}

/// Issue 60, item 13: `job launch --train-again` (and `job render`) gives the pods' `trainctl
/// train` its `--train-again`, so the same --name trains afresh after a finished run; with a
/// program of the user's it is a bad command line.
#[test]
fn job_render_train_again_reaches_the_trainer_and_not_a_program() {
    let dir = tempfile::tempdir().unwrap();
    let render = |args: &[&str]| {
        let mut cmd = kube_cmd(dir.path());
        cmd.args(["job", "render", "--efs", "fs-0123", "--image", "x/t:1"])
            .args(args);
        cmd
    };
    let yaml = text(&run_ok(&mut render(&["--train-again"])).stdout);
    assert!(yaml.contains("- --train-again\n"), "{yaml}");
    assert!(!text(&run_ok(&mut render(&[])).stdout).contains("--train-again"));
    let said = run_refused(&mut render(&[
        "--trainctl-image",
        "x/t:1",
        "--train-again",
        "--",
        "python",
        "train.py",
    ]));
    assert!(
        said.contains("--train-again is the built-in trainer's")
            && said.contains("python train.py"),
        "{said}"
    );
}
