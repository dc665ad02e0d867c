//! A random-fault soak of our own (issue 60): a 3-node elastic job (`--nnodes 2:3`) on
//! network-namespace hosts, the built-in trainer or a `trainctl.torch` program, c10d or etcd,
//! hit once by a fault drawn at random (a worker or a node killed, a node told to go, the
//! store's host killed or told to go, a worker stopped for a while, two nodes killed at once,
//! a link cut for a few seconds, the etcd server lost and back), with a replacement node
//! started a few seconds later where a node went. Every run must end with every sample of
//! every epoch trained exactly once, every rank's weights the same, and every node but the
//! victim exiting 0.
//!
//! The suite runs one seeded run of each program and backend; `chaos_soak` (ignored) runs
//! `TRAINCTL_CHAOS_RUNS` of them (bench/chaos.py drives it and writes the report), each run
//! replayable with `TRAINCTL_CHAOS_SEED`.

use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::*;

/// What a run does to the job, once.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// SIGKILL to one worker of host 2 or 3: its agent starts it again.
    WorkerKilled,
    /// SIGKILL to the agent of host 2 or 3 (its workers die with it).
    NodeKilled,
    /// SIGTERM to the agent of host 2 or 3: it leaves gracefully.
    NodeTold,
    /// SIGKILL to host 1's agent: the c10d store's host.
    HostKilled,
    /// SIGTERM to host 1's agent.
    HostTold,
    /// SIGSTOP to a worker of host 2 or 3 for this many seconds, then SIGCONT.
    WorkerStopped(u64),
    /// SIGKILL to the agents of hosts 2 and 3 at once.
    TwoNodesKilled,
    /// Host 3's link down for this many seconds.
    LinkCut(u64),
    /// The etcd server killed for this many seconds, then started again (its data kept).
    EtcdLost(u64),
}

impl Fault {
    /// Every fault that applies to `store`.
    fn all(store: Store) -> Vec<Fault> {
        let mut all = vec![
            Fault::WorkerKilled,
            Fault::NodeKilled,
            Fault::NodeTold,
            Fault::HostKilled,
            Fault::HostTold,
            Fault::WorkerStopped(3),
            Fault::WorkerStopped(25),
            Fault::TwoNodesKilled,
            Fault::LinkCut(4),
        ];
        if store == Store::Etcd {
            all.push(Fault::EtcdLost(5));
        }
        all
    }
}

/// The seeded draws of one run.
struct Draw(u64);

