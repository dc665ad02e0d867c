//! The elastic agent across real hosts: network namespaces on one bridge (198.18.0.0/24), one
//! agent per host, a real etcd server on its own host for the etcd backend. Every scenario
//! trains a small generated set to the end and checks that the job finished, that the final
//! checkpoint verifies, that exactly `epochs × data-set size` samples were trained (nothing
//! skipped, nothing trained twice beyond the last checkpoint) and that the model evaluates.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use telemetry::metrics::{Record, rank_file, read_metrics};
use testkit::{EtcdServer, Network};

use crate::support::*;

mod chaos;
mod hugging_face;
mod lightning;
mod patterns;
mod stragglers;
mod warm;

const TRAIN_IMAGES: u64 = 320;
const EPOCHS: u64 = 2;
/// Long enough for a slow CI machine busy with the rest of the suite.
const JOB_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, PartialEq)]
enum Store {
    C10d,
    Etcd,
}

/// What the agents run.
#[derive(Clone)]
enum Program {
    /// `trainctl train`.
    Builtin,
    /// A PyTorch program under this Python (with torch), the package (`trainctl.torch`, `.hf`,
    /// `.lightning`) from the checkout.
    PyTorch { python: PathBuf, script: Script },
}

/// Which PyTorch program.
#[derive(Clone)]
enum Script {
    /// examples/pytorch/elastic_cifar.py.
    Example,
    /// The loop of fixtures/loop_patterns.py with these flags.
    Patterns(Vec<&'static str>),
    /// The Hugging Face Trainer script of fixtures/hf_trainer.py through `trainctl.hf`.
    HuggingFace,
    /// The Lightning script of fixtures/lightning_trainer.py through `trainctl.lightning`,
    /// with these flags.
    Lightning(Vec<&'static str>),
}

struct Cluster {
    job: Job,
    program: Program,
    store: Store,
    endpoint: String,
    run_id: String,
    agents: Vec<Running>,
    /// `--nnodes` for the agents started from now on.
    nnodes: &'static str,
    /// `--regroup` for every agent.
    regroup: &'static str,
    /// `--collective-timeout` for every agent, in seconds.
    collective_timeout: u32,
    /// `--rdzv-conf` for every agent.
    rdzv_conf: &'static str,
    epochs: u64,
    /// The built-in trainer's `--checkpoint-every`.
    checkpoint_every: u64,
    /// More flags of `trainctl run`, and of `train`.
    run_args: Vec<&'static str>,
    train_args: Vec<&'static str>,
    /// A PyTorch program's steps sleep SECONDS while its world is smaller than WORLD
    /// ("WORLD:SECONDS", fixtures/slow_steps): a job that a node joins outlasts the joiner's
    /// warm start, as a real one would.
    slow_below: Option<&'static str>,
    etcd: Option<EtcdServer>,
    // Dropped after the processes: the namespaces outlive every process started in them.
    net: Network,
    /// Held from the cluster's start until its namespaces are gone (see [`ONE_CLUSTER`]).
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

/// One cluster at a time in this test binary. Each is three agents and their workers (and an
/// etcd server) on this 2-core machine: with two at once, each node had a third of a core, and
/// what the scenarios time (heartbeats, the ranks' straggler verdicts, a link cut's abort)
/// depended on the other scenario's load. On a faster machine of the project's kind, three
/// scenarios failed beside another one, one or two in each of two full runs, and each passed
/// alone (3 of 3, 2 of 2) and in its group. One at a time, one of the next two full runs still
/// failed once (a PyTorch worker stuck in gloo's connect while a node joined): the lock lessens
/// the load, it does not remove every race. The rest of the binary still runs beside the one
/// cluster.
static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Cluster {
    /// Four hosts: host 0 runs etcd (etcd backend), hosts 1-3 run agents; the c10d store is
    /// hosted by the agent of host 1. `None` (after a loud message) where namespaces are refused.
    fn new(store: Store, name: &str) -> Option<Cluster> {
        // A scenario that failed while holding it poisons the lock; the next one may still run.
        let one_at_a_time = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        let net = match Network::create(4) {
            Ok(n) => n,
            Err(e) => {
                eprintln!(
                    "SKIPPED {name}: this kernel or user cannot create network namespaces ({e})"
                );
                return None;
            }
        };
        let (etcd, endpoint) = match store {
            Store::Etcd => {
                let etcd = EtcdServer::start_at(Some(net.host(0)), &net.addr(0), 2379, 2380);
                let url = etcd.url();
                (Some(etcd), url)
            }
            Store::C10d => (None, format!("{}:29400", net.addr(1))),
        };
        Some(Cluster {
            job: Job::new(TRAIN_IMAGES as usize, 64),
            program: Program::Builtin,
            store,
            endpoint,
            run_id: name.to_string(),
            agents: Vec::new(),
            nnodes: "2:3",
            regroup: "in-process",
            collective_timeout: 20,
            rdzv_conf: "last_call_timeout=0.5",
            epochs: EPOCHS,
            checkpoint_every: 2,
            run_args: Vec::new(),
            train_args: Vec::new(),
            slow_below: None,
            etcd,
            net,
            _one_at_a_time: one_at_a_time,
        })
    }

    fn backend(&self) -> &'static str {
        match self.store {
            Store::C10d => "c10d",
            Store::Etcd => "etcd",
        }
    }

    fn command(&self, host: usize, max_restarts: u32) -> Command {
        let mut cmd = self.net.command(host, env!("CARGO_BIN_EXE_trainctl"));
        for var in [
            "RUST_LOG",
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            cmd.env_remove(var);
        }
        cmd.current_dir(self.job.dir.path())
            .args(["run", "--nnodes", self.nnodes, "--nproc-per-node", "1"])
            .args(["--rdzv-backend", self.backend()])
            .args(["--rdzv-endpoint", &self.endpoint])
            .args(["--rdzv-id", &self.run_id])
            .args(["--rdzv-conf", self.rdzv_conf])
            .args(["--job-token", "elastic-test"])
            .args(["--max-restarts", &max_restarts.to_string()])
            .args(["--collective-timeout", &self.collective_timeout.to_string()])
            .args(["--regroup", self.regroup])
            .args(&self.run_args);
        match &self.program {
            Program::Builtin => cmd
                .args(["train", "--data", "data", "--out", "runs"])
                .args(["--epochs", &self.epochs.to_string(), "--batch-size", "16"])
                .args(["--threads", "1", "--print-freq", "2"])
                .args(["--checkpoint-every", &self.checkpoint_every.to_string()])
                .args(&self.train_args)
                .arg("--no-eval"),
            Program::PyTorch { python, script } => {
                let (program, flags) = match script {
                    Script::HuggingFace => (
                        "tests/cli/fixtures/hf_trainer.py",
                        vec!["--samples", "320", "--batch-size", "16"],
                    ),
                    Script::Example => (
                        "../../examples/pytorch/elastic_cifar.py",
                        vec!["--batch-size", "16", "--threads", "1", "--print-freq", "2"],
                    ),
                    Script::Patterns(flags) => {
                        ("tests/cli/fixtures/loop_patterns.py", flags.clone())
                    }
                    Script::Lightning(flags) => {
                        ("tests/cli/fixtures/lightning_trainer.py", flags.clone())
                    }
                };
                let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cli/fixtures");
                let mut path = testkit::python_package().into_os_string();
                if let Some(slow) = self.slow_below {
                    path.push(":");
                    path.push(fixtures.join("slow_steps"));
                    cmd.env("TRAINCTL_TEST_SLOW_BELOW", slow);
                }
                cmd.env("PYTHONPATH", path)
                    .arg("--")
                    .arg(python)
                    .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(program))
                    .args(["--data", "data", "--out", "runs"])
                    .args(["--epochs", &self.epochs.to_string()])
                    .args(flags)
            }
        };
        cmd
    }

    /// The same cluster running the PyTorch example instead (`None`, after a loud message,
    /// where there is no Python with torch); many short epochs, so that a kill or a join
    /// lands mid-run.
    fn pytorch(store: Store, name: &str) -> Option<Cluster> {
        let Some(python) = testkit::python_with_torch() else {
            eprintln!(
                "SKIPPED {name}: no Python with torch (scripts/test installs it; or set TRAINCTL_TEST_PYTHON)"
            );
            return None;
        };
        let mut c = Cluster::new(store, name)?;
        c.program = Program::PyTorch {
            python,
            script: Script::Example,
        };
        c.epochs = 12;
        Some(c)
    }

    /// The same cluster running the Hugging Face Trainer script (fixtures/hf_trainer.py)
    /// through `trainctl.hf`: `None`, after a loud message, where the Python has no
    /// transformers.
    fn hugging_face(store: Store, name: &str) -> Option<Cluster> {
        let mut c =
            Cluster::pytorch_script(store, name, Script::HuggingFace, "transformers, accelerate")?;
        c.epochs = 6;
        Some(c)
    }

    /// The PyTorch cluster running `script`: `None`, after a loud message, where the Python
    /// cannot import `modules`.
    fn pytorch_script(store: Store, name: &str, script: Script, modules: &str) -> Option<Cluster> {
        let mut c = Cluster::pytorch(store, name)?;
        let Program::PyTorch { python, script: s } = &mut c.program else {
            return None;
        };
        if !testkit::python_imports(python, modules) {
            eprintln!(
                "SKIPPED {name}: no {modules} in {} (scripts/test installs it)",
                python.display()
            );
            return None;
        }
        *s = script;
        Some(c)
    }

    /// Waits until training has reached `step`: the built-in trainer's checkpoint there, or
    /// a PyTorch worker's step record.
    fn wait_for_progress(&self, step: u64) {
        match self.program {
            Program::Builtin => self.wait_for_step(step),
            Program::PyTorch { .. } => self.wait_for_recorded_step(step),
        }
    }

    /// The job's end, as its program shows it (see `verify_finished` and
    /// `verify_pytorch_finished`).
    fn verify_end(&self, outputs: &[String], world_size: usize) {
        match &self.program {
            Program::Builtin => self.verify_finished(outputs, world_size),
            Program::PyTorch { script, .. } => {
                if let Script::Lightning(_) = script {
                    return lightning::verify(outputs, world_size);
                }
                self.verify_pytorch_finished(outputs, world_size);
                match script {
                    Script::Patterns(flags) => patterns::verify(outputs, world_size, flags),
                    Script::HuggingFace => hugging_face::verify(outputs, world_size),
                    Script::Example | Script::Lightning(_) => {}
                }
            }
        }
    }

    /// Waits until a worker's metrics record a step at `step` or later.
    fn wait_for_recorded_step(&self, step: u64) {
        testkit::eventually(&format!("a step record at {step}"), JOB_TIMEOUT, || {
            self.metrics().iter().flatten().any(|r| match r {
                Record::Step(s) => s.step >= step,
                _ => false,
            })
        });
    }

    /// The end of a PyTorch run: every rank's weights the same, every sample of every epoch
    /// trained once (the samples count), ending at `world_size`; the test accuracy printed.
    fn verify_pytorch_finished(&self, outputs: &[String], world_size: usize) {
        let all = outputs.join("\n");
        let ends = finished(&all);
        let fingerprints: std::collections::BTreeSet<_> =
            ends.iter().map(|(_, _, f)| f.clone()).collect();
        assert_eq!(
            fingerprints.len(),
            1,
            "every rank ends with the same weights:\n{all}"
        );
        assert_eq!(ends.len(), world_size, "{all}");
        assert!(
            all.contains(&format!(
                "(world size {world_size}, {} samples trained in all)",
                self.epochs * TRAIN_IMAGES
            )),
            "{all}"
        );
        let example = matches!(
            self.program,
            Program::PyTorch {
                script: Script::Example,
                ..
            }
        );
        assert!(
            !example || all.contains("Accuracy of the network on the 64 test images"),
            "{all}"
        );
    }

    fn start(&mut self, host: usize, max_restarts: u32) -> usize {
        let agent = Running::start(&mut self.command(host, max_restarts));
        self.agents.push(agent);
        self.agents.len() - 1
    }

    fn checkpoint(&self) -> PathBuf {
        self.job
            .path("runs")
            .join(&self.run_id)
            .join("checkpoint.ckpt")
    }

    /// Waits until training has written a checkpoint at `step` or later.
    fn wait_for_step(&self, step: u64) {
        testkit::eventually(&format!("a checkpoint at step {step}"), JOB_TIMEOUT, || {
            self.progress()
                .is_some_and(|p| p["global_step"].as_u64() >= Some(step))
        });
    }

    /// The same command again on the three hosts, after a stop: it resumes from the
    /// checkpoint (said on some node's output) and every node succeeds; their outputs.
    fn run_again_from_the_checkpoint(&mut self) -> Vec<String> {
        let again: Vec<usize> = (1..=3).map(|h| self.start(h, 1)).collect();
        let outputs: Vec<String> = again.iter().map(|&a| self.succeeds(a)).collect();
        assert!(
            outputs.iter().any(|o| o.contains("resum")),
            "the second run resumes from the checkpoint:\n{}",
            outputs.join("\n")
        );
        outputs
    }

    /// The last global step any rank's metrics recorded (the job trained some).
    fn last_recorded_step(&self) -> u64 {
        self.metrics()
            .iter()
            .flatten()
            .filter_map(|r| match r {
                Record::Step(s) => Some(s.step),
                _ => None,
            })
            .max()
            .expect("steps were trained")
    }

    /// The global step a PyTorch run's checkpoint (`trainctl.torch`'s) holds.
    fn torch_checkpoint_step(&self) -> Option<u64> {
        let Program::PyTorch { python, .. } = &self.program else {
            return None;
        };
        let path = self
            .job
            .path("runs")
            .join(&self.run_id)
            .join("checkpoint.pt");
        let out = Command::new(python)
            .arg("-c")
            .arg("import sys, torch; print(torch.load(sys.argv[1], weights_only=True)['progress']['global_step'])")
            .arg(path)
            .output()
            .ok()?;
        text(&out.stdout).trim().parse().ok()
    }

    fn progress(&self) -> Option<serde_json::Value> {
        let out = trainctl()
            .arg("checkpoint")
            .arg(self.checkpoint())
            .arg("--json")
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    fn kill(&mut self, agent: usize) {
        let _ = self.agents[agent].child.kill();
        let _ = self.agents[agent].child.wait();
    }

    /// Waits for `agent` to exit 0; returns its output.
    fn succeeds(&mut self, agent: usize) -> String {
        let status = self.agents[agent].wait(JOB_TIMEOUT);
        let out = self.agents[agent].output();
        assert!(status.success(), "agent {agent} failed: {status}\n{out}");
        out
    }

    /// The job's end as the issue defines it: finished, checkpoint verifies, every sample of
    /// every epoch trained exactly once, final model evaluates; `world_size` at the end.
    fn verify_finished(&self, outputs: &[String], world_size: usize) {
        let p = self.progress().expect("the final checkpoint verifies");
        assert_eq!(p["epoch"].as_u64(), Some(self.epochs), "{p}");
        assert_eq!(
            p["samples_seen"].as_u64(),
            Some(self.epochs * TRAIN_IMAGES),
            "samples trained must add up to epochs × data set: {p}"
        );
        let all = outputs.join("\n");
        let fingerprints: std::collections::BTreeSet<_> =
            finished(&all).into_iter().map(|(_, _, f)| f).collect();
        assert_eq!(
            fingerprints.len(),
            1,
            "every rank ends with the same weights:\n{all}"
        );
        assert!(
            all.contains(&format!(
                "(world size {world_size}, {} samples",
                self.epochs * TRAIN_IMAGES
            )),
            "expected the job to end at world size {world_size}:\n{all}"
        );
        let model = self
            .job
            .path("runs")
            .join(&self.run_id)
            .join("model.safetensors");
        let eval = run_ok(
            trainctl()
                .arg("eval")
                .arg("--model")
                .arg(&model)
                .arg("--data")
                .arg(self.job.data()),
        );
        assert!(
            text(&eval.stdout).contains("Accuracy"),
            "{}",
            text(&eval.stdout)
        );
    }
}

impl Cluster {
    /// Every rank's metrics records, rank by rank.
    fn metrics(&self) -> Vec<Vec<Record>> {
        let dir = self.job.path("runs").join(&self.run_id);
        (0..3)
            .map(|rank| rank_file(&dir, rank))
            .filter(|f| f.is_file())
            .map(|f| read_metrics(&f).unwrap().records)
            .collect()
    }

    /// Exactly once, as the metrics say: in every rank's file the global steps only rise (no
    /// step trained again; a regroup or start record starts the count again from the step its
    /// writer kept or started at, as the file may change hands, and after a regroup the
    /// previous holder's last record may still come), a regroup or start goes on at the step
    /// after that one, a regroup drops none, and
    /// every epoch of every rank trained each image once (its samples' digest).
    fn verify_exactly_once(&self) {
        self.verify_every_image_once(true);
    }

    /// Every epoch of every rank trained each image once (its samples' digest); with
    /// `no_step_again`, also no global step trained twice (a restart may train the step in
    /// flight again, whose update was lost with the restarted workers).
    fn verify_every_image_once(&self, no_step_again: bool) {
        let all = every_image(TRAIN_IMAGES as usize);
        for (rank, records) in self.metrics().iter().enumerate() {
            let mut last_step = 0;
            let mut after_regroup: Option<u64> = None;
            // The group size before the last regroup, while its new holder has not stepped.
            let mut old_group: Option<u32> = None;
            // The records up to record `i`, for a failure's message: a race seen once is read
            // from them, as the cluster's files are gone with it.
            let before = |i: usize| format!("{:#?}", &records[i.saturating_sub(12)..=i]);
            for (i, r) in records.iter().enumerate() {
                match r {
                    // The file's previous holder, leaving, may write its last step after the new
                    // holder's regroup record (a node stopped mid-write): a step of the old
                    // group's size, no later than the step kept, is that one.
                    Record::Step(s)
                        if after_regroup.is_some_and(|kept| s.step <= kept)
                            && old_group == Some(s.world_size) => {}
                    Record::Step(s) => {
                        old_group = None;
                        assert!(
                            s.step > last_step || !no_step_again,
                            "rank {rank}: step {} after step {last_step}; the file up to it: {}",
                            s.step,
                            before(i)
                        );
                        if let Some(kept) = after_regroup.take() {
                            assert_eq!(
                                s.step,
                                kept + 1,
                                "rank {rank}: the step after a regroup; the file up to it: {}",
                                before(i)
                            );
                        }
                        last_step = s.step;
                    }
                    // The worker that writes this file from here on (the rank's new holder)
                    // goes on from the step it kept, having dropped none it completed.
                    Record::Regroup(g) => {
                        assert_eq!(
                            g.steps_dropped,
                            0,
                            "rank {rank}: {g:?}; the file up to it: {}",
                            before(i)
                        );
                        last_step = g.step;
                        after_regroup = Some(g.step);
                        old_group =
                            (g.world_size_before != g.world_size).then_some(g.world_size_before);
                    }
                    // A worker that starts (the job's start, a restart, a node joining) holds
                    // this file from the step it starts at (a joiner's taken from a peer), as a
                    // regroup's new holder does: a regroup's holder may have gone on under
                    // another rank before a step here, the rank then empty until this start.
                    Record::Start(st) => {
                        last_step = st.step;
                        after_regroup = Some(st.step);
                        old_group = None;
                    }
                    Record::Epoch(e) => assert_eq!(
                        e.samples_digest.as_deref(),
                        Some(all.as_str()),
                        "rank {rank}, epoch {}: every image exactly once",
                        e.epoch
                    ),
                    _ => {}
                }
            }
        }
    }

    /// The metrics' `start` records: (from a peer, from a checkpoint).
    fn starts(&self) -> Vec<(bool, bool)> {
        self.metrics()
            .iter()
            .flatten()
            .filter_map(|r| match r {
                Record::Start(s) => Some((s.from_peer, s.resumed)),
                _ => None,
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for a in self.agents.iter_mut() {
            let _ = a.child.kill();
            let _ = a.child.wait();
        }
    }
}

/// Pids of the workers an agent said it started.
/// `(epoch, step, steps in the epoch)` of each loss line: `[E,  I] loss: ... (I/N steps, ...`.
fn step_counters(output: &str) -> Vec<(u32, u32, u32)> {
    output
        .lines()
        .filter_map(|l| {
            let (head, rest) = l.split_once("] loss: ")?;
            let (epoch, iter) = head.rsplit_once('[')?.1.split_once(',')?;
            let steps = rest.split_once('(')?.1.split_once(" steps")?.0;
            let (_, total) = steps.split_once('/')?;
            Some((
                epoch.trim().parse().ok()?,
                iter.trim().parse().ok()?,
                total.parse().ok()?,
            ))
        })
        .collect()
}

fn workers_of(agent: &Running) -> Vec<i32> {
    worker_pids(&agent.seen)
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

/// One of three agents killed (or cut off) mid-epoch: the other two go on at world size 2.
/// In place (the default), their workers are the ones they started, they go on from the step
/// they hold, and no worker starts again; with `--regroup restart`, every worker is restarted.
/// (`--max-restarts 1` in these scenarios: on a loaded machine a late heartbeat can reopen a
/// round under a regroup, which then fails once; past `--max-restarts` failed regroups the
/// agents would fall back to a restart, which is another test's case.)
fn agent_lost(cluster: Option<Cluster>, cut_link: bool, regroup: &'static str) {
    let Some(mut c) = cluster else {
        return;
    };
    c.regroup = regroup;
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_progress(2);
    let lost = agents[2];
    if cut_link {
        c.net.cut(3);
    } else {
        c.kill(lost);
    }
    let outputs = vec![c.succeeds(agents[0]), c.succeeds(agents[1])];
    assert!(
        outputs.iter().all(|o| o
            .lines()
            .any(|l| l.contains("round ") && l.contains(" of 2, "))),
        "the survivors must go on at a new round of 2 nodes:\n{}",
        outputs.join("\n")
    );
    c.verify_end(&outputs, 2);
    c.verify_every_image_once(regroup == "in-process");
    let all = outputs.join("\n");
    let starts: Vec<usize> = agents[..2]
        .iter()
        .map(|&a| workers_of(&c.agents[a]).len())
        .collect();
    if regroup == "in-process" {
        assert_eq!(starts, [1, 1], "no survivor's worker starts again:\n{all}");
        assert!(
            outputs
                .iter()
                .all(|o| o.contains("regrouped in place") && o.contains("world size 3 → 2")),
            "{all}"
        );
        assert!(
            c.starts().iter().all(|&(peer, resumed)| !peer && !resumed),
            "only the first start records: {:?}",
            c.starts()
        );
        // The epoch's step counter runs on through the regroup (its total grows with the
        // smaller world), not jumping to where the new world size would have been. Rank 0
        // prints the loss lines, and rank 0 may move between agents: the agents' lines
        // together are the sequence.
        let mut counters: Vec<(u32, u32, u32)> =
            outputs.iter().flat_map(|o| step_counters(o)).collect();
        counters.sort();
        counters.dedup_by_key(|&mut (e, i, _)| (e, i));
        assert!(counters.len() > 2, "{all}");
        for pair in counters.windows(2) {
            let ((e0, i0, _), (e1, i1, n1)) = (pair[0], pair[1]);
            // A loss line every 2 steps (`--print-freq 2`).
            assert!(
                (e1 == e0 && i1 == i0 + 2) || (e1 == e0 + 1 && i1 <= 2),
                "{pair:?}:\n{all}"
            );
            assert!(i1 <= n1, "{pair:?}:\n{all}");
        }
    } else {
        assert_eq!(
            starts,
            [2, 2],
            "--regroup restart restarts every worker:\n{all}"
        );
        assert!(!all.contains("regrouped in place"), "{all}");
    }
    if !cut_link {
        let _ = c.agents[lost].wait(Duration::from_secs(5));
        for pid in workers_of(&c.agents[lost]) {
            eventually(
                Duration::from_secs(10),
                "the killed agent's workers to die",
                || !alive(pid),
            );
        }
    }
}

/// A node cut off (its link down) while the other two finish the job without it: once its
/// link is back it learns that the job finished, and its workers, whose state is behind the
/// job's, leave without saving; it exits 0. `victim` is the host cut off, or `None` for the
/// host of the first round's rank 0 (whose worker would save as rank 0 if stopped).
/// Returns the victim's output and the host of the c10d store's.
fn cut_off_as_the_job_ends(
    cluster: Option<Cluster>,
    victim: Option<usize>,
) -> Option<(String, String)> {
    let mut c = cluster?;
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_progress(2);
    let host = victim.unwrap_or_else(|| {
        (1..=3)
            .find(|&h| {
                let line = c.agents[agents[h - 1]]
                    .wait_for_line(JOB_TIMEOUT, |l| l.contains("round 0: node rank "));
                line.contains("node rank 0 ")
            })
            .expect("one node holds rank 0")
    });
    let cut = agents[host - 1];
    c.net.cut(host);
    // The others finish without it: one of them exits (the c10d store's host stays a while).
    let others: Vec<usize> = agents.iter().copied().filter(|&a| a != cut).collect();
    let finisher = if c.store == Store::C10d {
        others[1]
    } else {
        others[0]
    };
    let mut outputs = vec![c.succeeds(finisher)];
    c.net.mend(host);
    let victim_out = c.succeeds(cut);
    for &a in &others {
        if a != finisher {
            outputs.push(c.succeeds(a));
        }
    }
    assert!(
        victim_out.contains("finished in a round without this node")
            && victim_out.contains("leave without saving"),
        "the node cut off must say how the job ended without it:\n{victim_out}"
    );
    // Its workers did not save: the checkpoint is the finished job's.
    c.verify_end(&outputs, 2);
    c.verify_every_image_once(true);
    let store_host = c.agents[agents[0]].output();
    Some((victim_out, store_host))
}

/// c10d: the store's host keeps the store up (a while) for the node lost during the job, so
/// that it learns how the job ended once its link is back (before, it waited the join
/// timeout, 10 minutes, for a store that had gone with the job).
#[test]
fn c10d_a_node_cut_off_as_the_job_ends_learns_it_finished() {
    let Some((_, store_host)) =
        cut_off_as_the_job_ends(Cluster::new(Store::C10d, "c10d-cut-end"), Some(3))
    else {
        return;
    };
    assert!(
        store_host.contains("keeping the rendezvous store up to"),
        "the store's host must say whom it keeps the store for:\n{store_host}"
    );
}

/// etcd: the node holding rank 0 cut off; the others finish (rank 0 now theirs) and save the
/// job's checkpoint. The cut-off node's old rank 0 must not save its older state over it.
#[test]
fn etcd_a_rank_0_node_cut_off_as_the_job_ends_does_not_save_over_the_job() {
    cut_off_as_the_job_ends(Cluster::new(Store::Etcd, "etcd-cut-end"), None);
}

/// SIGTERM, as Kubernetes sends a pod it deletes (drain, eviction, spot interruption).
/// A framework script's end lines (`MARKER R world W ...`, cut before `stop` where given):
/// one a rank, every one alike past the rank, at `world_size`, and no refusal or divergence.
fn verify_rank_ends(outputs: &[String], world_size: usize, marker: &str, stop: Option<&str>) {
    let all = outputs.join("\n");
    let ends: Vec<&str> = all
        .lines()
        .filter_map(|l| {
            let end = l.split(marker).nth(1)?;
            // Past the rank.
            let (_, rest) = end.split_once(' ')?;
            Some(stop.map_or(rest, |s| rest.split(s).next().unwrap_or(rest)))
        })
        .collect();
    assert_eq!(ends.len(), world_size, "an end line per rank:\n{all}");
    assert!(
        ends.iter()
            .all(|e| e == &ends[0] && e.starts_with(&format!("world {world_size} "))),
        "every rank ends with the same weights, step and learning rate: {ends:#?}\n{all}"
    );
    assert!(
        !all.contains("DivergedError") && !all.contains("UsageError"),
        "{all}"
    );
}

fn sigterm(agent: &Running) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

/// One of three agents told to go (SIGTERM) mid-epoch: it leaves at a step boundary and exits
/// 143, and the other two go on in place at world size 2: their workers are the ones they
/// started, nothing is read from a checkpoint, the step after the regroup follows the last one
/// trained, and every epoch trained each image once. `leaver` is the host told to go (host 1
/// hosts the c10d store).
fn agent_told_to_go(cluster: Option<Cluster>, leaver: usize) {
    let Some(mut c) = cluster else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_progress(2);
    let leaving = agents[leaver - 1];
    sigterm(&c.agents[leaving]);
    let status = c.agents[leaving].wait(JOB_TIMEOUT);
    let left = c.agents[leaving].output();
    assert_eq!(status.code(), Some(143), "the leaver exits 143:\n{left}");
    assert!(
        left.contains("leaves (SIGTERM): the others go on at world size 2"),
        "the leaver says what happened:\n{left}"
    );
    let stayed: Vec<usize> = agents.into_iter().filter(|&a| a != leaving).collect();
    let outputs: Vec<String> = stayed.iter().map(|&a| c.succeeds(a)).collect();
    let all = outputs.join("\n");
    assert!(
        outputs.iter().all(|o| o.contains("leaves (SIGTERM)")
            && o.contains("regrouped in place")
            && o.contains("world size 3 → 2")),
        "the others say the node left and go on in place:\n{all}"
    );
    assert!(
        !all.contains("restarting") && !all.contains("stopped on request"),
        "nobody restarts or stops:\n{all}"
    );
    let starts: Vec<usize> = stayed
        .iter()
        .map(|&a| workers_of(&c.agents[a]).len())
        .collect();
    assert_eq!(starts, [1, 1], "no survivor's worker starts again:\n{all}");
    assert!(
        c.starts().iter().all(|&(peer, resumed)| !peer && !resumed),
        "no start but the first ones, none from a checkpoint: {:?}",
        c.starts()
    );
    c.verify_end(&outputs, 2);
    c.verify_exactly_once();
    // A worker whose rank changed in the regroup prints under its new rank.
    for line in all.lines().filter(|l| l.contains(" finished after ")) {
        let said = line.split("rank ").nth(1).and_then(|r| r.split(' ').next());
        assert!(
            said.is_some_and(|r| line.starts_with(&format!("[{r}]:"))),
            "the prefix is the worker's current rank: {line}"
        );
    }
    for pid in workers_of(&c.agents[leaving]) {
        assert!(!alive(pid), "the leaver's workers exited with it");
    }
}

/// One of three agents told to go (SIGTERM) while it rejoins: a node was lost and the next
/// round still gathers (the lost node's heartbeat and the last call are given 20 s, so that
/// the signal lands there). The node that trained with it goes on, so it says so and its worker
/// leaves without saving (not "stopped on request", which saves) and it exits 143; the other goes on in place alone and
/// every epoch trains each image once.
#[test]
fn c10d_agent_told_to_go_while_it_regroups_leaves_without_saving() {
    let Some(mut c) = Cluster::new(Store::C10d, "c10d-leave-rejoining") else {
        return;
    };
    c.nnodes = "1:3";
    c.rdzv_conf = "last_call_timeout=20,heartbeat_timeout=20";
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_progress(2);
    c.kill(agents[2]);
    let leaver = agents[1];
    c.agents[leaver].wait_for_line(JOB_TIMEOUT, |l| l.contains("regroup at the next round"));
    sigterm(&c.agents[leaver]);
    let status = c.agents[leaver].wait(JOB_TIMEOUT);
    let left = c.agents[leaver].output();
    assert_eq!(status.code(), Some(143), "the leaver exits 143:\n{left}");
    assert!(
        left.contains("leaves (SIGTERM) while the job regroups: the next round forms without it"),
        "the leaver says it goes without saving:\n{left}"
    );
    assert!(
        !left.contains("stopped on request") && !left.contains("cannot leave alone"),
        "its worker leaves, not stopping the old way (which saves):\n{left}"
    );
    let out = c.succeeds(agents[0]);
    assert!(
        out.contains("regrouped in place") && out.contains("→ 1") && !out.contains("restarting"),
        "the other goes on in place alone:\n{out}"
    );
    assert_eq!(workers_of(&c.agents[agents[0]]).len(), 1, "{out}");
    c.verify_end(&[out], 1);
    c.verify_exactly_once();
}

/// Two of four agents told to go at the same moment, as `job scale 4 → 2` and a drain of two
/// pods do: both leave at a step boundary and exit 143, and the other two go on in place, in
/// one regroup 4 → 2 (the second leaver withdraws from the round the first reopened), their
/// workers never restarted and every image trained once an epoch. (They used to stop the whole
/// job: "cannot leave alone: the job is between rounds".)
fn two_agents_told_to_go_at_once(store: Store, name: &str) {
    let Some(mut c) = Cluster::new(store, name) else {
        return;
    };
    c.nnodes = "2:4";
    // Two agents on host 2: four nodes on the cluster's three agent hosts.
    let agents: Vec<usize> = [1, 2, 2, 3].iter().map(|&h| c.start(h, 1)).collect();
    for &a in &agents {
        c.agents[a].wait_for_line(JOB_TIMEOUT, |l| l.contains(" of 4, first rank "));
    }
    c.wait_for_progress(2);
    let (leaving, staying) = ([agents[1], agents[3]], [agents[0], agents[2]]);
    for &a in &leaving {
        sigterm(&c.agents[a]);
    }
    for &a in &leaving {
        let status = c.agents[a].wait(JOB_TIMEOUT);
        let left = c.agents[a].output();
        assert_eq!(status.code(), Some(143), "a leaver exits 143:\n{left}");
        assert!(
            !left.contains("cannot leave alone") && !left.contains("stopped on request"),
            "both leave; nothing stops the job:\n{left}"
        );
    }
    let outputs: Vec<String> = staying.iter().map(|&a| c.succeeds(a)).collect();
    let all = outputs.join("\n");
    for out in &outputs {
        assert_eq!(
            out.matches("regrouped in place").count(),
            1,
            "one regroup for both leaves:\n{all}"
        );
        assert!(out.contains("world size 4 → 2"), "{all}");
    }
    assert!(
        !all.contains("restarting") && !all.contains("resuming"),
        "{all}"
    );
    for &a in &staying {
        assert_eq!(workers_of(&c.agents[a]).len(), 1, "{all}");
    }
    c.verify_end(&outputs, 2);
    c.verify_exactly_once();
}

#[test]
fn c10d_two_agents_told_to_go_at_once_both_leave_in_one_regroup() {
    two_agents_told_to_go_at_once(Store::C10d, "c10d-two-leave");
}

#[test]
fn etcd_two_agents_told_to_go_at_once_both_leave_in_one_regroup() {
    two_agents_told_to_go_at_once(Store::Etcd, "etcd-two-leave");
}

/// Every agent told to go at once (a whole job deleted): at most one leaves alone, the others
/// cannot go on without it, so the job stops as a whole; every agent exits 143, the checkpoint
/// holds the last step trained, and running the same command again resumes there exactly.
fn every_agent_told_to_go(store: Store, name: &str) {
    let Some(mut c) = Cluster::new(store, name) else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_step(2);
    for &a in &agents {
        sigterm(&c.agents[a]);
    }
    for &a in &agents {
        let status = c.agents[a].wait(JOB_TIMEOUT);
        assert_eq!(
            status.code(),
            Some(143),
            "agent {a} exits 143:\n{}",
            c.agents[a].output()
        );
    }
    let stopped = agents
        .iter()
        .map(|&a| c.agents[a].output())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        stopped.matches("the others go on at world size").count() <= 1,
        "at most one node leaves alone:\n{stopped}"
    );
    let trained = c.last_recorded_step();
    let p = c.progress().expect("the stop left a checkpoint");
    assert_eq!(
        p["global_step"].as_u64(),
        Some(trained),
        "the checkpoint holds the last step trained:\n{stopped}"
    );
    assert!(
        p["epoch"].as_u64() < Some(c.epochs),
        "the job stopped before its end: {p}"
    );
    // The three resume together: at 2:3 a node whose start (its health check) took more than
    // the last call's 0.5 s on this 2-core machine waited for the next round, which a job
    // this short may not reach, and the job ended at world size 2.
    c.nnodes = "3:3";
    let outputs = c.run_again_from_the_checkpoint();
    c.verify_finished(&outputs, 3);
    c.verify_exactly_once();
}

/// The node holding rank 0 lost, then the job stopped (SIGTERM to every node left) while the
/// others wait for a round that cannot form (`--nnodes 3:3`). No survivor knows it is the
/// lowest rank left, so each saves if its step is newer than the checkpoint's
/// (`regroup::saver_while_waiting`): the checkpoint holds the last step trained, and the same
/// command again resumes there and trains every image once. (Before, the saver was rank 0,
/// the one lost: nobody saved, and the steps since the last checkpoint were lost.)
fn rank_0_lost_then_stopped_while_waiting(cluster: Option<Cluster>) {
    let Some(mut c) = cluster else {
        return;
    };
    c.nnodes = "3:3";
    // Only the epochs' ends on schedule: the stop's checkpoint is the one the test reads.
    c.checkpoint_every = 1000;
    c.epochs = 3;
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    let rank_0 = *agents
        .iter()
        .find(|&&a| {
            c.agents[a]
                .wait_for_line(JOB_TIMEOUT, |l| l.contains("round 0: node rank "))
                .contains("node rank 0 ")
        })
        .expect("one node holds rank 0");
    c.wait_for_recorded_step(1);
    c.kill(rank_0);
    let survivors: Vec<usize> = agents.iter().copied().filter(|&a| a != rank_0).collect();
    for &a in &survivors {
        c.agents[a].wait_for_line(JOB_TIMEOUT, |l| l.contains("regroup at the next round"));
    }
    for &a in &survivors {
        sigterm(&c.agents[a]);
    }
    let mut stopped = Vec::new();
    for &a in &survivors {
        let status = c.agents[a].wait(JOB_TIMEOUT);
        let out = c.agents[a].output();
        assert_eq!(status.code(), Some(143), "agent {a} exits 143:\n{out}");
        stopped.push(out);
    }
    let stopped = stopped.join("\n");
    let trained = c.last_recorded_step();
    let held = match c.program {
        Program::Builtin => c.progress().and_then(|p| p["global_step"].as_u64()),
        Program::PyTorch { .. } => c.torch_checkpoint_step(),
    };
    assert_eq!(
        held,
        Some(trained),
        "the checkpoint holds the last step trained:\n{stopped}"
    );
    let outputs = c.run_again_from_the_checkpoint();
    c.verify_end(&outputs, 3);
    c.verify_every_image_once(true);
}

#[test]
fn etcd_rank_0_lost_then_every_node_stopped_while_waiting_saves_the_last_step() {
    rank_0_lost_then_stopped_while_waiting(Cluster::new(Store::Etcd, "etcd-rank0-stop"));
}

#[test]
fn etcd_pytorch_rank_0_lost_then_every_node_stopped_while_waiting_saves_the_last_step() {
    rank_0_lost_then_stopped_while_waiting(Cluster::pytorch(Store::Etcd, "etcd-py-rank0-stop"));
}

fn agent_added(cluster: Option<Cluster>) {
    let Some(mut c) = cluster else {
        return;
    };
    c.slow_below = Some("3:0.2");
    let first = [c.start(1, 1), c.start(2, 1)];
    c.wait_for_progress(2);
    let late = c.start(3, 1);
    let mut outputs: Vec<String> = first.iter().map(|&a| c.succeeds(a)).collect();
    outputs.push(c.succeeds(late));
    assert!(
        outputs[2].contains("joined in place") && !outputs[2].contains("round 0:"),
        "the newcomer must be admitted at a new round:\n{}",
        outputs.join("\n")
    );
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
    let all = outputs.join("\n");
    for &a in &first {
        assert_eq!(workers_of(&c.agents[a]).len(), 1, "{all}");
    }
    assert!(
        outputs[..2]
            .iter()
            .all(|o| o.contains("regrouped in place") && o.contains("world size 2 → 3")),
        "{all}"
    );
    let starts = c.starts();
    assert_eq!(
        starts.iter().filter(|(peer, _)| *peer).count(),
        1,
        "the joiner takes its state from a peer: {starts:?}"
    );
    assert!(
        starts.iter().all(|(_, resumed)| !resumed),
        "no rank reads a checkpoint: {starts:?}"
    );
}

/// A node lost and another joining soon after: the survivors regroup twice in place, the
/// newcomer takes the state from a peer, and every epoch still trains each image once.
fn agent_lost_and_another_added(cluster: Option<Cluster>) {
    let Some(mut c) = cluster else {
        return;
    };
    c.slow_below = Some("3:0.2");
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_progress(2);
    c.kill(agents[2]);
    let newcomer = c.start(3, 1);
    let outputs = vec![
        c.succeeds(agents[0]),
        c.succeeds(agents[1]),
        c.succeeds(newcomer),
    ];
    let all = outputs.join("\n");
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
    for &a in &agents[..2] {
        assert_eq!(workers_of(&c.agents[a]).len(), 1, "{all}");
    }
    let starts = c.starts();
    assert!(
        starts.iter().all(|(_, resumed)| !resumed),
        "no rank reads a checkpoint: {starts:?}"
    );
}

/// A joining node lost while it joins (its agent killed as soon as it has a place, while the
/// survivors wait for it in the new group or stream it the state): the survivors' regroup
/// fails and starts over without it, counted as one failed regroup (within --max-restarts 1,
/// so no fallback to a restart), and the job finishes with every image once per epoch.
fn joiner_lost_while_joining(cluster: Option<Cluster>) {
    let Some(mut c) = cluster else {
        return;
    };
    c.slow_below = Some("3:0.2");
    let agents = [c.start(1, 1), c.start(2, 1)];
    c.wait_for_progress(2);
    let joiner = c.start(3, 1);
    // Its workers start warm before it asks for a place: killed at its assignment, it is lost
    // as the survivors form the new group with it or stream it the state.
    c.agents[joiner].wait_for_line(JOB_TIMEOUT, |l| {
        l.contains(": node rank ") && l.contains(" of 3,")
    });
    c.kill(joiner);
    let outputs: Vec<String> = agents.iter().map(|&a| c.succeeds(a)).collect();
    let all = outputs.join("\n");
    c.verify_end(&outputs, 2);
    c.verify_exactly_once();
    for &a in &agents {
        assert_eq!(workers_of(&c.agents[a]).len(), 1, "{all}");
    }
    assert!(!all.contains("resuming from"), "{all}");
}

/// Soak: nodes killed and new ones started at moments drawn at random (the seed is printed, and
/// `TRAINCTL_SOAK_SEED` replays it) over four epochs; the job ends at world size 3 with every
/// image trained exactly once in every epoch and every rank's weights the same. The agent of
/// host 1 hosts the c10d store and is left alone (losing it is another test's case).
fn kills_and_joins_at_random(store: Store, name: &str) {
    let Some(mut c) = Cluster::new(store, name) else {
        return;
    };
    c.epochs = 4;
    soak(c, name);
}

/// Three kills of a node other than the store's host, each at a step drawn at random and
/// followed by a replacement node (see [`kills_and_joins_at_random`]).
fn soak(mut c: Cluster, name: &str) {
    #[allow(clippy::disallowed_methods)] // a test's own knob, not the worker environment
    let seed = std::env::var("TRAINCTL_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::process::id() as u64);
    eprintln!("{name}: seed {seed} (TRAINCTL_SOAK_SEED={seed} replays it)");
    // The job ends at world size 3: it waits, at world size 2, for the last replacement's warm
    // start.
    c.slow_below = Some("3:0.2");
    let mut rng = seed;
    let mut draw = |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    // Host 1's agent, then the agents of hosts 2 and 3, replaced as they are killed.
    let first = c.start(1, 3);
    let mut running = [c.start(2, 3), c.start(3, 3)];
    let mut step = 0;
    for _ in 0..3 {
        // Steps of batch 16 at world size 3 or less: 30 to 80 steps in all.
        step += 2 + 2 * draw(3);
        c.wait_for_progress(step);
        let victim = draw(2) as usize;
        c.kill(running[victim]);
        running[victim] = c.start(victim + 2, 3);
    }
    let outputs: Vec<String> = [first, running[0], running[1]]
        .iter()
        .map(|&a| c.succeeds(a))
        .collect();
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
    assert_eq!(workers_of(&c.agents[first]).len(), 1, "{}", outputs[0]);
}

fn worker_killed(store: Store, name: &str) {
    let Some(mut c) = Cluster::new(store, name) else {
        return;
    };
    let agents = [c.start(1, 1), c.start(2, 1)];
    c.agents[agents[1]].wait_for_workers(1, JOB_TIMEOUT);
    c.wait_for_step(2);
    let victim = workers_of(&c.agents[agents[1]])[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    // Restart 1 of 1: both agents go on at a round with TORCHELASTIC_RESTART_COUNT=1; the
    // killed worker's agent starts a new one, which takes the state from the other node's
    // worker, which regrouped in place.
    for &a in &agents {
        c.agents[a].wait_for_line(JOB_TIMEOUT, |l| l.contains("restart count 1, store at"));
    }
    c.agents[agents[1]].wait_for_workers(2, JOB_TIMEOUT);
    c.agents[agents[0]].wait_for_line(JOB_TIMEOUT, |l| l.contains("regrouped in place"));
    assert_eq!(
        workers_of(&c.agents[agents[0]]).len(),
        1,
        "the surviving node's worker is not restarted:\n{}",
        c.agents[agents[0]].output()
    );
    // A second failure exceeds --max-restarts 1: the job ends, both agents report the root
    // cause, which is the first failure.
    let second = *workers_of(&c.agents[agents[0]]).last().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    for &a in &agents {
        let status = c.agents[a].wait(JOB_TIMEOUT);
        let out = c.agents[a].output();
        assert_eq!(status.code(), Some(1), "{out}");
        assert!(out.contains("root cause (first failure)"), "{out}");
        assert!(
            out.contains(&format!("pid        : {victim}")) && out.contains("SIGKILL"),
            "the root cause is the first worker killed (pid {victim}):\n{out}"
        );
    }
    let p = c
        .progress()
        .expect("the checkpoint survives the failed job");
    assert!(
        p["epoch"].as_u64() < Some(c.epochs),
        "the job did not finish: {p}"
    );
}

#[test]
fn c10d_agent_told_to_go_leaves_and_the_others_go_on_in_place() {
    agent_told_to_go(Cluster::new(Store::C10d, "c10d-leave"), 3);
}

#[test]
fn c10d_store_host_told_to_go_leaves_and_the_others_go_on_in_place() {
    agent_told_to_go(Cluster::new(Store::C10d, "c10d-leave-host"), 1);
}

#[test]
fn etcd_agent_told_to_go_leaves_and_the_others_go_on_in_place() {
    agent_told_to_go(Cluster::new(Store::Etcd, "etcd-leave"), 2);
}

#[test]
fn c10d_every_agent_told_to_go_checkpoints_once_and_resumes_exactly() {
    every_agent_told_to_go(Store::C10d, "c10d-all-go");
}

#[test]
fn etcd_every_agent_told_to_go_checkpoints_once_and_resumes_exactly() {
    every_agent_told_to_go(Store::Etcd, "etcd-all-go");
}

#[test]
fn c10d_agent_killed_mid_epoch_the_others_finish() {
    agent_lost(Cluster::new(Store::C10d, "c10d-kill"), false, "in-process");
}

#[test]
fn c10d_link_cut_mid_epoch_the_others_finish() {
    agent_lost(Cluster::new(Store::C10d, "c10d-cut"), true, "in-process");
}

#[test]
fn c10d_agent_killed_with_regroup_restart_every_worker_restarts() {
    agent_lost(
        Cluster::new(Store::C10d, "c10d-kill-restart"),
        false,
        "restart",
    );
}

#[test]
fn c10d_agent_killed_and_another_added_every_image_once() {
    agent_lost_and_another_added(Cluster::new(Store::C10d, "c10d-kill-add"));
}

#[test]
fn etcd_agent_killed_and_another_added_every_image_once() {
    agent_lost_and_another_added(Cluster::new(Store::Etcd, "etcd-kill-add"));
}

#[test]
fn c10d_kills_and_joins_at_random_every_image_once() {
    kills_and_joins_at_random(Store::C10d, "c10d-soak");
}

#[test]
fn etcd_kills_and_joins_at_random_every_image_once() {
    kills_and_joins_at_random(Store::Etcd, "etcd-soak");
}

#[test]
fn c10d_joiner_lost_while_joining_the_survivors_regroup_again() {
    joiner_lost_while_joining(Cluster::new(Store::C10d, "c10d-joiner-lost"));
}

#[test]
fn c10d_agent_added_mid_run_joins_at_the_next_round() {
    agent_added(Cluster::new(Store::C10d, "c10d-add"));
}

#[test]
fn c10d_worker_killed_restarts_until_max_restarts() {
    worker_killed(Store::C10d, "c10d-worker");
}

/// The c10d store lives in the agent of host 1 (pod 0 on Kubernetes). Killing that agent takes
/// the store with it; the other agent waits for a store at the same endpoint instead of failing
/// the job, its worker still running, the host's replacement starts a fresh one, and the
/// replacement's worker takes the state from the survivor's (no checkpoint read); the job
/// finishes with every sample trained exactly once.
fn store_host_killed_and_replaced(cluster: Option<Cluster>) {
    let Some(mut c) = cluster else {
        return;
    };
    let host = c.start(1, 1);
    let survivor = c.start(2, 1);
    c.wait_for_progress(2);
    c.kill(host);
    c.agents[survivor].wait_for_line(JOB_TIMEOUT, |l| {
        l.contains("rendezvous store lost") && l.contains("waiting up to")
    });
    let replacement = c.start(1, 1);
    let outputs = vec![c.succeeds(survivor), c.succeeds(replacement)];
    c.verify_end(&outputs, 2);
    c.verify_exactly_once();
    let all = outputs.join("\n");
    assert!(
        outputs[0].contains("regrouped in place") && !all.contains("resuming from"),
        "the survivor's worker goes on, the replacement's takes its state:\n{all}"
    );
    assert_eq!(workers_of(&c.agents[survivor]).len(), 1, "{all}");
}

#[test]
fn c10d_store_host_killed_and_replaced_the_job_goes_on() {
    store_host_killed_and_replaced(Cluster::new(Store::C10d, "c10d-store-lost"));
}

#[test]
fn etcd_agent_killed_mid_epoch_the_others_finish() {
    agent_lost(Cluster::new(Store::Etcd, "etcd-kill"), false, "in-process");
}

#[test]
fn etcd_link_cut_mid_epoch_the_others_finish() {
    agent_lost(Cluster::new(Store::Etcd, "etcd-cut"), true, "in-process");
}

#[test]
fn etcd_agent_added_mid_run_joins_at_the_next_round() {
    agent_added(Cluster::new(Store::Etcd, "etcd-add"));
}

#[test]
fn etcd_worker_killed_restarts_until_max_restarts() {
    worker_killed(Store::Etcd, "etcd-worker");
}

#[test]
fn etcd_restarted_mid_run_training_goes_on() {
    let Some(mut c) = Cluster::new(Store::Etcd, "etcd-restart") else {
        return;
    };
    let agents = [c.start(1, 0), c.start(2, 0)];
    c.wait_for_step(2);
    c.etcd
        .as_mut()
        .expect("etcd")
        .restart(Duration::from_secs(1));
    let outputs: Vec<String> = agents.iter().map(|&a| c.succeeds(a)).collect();
    c.verify_finished(&outputs, 2);
}

/// A rank that hangs (SIGSTOP) inside the collective is a timeout on its peers, which is a
/// failure: the group restarts at the next round instead of hanging, and the job finishes.
#[test]
fn a_hung_rank_is_a_timeout_and_a_restart_not_a_hang() {
    let job = Job::new(TRAIN_IMAGES as usize, 64);
    let endpoint = format!("127.0.0.1:{}", testkit::free_port());
    let agent = || {
        let mut cmd = trainctl();
        cmd.current_dir(job.dir.path())
            .args(["run", "--nnodes", "2", "--rdzv-backend", "c10d"])
            .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "hang"])
            .args(["--max-restarts", "1", "--collective-timeout", "3"])
            .args(["--grace-period", "1", "--job-token", "t"])
            .args(["train", "--data", "data", "--out", "runs", "--no-eval"])
            .args(["--epochs", "4", "--batch-size", "16"])
            .args([
                "--threads",
                "1",
                "--print-freq",
                "1",
                "--checkpoint-every",
                "2",
            ]);
        Running::start(&mut cmd)
    };
    let (mut a, mut b) = (agent(), agent());
    b.wait_for_workers(1, JOB_TIMEOUT);
    let hung = workers_of(&b)[0];
    let ckpt = job.path("runs").join("hang").join("checkpoint.ckpt");
    eventually(JOB_TIMEOUT, "a first checkpoint", || ckpt.is_file());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(hung), nix::sys::signal::SIGSTOP).unwrap();
    for r in [&mut a, &mut b] {
        let status = r.wait(JOB_TIMEOUT);
        assert!(status.success(), "{}", r.output());
        assert!(
            r.output().contains("restart count 1, store at"),
            "{}",
            r.output()
        );
    }
    let all = format!("{}\n{}", a.output(), b.output());
    assert!(
        all.contains("did not answer within"),
        "the hang must surface as a timeout:\n{all}"
    );
    assert!(!alive(hung), "the hung worker was killed");
    let out = run_ok(trainctl().arg("checkpoint").arg(&ckpt).arg("--json"));
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["samples_seen"].as_u64(), Some(4 * TRAIN_IMAGES), "{p}");
}

// The PyTorch example (examples/pytorch/elastic_cifar.py with `trainctl.torch`) in the same
// scenarios as the built-in trainer: its survivors' workers are the ones they started, they go
// on from the step they hold, every epoch's digest is every image once (the Python digest
// checked against the Rust one), every rank ends with the same weights, no rank reads a
// checkpoint, and a joiner's start record says it took the state from a peer.

#[test]
fn c10d_pytorch_agent_killed_the_others_go_on_in_place() {
    agent_lost(
        Cluster::pytorch(Store::C10d, "c10d-py-kill"),
        false,
        "in-process",
    );
}

#[test]
fn etcd_pytorch_agent_killed_the_others_go_on_in_place() {
    agent_lost(
        Cluster::pytorch(Store::Etcd, "etcd-py-kill"),
        false,
        "in-process",
    );
}

#[test]
fn c10d_pytorch_agent_added_joins_in_place_with_a_peers_state() {
    agent_added(Cluster::pytorch(Store::C10d, "c10d-py-join"));
}

#[test]
fn c10d_pytorch_agent_told_to_go_leaves_and_the_others_go_on() {
    agent_told_to_go(Cluster::pytorch(Store::C10d, "c10d-py-leave"), 3);
}

/// The same, told to go soon after its worker started: the agents look at their workers once
/// every three seconds (`--monitor-interval 3`), so the worker's word that it regroups in place
/// is most likely still unread when the signal is, and the node must leave alone all the same,
/// not stop the whole job (which an agent deciding on the signal before reading that word did:
/// 3 of 3 runs here, and once in a full suite on a busy machine at the default 0.1 s). More
/// epochs than the others': the signal is acted on up to three seconds late, and the job must
/// still be under way then.
#[test]
fn c10d_pytorch_agent_told_to_go_as_it_starts_leaves_and_the_others_go_on() {
    let cluster = Cluster::pytorch(Store::C10d, "c10d-py-leave-early").map(|mut c| {
        c.run_args = vec!["--monitor-interval", "3"];
        c.epochs = 150;
        c
    });
    agent_told_to_go(cluster, 3);
}

/// Told to go while its worker is still starting (it has not said it regroups in place: a
/// slow import, 20 s here), as a pod removed by `job scale` right after launch: the node leaves
/// all the same (the rendezvous goes on without it at once, no heartbeat to lapse), its worker
/// is stopped, and the others start theirs again at world size 2 and finish. (It used to stop
/// as a plain program's node did, leaving the others to find it gone.)
#[test]
fn c10d_pytorch_agent_told_to_go_while_its_workers_start_leaves() {
    let Some(mut c) = Cluster::pytorch(Store::C10d, "c10d-py-leave-starting") else {
        return;
    };
    if let Program::PyTorch { script, .. } = &mut c.program {
        *script = Script::Patterns(vec!["--slow-start", "20"]);
    }
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    for &a in &agents {
        c.agents[a].wait_for_line(JOB_TIMEOUT, |l| l.contains(" of 3, first rank "));
    }
    c.agents[agents[2]].wait_for_workers(1, JOB_TIMEOUT);
    sigterm(&c.agents[agents[2]]);
    let status = c.agents[agents[2]].wait(Duration::from_secs(60));
    let left = c.agents[agents[2]].output();
    assert_eq!(status.code(), Some(143), "{left}");
    assert!(
        left.contains("leaves (SIGTERM): the others go on at world size 2"),
        "{left}"
    );
    let outputs: Vec<String> = agents[..2].iter().map(|&a| c.succeeds(a)).collect();
    let all = outputs.join("\n");
    assert!(
        outputs.iter().all(|o| o.contains("leaves (SIGTERM)")),
        "the others heard it leave:\n{all}"
    );
    assert!(!all.contains("no heartbeat"), "{all}");
    c.verify_end(&outputs, 2);
    c.verify_exactly_once();
}

#[test]
fn c10d_pytorch_agent_lost_and_another_added_every_image_once() {
    agent_lost_and_another_added(Cluster::pytorch(Store::C10d, "c10d-py-lost-added"));
}

#[test]
fn c10d_pytorch_joiner_lost_while_joining_the_survivors_go_on() {
    joiner_lost_while_joining(Cluster::pytorch(Store::C10d, "c10d-py-joiner-lost"));
}

#[test]
fn c10d_pytorch_store_host_killed_and_replaced_the_job_goes_on() {
    store_host_killed_and_replaced(Cluster::pytorch(Store::C10d, "c10d-py-store-lost"));
}

/// A PyTorch job's node cut off (its link down: no connection is reset, a collective would
/// wait for its timeout): the agents find the node gone and abort the survivors' group, whose
/// blocked collective then fails at once. The collective timeout is set past the test's
/// deadline, so only the abort can make the survivors go on in time.
#[test]
fn c10d_pytorch_link_cut_the_abort_frees_the_survivors() {
    let cluster = Cluster::pytorch(Store::C10d, "c10d-py-cut").map(|mut c| {
        c.collective_timeout = 900;
        c
    });
    agent_lost(cluster, true, "in-process");
}
