//! End to end on a real cluster (kind, k3d, EKS): storage, data, a 2-node training job, the
//! test job, clean-up. Ignored unless asked for; README.md ("Testing on a real cluster") says
//! how to run it:
//!
//!   TRAINCTL_E2E_IMAGE=trainctl:e2e cargo test -p trainctl --test cli -- --ignored cluster_e2e
//!
//! The user-program test runs `fixtures/torchrun_contract.py` in TRAINCTL_E2E_PROGRAM_IMAGE
//! (default python:3.12-slim, which has no trainctl: the init container copies it in) with the
//! rendezvous in the job's own etcd.
//!
//! It uses KUBECONFIG's current context and namespace `default`, and a hostPath volume at
//! TRAINCTL_E2E_HOST_PATH (default /tmp/trainctl-e2e), which must exist on the node and be
//! writable by uid 1000; on EKS give TRAINCTL_STORAGE_EFS=fs-... instead.

use std::process::Command;

use crate::support::*;

fn e2e(name: &str, image: &str) -> impl Fn(&[&str]) -> Command {
    let name = name.to_string();
    let image = image.to_string();
    #[allow(clippy::disallowed_methods)] // the tester's settings for this test
    let host_path = std::env::var("TRAINCTL_E2E_HOST_PATH").ok();
    #[allow(clippy::disallowed_methods)]
    let efs = std::env::var("TRAINCTL_STORAGE_EFS").ok();
    move |args: &[&str]| {
        let mut cmd = trainctl();
        cmd.args(args).args([
            "--name",
            &name,
            "--claim",
            &format!("{name}-data"),
            "--image",
            &image,
            "--nnodes",
            "2",
            "--epochs",
            "1",
            "--batch-size",
            "16",
            "--cpu",
            "500m",
            "--memory",
            "1Gi",
            "--shm-size",
            "256Mi",
            "--node-selector",
            "none",
            "--storage-size",
            "1Gi",
        ]);
        if efs.is_none() {
            cmd.args([
                "--host-path",
                host_path.as_deref().unwrap_or("/tmp/trainctl-e2e"),
            ]);
        }
        cmd
    }
}

#[test]
#[ignore = "needs cluster"]
fn cluster_e2e_trains_and_tests_a_two_node_job() {
    #[allow(clippy::disallowed_methods)]
    let image = std::env::var("TRAINCTL_E2E_IMAGE")
        .expect("set TRAINCTL_E2E_IMAGE to a trainctl image the cluster can pull");
    let name = format!("e2e-{}", std::process::id());
    let t = e2e(&name, &image);

    run_ok(&mut t(&["storage"]));
    let data = run_ok(&mut t(&[
        "data",
        "job",
        "--synthetic",
        "256",
        "--timeout",
        "600",
    ]));
    assert!(
        text(&data.stdout).contains("wrote 256 training"),
        "{}",
        text(&data.stdout)
    );

    run_ok(&mut t(&["job", "launch"]));
    let status = t(&["job", "wait", "--timeout", "1200"]).output().unwrap();
    let logs = t(&["job", "logs"]).output().unwrap();
    assert!(
        status.status.success(),
        "{}\n{}",
        text(&status.stdout),
        text(&logs.stdout)
    );
    let logs = text(&logs.stdout);
    assert!(logs.contains(&format!("[{name}-0")), "{logs}");
    assert!(logs.contains(&format!("[{name}-1")), "{logs}");
    assert!(logs.contains("world size 2"), "{logs}");

    let test = run_ok(&mut t(&["test", "job", "--timeout", "600"]));
    let table = text(&test.stdout);
    assert!(table.contains("airplane"), "{table}");
    assert!(table.contains("truck"), "{table}");

    let deleted = run_ok(&mut t(&["job", "delete"]));
    assert!(text(&deleted.stdout).contains(&format!("deleted Job {name}")));
}

#[test]
#[ignore = "needs cluster"]
fn cluster_e2e_runs_a_users_program_in_its_own_image_through_etcd() {
    #[allow(clippy::disallowed_methods)]
    let image = std::env::var("TRAINCTL_E2E_IMAGE")
        .expect("set TRAINCTL_E2E_IMAGE to a trainctl image the cluster can pull");
    #[allow(clippy::disallowed_methods)]
    let program_image =
        std::env::var("TRAINCTL_E2E_PROGRAM_IMAGE").unwrap_or_else(|_| "python:3.12-slim".into());
    let name = format!("e2e-prog-{}", std::process::id());
    let t = e2e(&name, &image);
    let contract = include_str!("fixtures/torchrun_contract.py");
    let program = |args: &[&str]| {
        let mut cmd = t(args);
        cmd.args([
            "--image",
            &program_image,
            "--trainctl-image",
            &image,
            "--rdzv-backend",
            "etcd",
        ]);
        cmd
    };
    run_ok(&mut program(&["storage"]));
    run_ok(program(&["job", "launch"]).args([
        "--", "python", "-c", contract, "--world", "2", "--run-id", &name,
    ]));
    let status = program(&["job", "wait", "--timeout", "900"])
        .output()
        .unwrap();
    let logs = program(&["job", "logs"]).output().unwrap();
    let logs = text(&logs.stdout);
    assert!(status.status.success(), "{}\n{logs}", text(&status.stdout));
    assert!(logs.contains("contract ok rank 0/2"), "{logs}");
    assert!(logs.contains("contract ok rank 1/2"), "{logs}");
    let deleted = run_ok(&mut program(&["job", "delete"]));
    let deleted = text(&deleted.stdout);
    assert!(
        deleted.contains(&format!("deleted Deployment {name}-etcd")),
        "{deleted}"
    );
}
