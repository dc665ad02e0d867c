//! `doctor check` over real TCP: several "pods" on loopback addresses (127.0.0.x), one port.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use deploy::doctor::{self, Check, Plan, Verdict};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn plan(me: &str, peers: &[&str], port: u16, claim: PathBuf, timeout: Duration) -> Plan {
    Plan {
        peers: peers.iter().map(|p| p.to_string()).collect(),
        port,
        claim,
        data: None,
        me: me.into(),
        listen: format!("{me}:{port}").parse().unwrap(),
        timeout,
        // A CPU pod: nothing requested (the accelerator checks have their own unit test).
        accelerators: doctor::Accelerators {
            gpus: 0,
            efa: 0,
            root: claim_root(),
            env: Vec::new(),
        },
    }
}

/// An empty directory as the pod's `/`: no devices.
fn claim_root() -> PathBuf {
    static ROOT: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| tempfile::tempdir().unwrap())
        .path()
        .to_path_buf()
}

fn run(plan: Plan) -> std::thread::JoinHandle<Vec<Check>> {
    std::thread::spawn(move || doctor::run(&plan, &mut |_| {}))
}

#[test]
fn every_pod_reaches_every_other_and_writes_the_claim() {
    let port = free_port();
    let claim = tempfile::tempdir().unwrap();
    let peers = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];
    // Started one after another, as pods are: the later ones are checked as they come up.
    let mut handles = Vec::new();
    for me in peers {
        handles.push(run(plan(
            me,
            &peers,
            port,
            claim.path().into(),
            Duration::from_secs(20),
        )));
        std::thread::sleep(Duration::from_millis(200));
    }
    for h in handles {
        let checks = h.join().unwrap();
        let text: Vec<String> = checks.iter().map(|c| c.to_string()).collect();
        assert!(
            checks.iter().all(|c| c.verdict == Verdict::Ok),
            "{}",
            text.join("\n")
        );
        // listen, 3 × (dns, connect), claim, gpu, efa, nccl: and no "inbound" warning.
        assert_eq!(checks.len(), 11, "{}", text.join("\n"));
        assert!(text[1].contains("rendezvous host 127.0.0.1"), "{}", text[1]);
    }
    assert_eq!(
        std::fs::read_dir(claim.path()).unwrap().count(),
        0,
        "the probe file is removed"
    );
}

#[test]
fn failures_say_which_check_and_what_to_do() {
    let port = free_port();
    let not_a_dir = tempfile::NamedTempFile::new().unwrap();
    let checks = doctor::run(
        &plan(
            "127.0.0.1",
            &["127.0.0.1", "127.0.0.2", "no-such-host.invalid"],
            port,
            not_a_dir.path().join("claim"),
            Duration::from_secs(2),
        ),
        &mut |_| {},
    );
    let fail = |name: &str| {
        checks
            .iter()
            .find(|c| c.name == name && c.verdict == Verdict::Fail)
            .map(|c| c.to_string())
            .unwrap_or_else(|| panic!("no failed {name} check in {checks:#?}"))
    };
    let connect = fail("connect");
    assert!(
        connect.contains("worker 127.0.0.2 does not accept connections on port"),
        "{connect}"
    );
    assert!(connect.contains("NetworkPolicies"), "{connect}");
    let dns = fail("dns");
    assert!(
        dns.contains("no-such-host.invalid does not resolve"),
        "{dns}"
    );
    assert!(dns.contains("publishNotReadyAddresses"), "{dns}");
    let claim = fail("claim");
    assert!(claim.contains("cannot write to"), "{claim}");
    assert!(claim.contains("access point"), "{claim}");
    let inbound = checks.iter().find(|c| c.name == "inbound").unwrap();
    assert_eq!(inbound.verdict, Verdict::Warn);
}

#[test]
fn a_taken_port_is_a_failed_check() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let claim = tempfile::tempdir().unwrap();
    let checks = doctor::run(
        &plan(
            "127.0.0.1",
            &["127.0.0.1"],
            port,
            claim.path().into(),
            Duration::from_secs(2),
        ),
        &mut |_| {},
    );
    assert_eq!(checks[0].name, "listen");
    assert_eq!(checks[0].verdict, Verdict::Fail);
    assert!(checks[0].to_string().contains("--rdzv-port"));
}
