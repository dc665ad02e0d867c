//! `trainctl doctor check`: what the seed tutorials debugged by hand, checked from inside the
//! cluster by one pod per node: the rendezvous host's name resolves, its port accepts
//! connections, every worker reaches every other, the claim is mounted read-write, and the pod
//! sees the GPUs and EFA adapters it asked for, with the NCCL/libfabric variables set.
//!
//! Every pod listens on the rendezvous port, checks the others, then stays up until every peer
//! has reached it (or the deadline), so that no pod leaves before the others have checked it.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to check.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Every node's stable name (pod 0 first: the rendezvous host).
    pub peers: Vec<String>,
    pub port: u16,
    /// Where the claim is mounted.
    pub claim: PathBuf,
    /// Where the data set should be (only reported).
    pub data: Option<PathBuf>,
    /// This pod's name among `peers` (default: the host name).
    pub me: String,
    /// Address to listen on (default 0.0.0.0).
    pub listen: SocketAddr,
    pub timeout: Duration,
    pub accelerators: Accelerators,
}

/// What the pod should see of the node's accelerators.
#[derive(Debug, Clone)]
pub struct Accelerators {
    /// GPUs the pod requested (`nvidia.com/gpu`).
    pub gpus: u32,
    /// EFA adapters the pod requested (`vpc.amazonaws.com/efa`).
    pub efa: u32,
    /// Where `dev/` and `sys/` are: `/` in a pod.
    pub root: PathBuf,
    /// The pod's `NCCL_*` and `FI_*` variables.
    pub env: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    Warn,
    Fail,
}

/// One check's result.
#[derive(Debug, Clone)]
pub struct Check {
    pub verdict: Verdict,
    pub name: &'static str,
    pub detail: String,
    /// What to do about a failure or warning.
    pub advice: Option<String>,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tag = match self.verdict {
            Verdict::Ok => "ok  ",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        };
        write!(f, "{tag} {:<8} {}", self.name, self.detail)?;
        if let Some(a) = &self.advice {
            write!(f, "\n              -> {a}")?;
        }
        Ok(())
    }
}

fn check(verdict: Verdict, name: &'static str, detail: String, advice: Option<String>) -> Check {
    Check {
        verdict,
        name,
        detail,
        advice,
    }
}

/// Runs every check, printing each as it completes through `report`.
pub fn run(plan: &Plan, report: &mut dyn FnMut(&Check)) -> Vec<Check> {
    let deadline = Instant::now() + plan.timeout;
    let mut results = Vec::new();
    let mut emit = |c: Check, results: &mut Vec<Check>| {
        report(&c);
        results.push(c);
    };

    // Listen first: the others may be checking us already.
    let contacted = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let (listened, listener) = listen(plan);
    emit(listened, &mut results);
    if let Some(listener) = listener {
        let contacted = Arc::clone(&contacted);
        std::thread::spawn(move || accept_loop(listener, contacted));
    }

    for (i, peer) in plan.peers.iter().enumerate() {
        let role = if i == 0 { "rendezvous host" } else { "worker" };
        let (resolved, addrs) = dns_check(plan, role, peer, deadline);
        emit(resolved, &mut results);
        let Some(addrs) = addrs else {
            continue;
        };
        emit(
            connect_check(plan, role, peer, &addrs, deadline),
            &mut results,
        );
    }

    emit(claim_check(&plan.claim, &plan.me), &mut results);
    for c in accelerator_checks(&plan.accelerators) {
        emit(c, &mut results);
    }
    if let Some(data) = &plan.data {
        emit(data_check(data), &mut results);
    }

    if let Some(c) = wait_to_be_reached(plan, &contacted, deadline) {
        emit(c, &mut results);
    }
    results
}