impl Draw {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

/// What a run will do, drawn from its seed.
#[derive(Debug, Clone, Copy)]
struct Plan {
    seed: u64,
    fault: Fault,
    /// The fault comes once training has reached this step.
    at_step: u64,
    /// A replacement node starts this long after its node went.
    replace_after: Duration,
    /// Host 2 or 3 (index 1 or 2 among the agents) for a fault on one node.
    node: usize,
}

impl Plan {
    fn draw(seed: u64, store: Store) -> Plan {
        let mut draw = Draw(seed);
        let faults = Fault::all(store);
        Plan {
            seed,
            fault: faults[draw.next(faults.len() as u64) as usize],
            at_step: 2 + draw.next(8),
            replace_after: Duration::from_secs(3 + draw.next(10)),
            node: 1 + draw.next(2) as usize,
        }
    }
}

/// One run of `c` as `plan` says; panics (naming the plan) when it does not end exactly.
/// Returns how long after its node went the replacement started, if one did.
fn chaos_run(mut c: Cluster, plan: Plan) -> Option<Duration> {
    let Plan {
        seed,
        fault,
        at_step,
        replace_after,
        node,
    } = plan;
    let label = format!("seed {seed}, {fault:?} at step {at_step}");
    // Long enough for the replacement to join before the end, most runs.
    c.epochs = c.epochs.max(8);
    // A node cut off as the job ends learns how it ended from the store's host, which keeps
    // the store up for it up to the close timeout: 10 s by default, against a 4 s cut and a
    // reconnect of up to a store timeout (3 s) on a loaded machine. Twice that, so that the
    // verdict is about the protocol, not the machine's speed.
    c.rdzv_conf = "last_call_timeout=0.5,close_timeout=20";
    eprintln!("chaos: {label}");
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 3)).collect();
    c.wait_for_progress(at_step);
    // The agents that must exit 0, and the hosts whose node went (a replacement follows).
    let mut victims: Vec<usize> = Vec::new();
    let mut gone_hosts: Vec<usize> = Vec::new();
    let worker_of = |c: &mut Cluster, agent: usize| -> i32 {
        c.agents[agent].wait_for_workers(1, JOB_TIMEOUT);
        *workers_of(&c.agents[agent])
            .last()
            .unwrap_or_else(|| panic!("{label}: agent {agent} started no worker"))
    };
    let signal = |c: &Cluster, agent: usize, s: Signal| {
        let _ = kill(Pid::from_raw(c.agents[agent].child.id() as i32), s);
    };
    match fault {
        Fault::WorkerKilled => {
            let _ = kill(
                Pid::from_raw(worker_of(&mut c, agents[node])),
                Signal::SIGKILL,
            );
        }
        Fault::NodeKilled => {
            c.kill(agents[node]);
            (victims, gone_hosts) = (vec![agents[node]], vec![node + 1]);
        }
        Fault::NodeTold => {
            signal(&c, agents[node], Signal::SIGTERM);
            (victims, gone_hosts) = (vec![agents[node]], vec![node + 1]);
        }
        Fault::HostKilled => {
            c.kill(agents[0]);
            (victims, gone_hosts) = (vec![agents[0]], vec![1]);
        }
        Fault::HostTold => {
            signal(&c, agents[0], Signal::SIGTERM);
            (victims, gone_hosts) = (vec![agents[0]], vec![1]);
        }
        Fault::WorkerStopped(secs) => {
            let worker = Pid::from_raw(worker_of(&mut c, agents[node]));
            let _ = kill(worker, Signal::SIGSTOP);
            std::thread::sleep(Duration::from_secs(secs));
            let _ = kill(worker, Signal::SIGCONT);
            // Stopped past the collective timeout, its node may be dropped: it is the victim.
            victims = vec![agents[node]];
        }
        Fault::TwoNodesKilled => {
            c.kill(agents[1]);
            c.kill(agents[2]);
            (victims, gone_hosts) = (vec![agents[1], agents[2]], vec![2, 3]);
        }
        Fault::LinkCut(secs) => {
            c.net.cut(3);
            std::thread::sleep(Duration::from_secs(secs));
            c.net.mend(3);
            victims = vec![agents[2]];
        }
        Fault::EtcdLost(secs) => {
            if let Some(etcd) = c.etcd.as_mut() {
                etcd.restart(Duration::from_secs(secs));
            }
        }
    }
    let finishers: Vec<usize> = agents
        .iter()
        .copied()
        .filter(|a| !victims.contains(a))
        .collect();
    let mut replacements = Vec::new();
    let replaced_after = (!gone_hosts.is_empty()).then(|| {
        let since = Instant::now();
        std::thread::sleep(replace_after);
        // The victims must have gone before their hosts start other agents.
        for &v in &victims {
            let _ = c.agents[v].wait(JOB_TIMEOUT);
        }
        for &host in &gone_hosts {
            replacements.push(c.start(host, 3));
        }
        since.elapsed()
    });
    let mut outputs = Vec::new();
    for &a in &finishers {
        outputs.push(succeeds(&mut c, a, &label));
    }
    // A replacement that joined trains to the end with the others; one that came after the
    // end (the job finished first) would wait for a new job: it is not part of this one. (On
    // Kubernetes the Job is over by then and no such pod starts.)
    for &a in &replacements {
        // Joined a round; or found the job over, or no store any more (under c10d the job's
        // store left with the end), or no one else to join.
        c.agents[a].wait_for_line(Duration::from_secs(60), |l| {
            l.contains("node rank ")
                || l.contains("has already finished")
                || l.contains("not reachable yet")
                || l.contains("still joining")
        });
        if c.agents[a].output().contains("node rank ") {
            outputs.push(succeeds(&mut c, a, &label));
        } else {
            eprintln!("chaos: {label}: the replacement came after the job's end");
            c.kill(a);
        }
    }
    for &v in &victims {
        let _ = c.agents[v].wait(JOB_TIMEOUT);
    }
    let all = outputs.join("\n");
    // Every rank that finished holds the same weights; every epoch of every rank trained each
    // image exactly once (the metrics' digests).
    let fingerprints: std::collections::BTreeSet<String> =
        finished(&all).into_iter().map(|(_, _, f)| f).collect();
    assert_eq!(fingerprints.len(), 1, "{label}: one set of weights:\n{all}");
    c.verify_every_image_once(false);
    if matches!(c.program, Program::Builtin) {
        let p = c.progress().expect("the final checkpoint verifies");
        assert_eq!(
            p["samples_seen"].as_u64(),
            Some(c.epochs * TRAIN_IMAGES),
            "{label}: {p}"
        );
    }
    replaced_after
}

