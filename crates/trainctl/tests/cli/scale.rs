//! Rendezvous at a size CI can afford: 32 agents on loopback, each running `sleep`, for both
//! backends. Correctness, not speed (bench/rdzv_scale.py measures that): the job starts in
//! one round of 32 after a few at most (late agents admitted together, not one round each),
//! and a killed agent's 31 survivors all land in one round of 31.
//! A plain program holds no late node at its first start.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testkit::{EtcdServer, free_port};

use crate::support::*;

const AGENTS: usize = 32;
/// Generous: 32 debug-built agents share CI's two cores with whatever else runs.
const DEADLINE: Duration = Duration::from_secs(120);

/// What one agent printed: every round (number, world size), and whether it hosts the store.
#[derive(Default)]
struct Seen {
    rounds: Vec<(u64, u32)>,
    hosts: bool,
    lines: Vec<String>,
}

struct Agents {
    children: Vec<Child>,
    seen: Vec<Arc<Mutex<Seen>>>,
}

impl Agents {
    fn start(backend: &str, endpoint: &str, run_id: &str) -> Agents {
        let mut agents = Agents {
            children: Vec::new(),
            seen: Vec::new(),
        };
        for _ in 0..AGENTS {
            agents.add(backend, endpoint, run_id, AGENTS / 2, AGENTS);
        }
        agents
    }