/// Binds the rendezvous port: the check that says whether it could, and the listener when it
/// could.
fn listen(plan: &Plan) -> (Check, Option<TcpListener>) {
    match TcpListener::bind(plan.listen) {
        Ok(l) => (
            check(
                Verdict::Ok,
                "listen",
                format!("this pod ({}) listens on {}", plan.me, plan.listen),
                None,
            ),
            Some(l),
        ),
        Err(e) => (
            check(
                Verdict::Fail,
                "listen",
                format!("cannot listen on {}: {e}", plan.listen),
                Some(format!(
                    "something else in the pod holds port {}; the rendezvous needs it \
                     (choose another with --rdzv-port)",
                    plan.port
                )),
            ),
            None,
        ),
    }
}

/// Resolves `peer` (retrying until `deadline`): the check, and its addresses when it resolves.
fn dns_check(
    plan: &Plan,
    role: &str,
    peer: &str,
    deadline: Instant,
) -> (Check, Option<Vec<SocketAddr>>) {
    let started = Instant::now();
    match resolve(peer, plan.port, deadline) {
        Ok(addrs) => (
            check(
                Verdict::Ok,
                "dns",
                format!(
                    "{role} {peer} resolves to {} ({:.1} s)",
                    addrs
                        .iter()
                        .map(|a| a.ip().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    started.elapsed().as_secs_f64()
                ),
                None,
            ),
            Some(addrs),
        ),
        Err(e) => (
            check(
                Verdict::Fail,
                "dns",
                format!(
                    "{role} {peer} does not resolve after {:.0} s: {e}",
                    started.elapsed().as_secs_f64()
                ),
                Some(
                    "check that the pod runs (trainctl job status), that the headless \
                     Service of that name exists with publishNotReadyAddresses, and \
                     that CoreDNS runs (kube-system pods labelled k8s-app=kube-dns)"
                        .into(),
                ),
            ),
            None,
        ),
    }
}

/// Connects to `peer` at one of `addrs` (retrying until `deadline`) and says whether it could.
fn connect_check(
    plan: &Plan,
    role: &str,
    peer: &str,
    addrs: &[SocketAddr],
    deadline: Instant,
) -> Check {
    let started = Instant::now();
    match connect(addrs, &plan.me, deadline) {
        Ok(addr) => check(
            Verdict::Ok,
            "connect",
            format!(
                "{role} {peer} accepts connections on {addr} ({:.1} s)",
                started.elapsed().as_secs_f64()
            ),
            None,
        ),
        Err(e) => check(
            Verdict::Fail,
            "connect",
            format!(
                "{role} {peer} does not accept connections on port {} after {:.0} s: {e}",
                plan.port,
                started.elapsed().as_secs_f64()
            ),
            Some(format!(
                "pods must reach each other on port {}: check NetworkPolicies in the \
                 namespace and the node security group (pod-to-pod traffic), and that \
                 the pod is running",
                plan.port
            )),
        ),
    }
}

/// Stays reachable until every other peer has checked this pod (`contacted` names those
/// that have), or the deadline: a warning naming those that never did.
fn wait_to_be_reached(
    plan: &Plan,
    contacted: &Mutex<BTreeSet<String>>,
    deadline: Instant,
) -> Option<Check> {
    let others: BTreeSet<String> = plan
        .peers
        .iter()
        .filter(|p| !same_host(p, &plan.me))
        .map(|p| first_label(p).to_string())
        .collect();
    while Instant::now() < deadline {
        let seen = contacted.lock().map(|s| s.clone()).unwrap_or_default();
        if others.iter().all(|o| seen.contains(o)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let seen = contacted.lock().map(|s| s.clone()).unwrap_or_default();
    let missing: Vec<&String> = others.iter().filter(|o| !seen.contains(*o)).collect();
    if missing.is_empty() {
        return None;
    }
    Some(check(
        Verdict::Warn,
        "inbound",
        format!(
            "not reached by {} before the deadline",
            missing
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Some("their own reports say why (trainctl job logs)".into()),
    ))
}

/// A peer's identity: an address as it is, a DNS name by its first label (the pod's host name
/// for `NAME-0.SERVICE`).
fn first_label(name: &str) -> &str {
    if name.parse::<std::net::IpAddr>().is_ok() {
        return name;
    }
    name.split('.').next().unwrap_or(name)
}

fn same_host(peer: &str, me: &str) -> bool {
    first_label(peer) == first_label(me)
}

/// Every peer says who it is in one line; the listener remembers who came.
fn accept_loop(listener: TcpListener, contacted: Arc<Mutex<BTreeSet<String>>>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let contacted = Arc::clone(&contacted);
        std::thread::spawn(move || {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut line = String::new();
            let mut reader = BufReader::new(stream.take(256));
            if reader.read_line(&mut line).is_ok() {
                let who = line.trim();
                if let Some(name) = who.strip_prefix("trainctl-doctor ")
                    && let Ok(mut set) = contacted.lock()
                {
                    set.insert(first_label(name).to_string());
                }
            }
        });
    }
}

/// Resolves `host`, retrying until the deadline: a pod's DNS name appears only once the pod
/// has an address, so the first lookups may fail.
fn resolve(host: &str, port: u16, deadline: Instant) -> Result<Vec<SocketAddr>, String> {
    loop {
        let last = match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                if !addrs.is_empty() {
                    return Ok(addrs);
                }
                "no address".to_string()
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn connect(addrs: &[SocketAddr], me: &str, deadline: Instant) -> Result<SocketAddr, String> {
    loop {
        let mut last = String::from("no address");
        for addr in addrs {
            match TcpStream::connect_timeout(addr, Duration::from_secs(2)) {
                Ok(mut s) => {
                    let _ = writeln!(s, "trainctl-doctor {me}");
                    return Ok(*addr);
                }
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Writes, syncs, reads back and removes a file on the claim, as the pod's user. The file is
/// named by the pod (`me`) as well as its process: every pod checks the same claim at once,
/// and pods' process ids repeat (each container has its own).
fn claim_check(dir: &Path, me: &str) -> Check {
    let started = Instant::now();
    let me: String = me
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let probe = dir.join(format!(".trainctl-doctor-{me}-{}", std::process::id()));
    let payload: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&probe)?;
        f.write_all(&payload)?;
        f.sync_all()?;
        drop(f);
        let back = std::fs::read(&probe)?;
        if back != payload {
            return Err(std::io::Error::other("read back different bytes"));
        }
        std::fs::remove_file(&probe)
    })();
    match result {
        Ok(()) => check(
            Verdict::Ok,
            "claim",
            format!(
                "{} is mounted read-write (1 MiB written, synced, read back in {:.2} s)",
                dir.display(),
                started.elapsed().as_secs_f64()
            ),
            None,
        ),
        Err(e) => {
            let _ = std::fs::remove_file(&probe);
            check(
                Verdict::Fail,
                "claim",
                format!("cannot write to {}: {e}", dir.display()),
                Some(
                    "check that the claim is Bound (trainctl storage applied, the CSI driver \
                     installed) and writable by the pods' user 1000: on EFS mount through an \
                     access point owned by 1000 (--efs fs-...::fsap-...)"
                        .into(),
                ),
            )
        }
    }
}

/// Names in `dir` that are `prefix` followed by a number (`nvidia0`, `uverbs3`), sorted.
fn numbered(dir: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix(prefix)
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    names.sort_by_key(|n| n[prefix.len()..].parse::<u32>().unwrap_or(u32::MAX));
    names
}

/// `seen` devices (listed by `names`) against `requested`: fewer fails with `advice`.
fn devices_check(
    name: &'static str,
    what: &str,
    seen: usize,
    names: &[String],
    requested: u32,
    advice: &str,
) -> Check {
    let listed = if names.is_empty() {
        String::new()
    } else {
        format!(" ({})", names.join(", "))
    };
    if (seen as u32) < requested {
        check(
            Verdict::Fail,
            name,
            format!("{seen} of the {requested} {what} requested are in this pod{listed}"),
            Some(advice.into()),
        )
    } else {
        check(
            Verdict::Ok,
            name,
            format!("{seen} {what} in this pod{listed}, {requested} requested"),
            None,
        )
    }
}

/// The GPUs (`/dev/nvidiaN`) and EFA adapters (`/dev/infiniband/uverbsN`, named in
/// `/sys/class/infiniband`) this pod sees against what it requested, and the variables NCCL
/// and libfabric read.
fn accelerator_checks(a: &Accelerators) -> Vec<Check> {
    let mut out = Vec::new();
    let gpus = numbered(&a.root.join("dev"), "nvidia");
    out.push(devices_check(
        "gpu",
        "GPUs",
        gpus.len(),
        &gpus,
        a.gpus,
        "the NVIDIA device plugin must run on the node (`trainctl cluster addons` installs it; \
         kubectl -n kube-system get ds nvidia-device-plugin-daemonset) and the node's driver \
         must be loaded (an EKS GPU AMI)",
    ));
    let uverbs = numbered(&a.root.join("dev/infiniband"), "uverbs");
    let mut adapters: Vec<String> = std::fs::read_dir(a.root.join("sys/class/infiniband"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    adapters.sort();
    out.push(devices_check(
        "efa",
        "EFA adapters",
        uverbs.len(),
        &adapters,
        a.efa,
        "the EFA device plugin must run on the node (eksctl installs it for node groups with \
         efaEnabled: kubectl -n kube-system get ds aws-efa-k8s-device-plugin-daemonset) and \
         the instance must have EFA",
    ));
    let mut vars: Vec<String> = a.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    vars.sort();
    let provider = a
        .env
        .iter()
        .find(|(k, _)| k == "FI_PROVIDER")
        .map(|(_, v)| v.as_str());
    let listed = if vars.is_empty() {
        "none set".to_string()
    } else {
        vars.join(" ")
    };
    out.push(if a.efa > 0 && provider != Some("efa") {
        check(
            Verdict::Warn,
            "nccl",
            format!("NCCL/libfabric variables: {listed}"),
            Some(
                "with EFA adapters, set FI_PROVIDER=efa (trainctl's training pods do) or \
                 NCCL falls back to TCP sockets"
                    .into(),
            ),
        )
    } else {
        check(
            Verdict::Ok,
            "nccl",
            format!("NCCL/libfabric variables: {listed}"),
            None,
        )
    });
    out
}

/// Whether the claim holds CIFAR-10 where the trainer looks for it: in the data folder itself
/// (`trainctl data synth`, `data job --synthetic`) or in the folder an official archive
/// extracts to, binary or python.
fn data_check(dir: &Path) -> Check {
    use contract::cifar10::{BIN_DIR, BINARY_MARK, PY_DIR, PYTHON_MARK, folders};
    let found = folders(dir)
        .into_iter()
        .find(|d| d.join(BINARY_MARK).is_file() || d.join(PYTHON_MARK).is_file());
    match found {
        Some(at) => check(
            Verdict::Ok,
            "data",
            format!("CIFAR-10 is in {}", at.display()),
            None,
        ),
        None => check(
            Verdict::Warn,
            "data",
            format!(
                "no CIFAR-10 in {} yet (no {BINARY_MARK} or {PYTHON_MARK} there, nor under \
                 {BIN_DIR}/ or {PY_DIR}/)",
                dir.display()
            ),
            Some("run `trainctl data job` before the training job".into()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accelerators(root: &Path, gpus: u32, efa: u32, env: &[(&str, &str)]) -> Vec<Check> {
        accelerator_checks(&Accelerators {
            gpus,
            efa,
            root: root.to_path_buf(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
    }

    #[test]
    fn gpus_and_efa_adapters_are_counted_against_the_request() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("dev");
        std::fs::create_dir_all(dev.join("infiniband")).unwrap();
        for f in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia10"] {
            std::fs::write(dev.join(f), "").unwrap();
        }
        std::fs::write(dev.join("infiniband/uverbs0"), "").unwrap();
        std::fs::create_dir_all(root.path().join("sys/class/infiniband/rdmap16s27")).unwrap();

        let c = accelerators(root.path(), 3, 1, &[("FI_PROVIDER", "efa")]);
        assert!(c.iter().all(|c| c.verdict == Verdict::Ok), "{c:?}");
        assert_eq!(
            c[0].detail,
            "3 GPUs in this pod (nvidia0, nvidia1, nvidia10), 3 requested"
        );
        assert_eq!(
            c[1].detail,
            "1 EFA adapters in this pod (rdmap16s27), 1 requested"
        );
        assert_eq!(c[2].detail, "NCCL/libfabric variables: FI_PROVIDER=efa");

        // Fewer than requested: the check fails and says which plugin to look at.
        let c = accelerators(root.path(), 8, 4, &[]);
        assert_eq!(c[0].verdict, Verdict::Fail);
        assert!(c[0].detail.starts_with("3 of the 8 GPUs"), "{}", c[0]);
        assert!(c[0].advice.as_ref().unwrap().contains("device plugin"));
        assert_eq!(c[1].verdict, Verdict::Fail);
        assert!(c[1].advice.as_ref().unwrap().contains("EFA device plugin"));
        // EFA without FI_PROVIDER=efa: NCCL would use TCP.
        assert_eq!(c[2].verdict, Verdict::Warn);
        assert!(c[2].detail.ends_with("none set"), "{}", c[2]);

        // A CPU pod: nothing requested, nothing to fail.
        let empty = tempfile::tempdir().unwrap();
        let c = accelerators(empty.path(), 0, 0, &[]);
        assert!(c.iter().all(|c| c.verdict == Verdict::Ok), "{c:?}");
        assert_eq!(c[0].detail, "0 GPUs in this pod, 0 requested");
    }

    /// Every layout the trainer reads is found: the binary files at the top (`data job
    /// --synthetic`), the python files at the top, and either archive's folder.
    #[test]
    fn the_data_check_finds_every_layout_the_trainer_reads() {
        let empty = tempfile::tempdir().unwrap();
        let c = data_check(empty.path());
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.detail.starts_with("no CIFAR-10 in"), "{c}");
        for (folder, file) in [
            ("", "data_batch_1.bin"),
            ("", "data_batch_1"),
            ("cifar-10-batches-bin", "data_batch_1.bin"),
            ("cifar-10-batches-py", "data_batch_1"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let at = match folder {
                "" => dir.path().to_path_buf(),
                sub => dir.path().join(sub),
            };
            std::fs::create_dir_all(&at).unwrap();
            std::fs::write(at.join(file), "").unwrap();
            let c = data_check(dir.path());
            assert_eq!(c.verdict, Verdict::Ok, "{folder}/{file}: {c}");
            assert_eq!(c.detail, format!("CIFAR-10 is in {}", at.display()));
        }
        // A test batch alone is no training set.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("test_batch.bin"), "").unwrap();
        assert_eq!(data_check(dir.path()).verdict, Verdict::Warn);
    }

    #[test]
    fn peers_are_told_apart_by_host_name_or_whole_address() {
        assert!(same_host(
            "cifar10-doctor-0.cifar10-doctor",
            "cifar10-doctor-0"
        ));
        assert!(!same_host(
            "cifar10-doctor-1.cifar10-doctor",
            "cifar10-doctor-0"
        ));
        assert!(!same_host("127.0.0.2", "127.0.0.1"));
        assert!(same_host("10.0.0.7", "10.0.0.7"));
    }
}