/// Waits for agent `a`, which must exit 0 (it is not the victim); its output.
fn succeeds(c: &mut Cluster, a: usize, label: &str) -> String {
    let status = c.agents[a].wait(JOB_TIMEOUT);
    let out = c.agents[a].output();
    assert!(
        status.success(),
        "{label}: agent {a} failed: {status}\n{out}"
    );
    out
}

/// The seed of a run: `TRAINCTL_CHAOS_SEED`, else drawn from the process id and `salt`.
fn seed(salt: u64) -> u64 {
    #[allow(clippy::disallowed_methods)] // a test's own knob, not the worker environment
    std::env::var("TRAINCTL_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            u64::from(std::process::id())
                .wrapping_mul(31)
                .wrapping_add(salt)
        })
}

fn one_run(cluster: Option<Cluster>, salt: u64) {
    let Some(c) = cluster else {
        return;
    };
    let plan = Plan::draw(seed(salt), c.store);
    // The plan heads any failure's message: CI keeps a failing test's message, not always
    // its stderr, and TRAINCTL_CHAOS_SEED replays the run.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| chaos_run(c, plan))) {
        Ok(replaced_after) => {
            eprintln!("chaos: {plan:?}, replacement after {replaced_after:?}: exact")
        }
        Err(e) => {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!(
                "{plan:?} (replay: TRAINCTL_CHAOS_SEED={}): {why}",
                plan.seed
            );
        }
    }
}

#[test]
fn c10d_a_random_fault_finishes_exactly() {
    one_run(Cluster::new(Store::C10d, "chaos-c10d"), 1);
}

#[test]
fn etcd_a_random_fault_finishes_exactly() {
    one_run(Cluster::new(Store::Etcd, "chaos-etcd"), 2);
}

#[test]
fn c10d_pytorch_a_random_fault_finishes_exactly() {
    one_run(Cluster::pytorch(Store::C10d, "chaos-c10d-pytorch"), 3);
}

/// `TRAINCTL_CHAOS_RUNS` runs (default 10), the program and backend alternating, each with a
/// fault drawn at random; one line per run (`CHAOS RESULT ...`), which bench/chaos.py reads.
/// A run that does not end exactly is reported with its seed and the soak goes on.
#[test]
#[ignore = "a long soak: bench/chaos.py runs it"]
fn chaos_soak() {
    #[allow(clippy::disallowed_methods)]
    let runs: u64 = std::env::var("TRAINCTL_CHAOS_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let base = seed(0);
    let mut failed = 0;
    for i in 0..runs {
        let seed = base.wrapping_add(i.wrapping_mul(7919));
        let store = if i % 2 == 0 { Store::C10d } else { Store::Etcd };
        let pytorch = (i / 2) % 2 == 1;
        let name = format!("chaos-{i}");
        let cluster = if pytorch {
            Cluster::pytorch(store, &name)
        } else {
            Cluster::new(store, &name)
        };
        let Some(c) = cluster else {
            return;
        };
        let program = if pytorch {
            "trainctl.torch"
        } else {
            "built-in"
        };
        let backend = c.backend();
        let plan = Plan::draw(seed, store);
        let what = format!(
            "run={i} seed={seed} backend={backend} program={program} fault={:?} step={}",
            plan.fault, plan.at_step
        )
        .replace(['(', ')'], "");
        let started = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| chaos_run(c, plan)));
        let took = started.elapsed().as_secs_f64();
        match result {
            Ok(replaced_after) => println!(
                "CHAOS RESULT {what} replaced_after={} seconds={took:.1} ok",
                replaced_after.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64()))
            ),
            Err(e) => {
                failed += 1;
                let why = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let first = why.lines().next().unwrap_or("").to_string();
                println!("CHAOS RESULT {what} seconds={took:.1} FAILED {first}");
            }
        }
    }
    assert_eq!(failed, 0, "{failed} of {runs} runs did not end exactly");
}

/// The fault the soak draws least often, every time: the etcd server lost for 5 s and back
/// (its data kept, as a restarted pod with its volume); the agents train on and finish.
#[test]
fn etcd_the_etcd_servers_loss_and_return_finishes_exactly() {
    let Some(c) = Cluster::new(Store::Etcd, "chaos-etcd-lost") else {
        return;
    };
    let plan = Plan {
        fault: Fault::EtcdLost(5),
        ..Plan::draw(seed(4), Store::Etcd)
    };
    chaos_run(c, plan);
}