    /// Starts one more agent of a `--nnodes MIN:MAX` job.
    fn add(&mut self, backend: &str, endpoint: &str, run_id: &str, min: usize, max: usize) {
        let agents = self;
        {
            let mut child = trainctl()
                .args(["run", "--nnodes", &format!("{min}:{max}")])
                .args(["--rdzv-backend", backend, "--rdzv-endpoint", endpoint])
                .args(["--rdzv-id", run_id, "--job-token", "scale-test"])
                // What is measured is the rendezvous: 32 health checks at once on two cores
                // would be most of the test's CPU.
                .args(["--health-check", "off"])
                .args(["--", "sleep", "600"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("trainctl starts");
            let seen = Arc::new(Mutex::new(Seen::default()));
            let stderr = child.stderr.take().expect("piped");
            let into = seen.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let mut s = into.lock().unwrap();
                    if let Some(round) = parse_round(&line) {
                        s.rounds.push(round);
                    }
                    s.hosts |= line.contains("(hosted by this agent)");
                    s.lines.push(line);
                }
            });
            agents.children.push(child);
            agents.seen.push(seen);
        }
    }

    /// The latest round each of `which` agents printed.
    fn latest(&self, which: &[usize]) -> Vec<Option<(u64, u32)>> {
        which
            .iter()
            .map(|&i| self.seen[i].lock().unwrap().rounds.last().copied())
            .collect()
    }

    /// Waits until every agent of `which` has printed one same round of `world_size`, within
    /// [`DEADLINE`].
    fn wait_for_round(&self, which: &[usize], world_size: u32) -> u64 {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let latest = self.latest(which);
            let rounds: BTreeSet<_> = latest.iter().collect();
            if let [Some((round, ws))] = rounds.into_iter().collect::<Vec<_>>()[..]
                && *ws == world_size
            {
                return *round;
            }
            if Instant::now() > deadline {
                let stuck = which
                    .iter()
                    .find(|&&i| self.latest(&[i])[0].is_none_or(|(_, ws)| ws != world_size))
                    .copied()
                    .unwrap_or(which[0]);
                panic!(
                    "no round of {world_size} agreed by all {} agents within {DEADLINE:?}; latest rounds: {latest:?}; agent {stuck}'s output:\n{}",
                    which.len(),
                    self.seen[stuck].lock().unwrap().lines.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agents {
    /// SIGTERM first, so that each agent stops its workers and removes its scratch folder (a
    /// SIGKILL leaves one per agent in the temporary folder); SIGKILL what is left after 10 s.
    fn drop(&mut self) {
        for child in &self.children {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for child in &mut self.children {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `(round, world size)` of a "round R: node rank ... world size W" line.
fn parse_round(line: &str) -> Option<(u64, u32)> {
    let rest = line.split("trainctl run: round ").nth(1)?;
    let round = rest.split(':').next()?.parse().ok()?;
    let ws = rest
        .split("world size ")
        .nth(1)?
        .split(',')
        .next()?
        .parse()
        .ok()?;
    Some((round, ws))
}

fn scenario(backend: &str, endpoint: &str) {
    let run_id = format!("scale-{backend}-{}", std::process::id());
    let agents = Agents::start(backend, endpoint, &run_id);
    let all: Vec<usize> = (0..AGENTS).collect();
    let formed = agents.wait_for_round(&all, AGENTS as u32);
    // Started at once, the agents form a first round at MIN or more and admit the rest in one
    // more; a slow start may cost another. One round per late agent (the storm this replaced)
    // would be many more.
    assert!(
        formed <= 3,
        "{AGENTS} agents took {} rounds to start together",
        formed + 1
    );
    let victim = (1..AGENTS)
        .find(|&i| !agents.seen[i].lock().unwrap().hosts)
        .expect("an agent that does not host the store");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agents.children[victim].id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("the agent is killed");
    let survivors: Vec<usize> = all.iter().copied().filter(|&i| i != victim).collect();
    let regrouped = agents.wait_for_round(&survivors, AGENTS as u32 - 1);
    assert!(regrouped > formed);
}

#[test]
fn thirty_two_agents_form_one_round_and_regroup_after_a_kill_c10d() {
    let port = free_port();
    scenario("c10d", &format!("127.0.0.1:{port}"));
}

#[test]
fn thirty_two_agents_form_one_round_and_regroup_after_a_kill_etcd() {
    let etcd = EtcdServer::start();
    scenario("etcd", &etcd.url());
}

/// Four agents train; four more arrive 0.3 s apart. They are admitted together: one new round
/// (the job then full) instead of one per arrival, each of which would restart a program.
fn late_agents(backend: &str, endpoint: &str) {
    let run_id = format!("late-{backend}-{}", std::process::id());
    let mut agents = Agents {
        children: Vec::new(),
        seen: Vec::new(),
    };
    for _ in 0..4 {
        agents.add(backend, endpoint, &run_id, 2, 8);
    }
    let first: Vec<usize> = (0..4).collect();
    let formed = agents.wait_for_round(&first, 4);
    for _ in 0..4 {
        agents.add(backend, endpoint, &run_id, 2, 8);
        std::thread::sleep(Duration::from_millis(300));
    }
    let all: Vec<usize> = (0..8).collect();
    let grown = agents.wait_for_round(&all, 8);
    let sizes: Vec<Vec<u32>> = first
        .iter()
        .map(|&i| {
            let s = agents.seen[i].lock().unwrap();
            s.rounds.iter().map(|&(_, ws)| ws).collect()
        })
        .collect();
    assert_eq!(
        grown,
        formed + 1,
        "the four late agents must be admitted by one round; the first agents saw world sizes {sizes:?}"
    );
}

#[test]
fn late_agents_are_admitted_together_c10d() {
    late_agents("c10d", &format!("127.0.0.1:{}", free_port()));
}

#[test]
fn late_agents_are_admitted_together_etcd() {
    let etcd = EtcdServer::start();
    late_agents("etcd", &etcd.url());
}

/// A program that cannot say it regroups in place (`sleep`: not Python, not the built-in
/// trainer) holds no late node at its first start: the agent that arrives while the first
/// agent's workers start is admitted after the join window, not after the 20 s a PyTorch
/// program's start may hold it (the launcher's `ADMISSION_HOLD`), which 256 agents once paid
/// in a row. Under 15 s here; the hold would be 20 s from the workers' start.
#[test]
fn a_program_that_is_not_python_holds_no_late_node_at_its_first_start() {
    let port = free_port();
    let endpoint = format!("127.0.0.1:{port}");
    let run_id = format!("nohold-{}", std::process::id());
    let mut agents = Agents {
        children: Vec::new(),
        seen: Vec::new(),
    };
    agents.add("c10d", &endpoint, &run_id, 1, 2);
    agents.wait_for_round(&[0], 1);
    let arrived = Instant::now();
    agents.add("c10d", &endpoint, &run_id, 1, 2);
    agents.wait_for_round(&[0, 1], 2);
    let waited = arrived.elapsed();
    assert!(
        waited < Duration::from_secs(15),
        "the late agent was admitted {waited:?} after it started: held for the first workers' start"
    );
}
