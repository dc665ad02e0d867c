//! The training pods' command, as `trainctl job render` writes it, run here: each "pod" is a
//! host (a network namespace) whose `/etc/hosts` gives the names Kubernetes DNS would (pod 0's
//! `NAME-0.NAME`, the etcd Service's `NAME-etcd`). The init container's `trainctl install`
//! puts the binary where the container's command looks for it; the container's arguments and
//! environment (the job token read from the Secret it names, which `job render` shows empty and
//! a launch fills) are used as rendered. The program is
//! `fixtures/torchrun_contract.py`, which checks torchrun's contract and meets the other ranks
//! at MASTER_ADDR:MASTER_PORT.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use testkit::{EtcdServer, Network};

use crate::kubernetes::kube_cmd;
use crate::support::*;

const JOB: &str = "pods";

/// The rendered objects of a 2-node Indexed Job running the contract program.
fn render(dir: &Path, backend: &str) -> Vec<Value> {
    let contract =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures/torchrun_contract.py");
    let python = testkit::python();
    let out = run_ok(kube_cmd(dir).args([
        "job",
        "render",
        "--name",
        JOB,
        "--image",
        "python:3.12-slim",
        "--trainctl-image",
        "trainctl:test",
        "--nnodes",
        "2",
        "--rdzv-backend",
        backend,
        "--host-path",
        "/srv/trainctl",
        "--",
        python.to_str().unwrap(),
        contract.to_str().unwrap(),
        "--world",
        "2",
        "--run-id",
        JOB,
    ]));
    serde_saphyr::from_multiple(&text(&out.stdout)).expect("job render writes YAML documents")
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// A rendered pod, ready to run on a host: its program, arguments and environment.
struct Pod {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// Runs the init container (`trainctl install` into a folder standing for its emptyDir) and
/// reads the training container's command, arguments and environment.
fn pod_of(docs: &[Value], bin_dir: &Path) -> Pod {
    // `job render` shows the token Secret without its token; here, as `job launch` does, the
    // token is made for the launch and the pods read it from the Secret.
    let secret = docs
        .iter()
        .find(|d| d["kind"] == "Secret")
        .expect("a token Secret");
    assert!(secret.get("stringData").is_none(), "{secret}");
    let token = format!("token-of-{}", std::process::id());
    let job = docs.iter().find(|d| d["kind"] == "Job").expect("a Job");
    let spec = &job["spec"]["template"]["spec"];
    let init = &spec["initContainers"][0];
    assert_eq!(strings(&init["command"]), ["trainctl"]);
    let init_args = strings(&init["args"]);
    assert_eq!(init_args, ["install", "/opt/trainctl"]);
    run_ok(trainctl().arg(&init_args[0]).arg(bin_dir));

    let c = &spec["containers"][0];
    let command = strings(&c["command"]);
    let installed = command[0]
        .strip_prefix("/opt/trainctl/")
        .unwrap_or_else(|| panic!("the container does not run the installed binary: {command:?}"));
    let mut env = Vec::new();
    for e in c["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = match e["value"].as_str() {
            Some(v) => v.to_string(),
            None => {
                assert_eq!(e["valueFrom"]["secretKeyRef"]["key"], "token", "{e}");
                token.clone()
            }
        };
        env.push((name, value));
    }
    Pod {
        program: bin_dir.join(installed),
        args: strings(&c["args"]),
        env,
    }
}

/// Pod `index` of the Indexed Job, on network host `host`, with only the pod's environment
/// (and what Kubernetes adds: the completion index).
fn start(net: &Network, host: usize, pod: &Pod, index: usize) -> Running {
    let mut cmd: Command = net.command(host, &pod.program);
    cmd.args(&pod.args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("JOB_COMPLETION_INDEX", index.to_string())
        .envs(pod.env.iter().cloned());
    Running::start(&mut cmd)
}

fn network(hosts: usize, test: &str) -> Option<Network> {
    match Network::create(hosts) {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("SKIPPED {test}: this kernel or user cannot create network namespaces ({e})");
            None
        }
    }
}

fn assert_contract_kept(pods: &mut [Running]) {
    let mut met = Vec::new();
    for p in pods.iter_mut() {
        let status = p.wait(Duration::from_secs(120));
        let out = p.output();
        assert!(status.success(), "{out}");
        let line = out
            .lines()
            .find(|l| l.contains("contract ok"))
            .unwrap_or_else(|| panic!("{out}"))
            .to_string();
        assert!(line.contains("sum 1 home /tmp"), "{line}");
        met.push(line);
    }
    assert!(met.iter().any(|l| l.contains("rank 0/2")), "{met:?}");
    assert!(met.iter().any(|l| l.contains("rank 1/2")), "{met:?}");
}

/// c10d: pod 0's agent hosts the store at `pods-0.pods:29400`, which the other pod resolves.
#[test]
fn the_rendered_pods_run_a_users_program_with_torchruns_contract() {
    let name = "the_rendered_pods_run_a_users_program_with_torchruns_contract";
    let Some(net) = network(2, name) else { return };
    let dir = tempfile::tempdir().unwrap();
    let docs = render(dir.path(), "c10d");
    let bin = tempfile::tempdir().unwrap();
    let pod = pod_of(&docs, bin.path());
    assert!(
        pod.args
            .join(" ")
            .contains("--rdzv-endpoint pods-0.pods:29400"),
        "{:?}",
        pod.args
    );
    net.name_hosts(&[("pods-0.pods pods-0", 0), ("pods-1.pods pods-1", 1)]);
    let mut pods = [start(&net, 0, &pod, 0), start(&net, 1, &pod, 1)];
    assert_contract_kept(&mut pods);
}

/// etcd: both pods meet through the job's etcd at `pods-etcd:2379` (a real etcd on a third
/// host); pod 0 hosts nothing the job depends on.
#[test]
fn the_rendered_pods_meet_through_the_jobs_etcd() {
    let name = "the_rendered_pods_meet_through_the_jobs_etcd";
    let Some(net) = network(3, name) else { return };
    let dir = tempfile::tempdir().unwrap();
    let docs = render(dir.path(), "etcd");
    assert!(
        docs.iter()
            .any(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "pods-etcd"),
        "no etcd rendered"
    );
    let bin = tempfile::tempdir().unwrap();
    let pod = pod_of(&docs, bin.path());
    assert!(
        pod.args
            .join(" ")
            .contains("--rdzv-backend etcd --rdzv-endpoint pods-etcd:2379"),
        "{:?}",
        pod.args
    );
    let _etcd = EtcdServer::start_at(Some(net.host(2)), &net.addr(2), 2379, 2380);
    net.name_hosts(&[
        ("pods-0.pods pods-0", 0),
        ("pods-1.pods pods-1", 1),
        ("pods-etcd", 2),
    ]);
    let mut pods = [start(&net, 0, &pod, 0), start(&net, 1, &pod, 1)];
    assert_contract_kept(&mut pods);
}
