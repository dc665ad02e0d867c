//! Where a job stands: its phase and conditions, its pods, why they wait or failed, and the
//! text of `job status`.

use std::fmt::Write as _;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::DynamicObject;

use crate::config::Operator;

/// Where a job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Created; no pod running yet.
    Pending,
    Running,
    Succeeded,
    Failed,
}

impl Phase {
    pub fn is_finished(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Pending => "pending",
            Phase::Running => "running",
            Phase::Succeeded => "succeeded",
            Phase::Failed => "failed",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
}

/// The status of a Kubeflow operator's job (PyTorchJob, TrainJob, MPIJob): the part read.
#[derive(Debug, Default, serde::Deserialize)]
struct OperatorStatus {
    conditions: Option<Vec<OperatorCondition>>,
}

/// A condition as the operators write it; a field left out (or null) reads as empty.
#[derive(Debug, serde::Deserialize)]
struct OperatorCondition {
    #[serde(rename = "type")]
    type_: Option<String>,
    status: Option<String>,
    reason: Option<String>,
    message: Option<String>,
}

impl From<OperatorCondition> for Condition {
    fn from(c: OperatorCondition) -> Condition {
        Condition {
            type_: c.type_.unwrap_or_default(),
            status: c.status.unwrap_or_default(),
            reason: c.reason.unwrap_or_default(),
            message: c.message.unwrap_or_default(),
        }
    }
}

/// A job and its pods.
#[derive(Debug, Clone)]
pub struct JobStatus {
    pub name: String,
    /// `Job`, `PyTorchJob`, `TrainJob` or `MPIJob`.
    pub kind: String,
    pub phase: Phase,
    pub conditions: Vec<Condition>,
    /// Pods that failed and were replaced (a Job's `status.failed`).
    pub failed_pods: i32,
    pub pods: Vec<PodStatus>,
    /// The pods beside the job: its etcd (`--rdzv-backend etcd`), its TensorBoard.
    pub companions: Vec<PodStatus>,
    /// The operator that reconciles the job, when it is an operator's.
    pub operator: Option<Operator>,
    /// The latest rendezvous round its pods' logs show (`job status` reads them).
    pub training: Option<Round>,
    /// An Indexed Job's completions: its node indexes are 0..size.
    pub size: Option<u32>,
}

/// A rendezvous round, as a training pod's `trainctl run` said it joined one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    pub round: u64,
    pub nodes: u32,
    pub world_size: u32,
}

/// Whether `log` (a training pod's output) says its node waits as a spare: its agent's last
/// word is `trainctl run: a spare: ...`, after any round it joined.
pub(crate) fn waits_as_a_spare(log: &str) -> bool {
    log.lines()
        .rev()
        .find(|l| l.contains("trainctl run: a spare: ") || l.contains("trainctl run: round "))
        .is_some_and(|l| l.contains("trainctl run: a spare: "))
}

/// What `job status` says of a spare.
pub(crate) const SPARE: &str =
    "spare: its workers started warm; it takes the place of a node that goes, at once";

/// The last round `log` (a training pod's output) says its node joined: `trainctl run: round
/// R: node rank N of M, first rank F, world size W, ...`.
pub fn last_round(log: &str) -> Option<Round> {
    log.lines().rev().find_map(|line| {
        let rest = &line[line.find("trainctl run: round ")? + "trainctl run: round ".len()..];
        let (round, rest) = rest.split_once(": node rank ")?;
        let (_, rest) = rest.split_once(" of ")?;
        let (nodes, rest) = rest.split_once(',')?;
        let (_, rest) = rest.split_once("world size ")?;
        let world_size = rest.split(',').next()?;
        Some(Round {
            round: round.trim().parse().ok()?,
            nodes: nodes.trim().parse().ok()?,
            world_size: world_size.trim().parse().ok()?,
        })
    })
}

impl JobStatus {
    pub(crate) fn from_job(job: &Job) -> JobStatus {
        let status = job.status.clone().unwrap_or_default();
        let conditions: Vec<Condition> = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .map(|c| Condition {
                type_: c.type_,
                status: c.status,
                reason: c.reason.unwrap_or_default(),
                message: c.message.unwrap_or_default(),
            })
            .collect();
        let phase = phase_from_conditions(&conditions, &["Complete"], &["Failed"]).unwrap_or(
            if status.active.unwrap_or(0) > 0 {
                Phase::Running
            } else {
                Phase::Pending
            },
        );
        JobStatus {
            name: job.metadata.name.clone().unwrap_or_default(),
            kind: "Job".into(),
            phase,
            conditions,
            failed_pods: status.failed.unwrap_or(0),
            pods: Vec::new(),
            companions: Vec::new(),
            operator: None,
            training: None,
            size: job
                .spec
                .as_ref()
                .and_then(|s| s.completions)
                .and_then(|n| u32::try_from(n).ok()),
        }
    }

    /// A job of an operator's (`kind`), whose conditions say how it is: `succeeded` (the
    /// condition type that says it succeeded), `Failed`, `Running`. `operator` is who
    /// reconciles it, for a job that nothing has picked up.
    pub(crate) fn from_conditions(
        job: &DynamicObject,
        kind: &str,
        succeeded: &str,
        operator: Option<Operator>,
    ) -> JobStatus {
        let conditions: Vec<Condition> =
            serde_json::from_value::<OperatorStatus>(job.data["status"].clone())
                .map(|s| {
                    let conditions = s.conditions.unwrap_or_default();
                    conditions.into_iter().map(Condition::from).collect()
                })
                .unwrap_or_default();
        let phase = phase_from_conditions(&conditions, &[succeeded], &["Failed"]).unwrap_or(
            if conditions
                .iter()
                .any(|c| c.type_ == "Running" && c.status == "True")
            {
                Phase::Running
            } else {
                Phase::Pending
            },
        );
        JobStatus {
            name: job.metadata.name.clone().unwrap_or_default(),
            kind: kind.into(),
            phase,
            conditions,
            failed_pods: 0,
            pods: Vec::new(),
            companions: Vec::new(),
            operator,
            training: None,
            size: None,
        }
    }

    /// A job Kubernetes counts as active is only running once one of its pods is.
    pub(crate) fn settle(&mut self) {
        if self.phase == Phase::Running && !self.pods.iter().any(|p| p.phase == "Running") {
            self.phase = Phase::Pending;
        }
        if self.phase == Phase::Pending && self.pods.iter().any(|p| p.phase == "Running") {
            self.phase = Phase::Running;
        }
    }

    /// An operator's job with no condition and no pod: nothing reconciles it (operators set a
    /// Created condition at once), which says its controller is not running.
    pub(crate) fn unreconciled(&self) -> Option<String> {
        let operator = self.operator?;
        (self.conditions.is_empty() && self.pods.is_empty()).then(|| {
            format!(
                "no conditions and no pods: nothing has picked this {} up; is {} running? (`{}`)",
                self.kind, operator.name, operator.check
            )
        })
    }

    /// The failure condition's reason and message, when the job failed.
    pub fn failure(&self) -> Option<&Condition> {
        self.conditions
            .iter()
            .find(|c| c.type_ == "Failed" && c.status == "True")
    }

    /// `training: round 7, 3 nodes, world size 3; pods: 3 running, 1 pending, 1 leaving`:
    /// the size the job trains at and where its pods stand, for a job still running.
    fn size_summary(&self) -> Option<String> {
        if self.phase.is_finished() || self.pods.is_empty() {
            return None;
        }
        let count = |f: &dyn Fn(&PodStatus) -> bool| self.pods.iter().filter(|p| f(p)).count();
        let leaving = count(&|p| p.leaving);
        let spares = count(&|p| p.spare && !p.leaving);
        let running = count(&|p| !p.leaving && !p.spare && p.phase == "Running");
        let pending = count(&|p| !p.leaving && p.phase == "Pending");
        let mut parts = vec![format!("{running} running")];
        if spares > 0 {
            parts.push(format!("{spares} spare"));
        }
        if pending > 0 {
            parts.push(format!("{pending} pending"));
        }
        if leaving > 0 {
            parts.push(format!("{leaving} leaving"));
        }
        let pods = parts.join(", ");
        Some(match self.training {
            Some(r) => format!(
                "training: round {}, {} nodes, world size {}; pods: {pods}",
                r.round, r.nodes, r.world_size
            ),
            None => format!("pods: {pods}"),
        })
    }

    /// The node indexes of a running Indexed Job with no pod running or on its way (one that
    /// left or failed, whose replacement the Job controller holds back for its backoff).
    fn indexes_without_a_pod(&self) -> Vec<u32> {
        let Some(size) = self.size.filter(|_| !self.phase.is_finished()) else {
            return Vec::new();
        };
        (0..size)
            .filter(|&i| {
                !self.pods.iter().any(|p| {
                    p.index == Some(i)
                        && !p.leaving
                        && matches!(p.phase.as_str(), "Running" | "Pending" | "Succeeded")
                })
            })
            .collect()
    }

    /// `job status` as text: the job line, conditions, then one row per pod.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{} {}: {}", self.kind, self.name, self.phase);
        if self.failed_pods > 0 {
            let _ = writeln!(s, "  failed pods so far: {}", self.failed_pods);
        }
        for c in &self.conditions {
            if c.status != "True" {
                continue;
            }
            let _ = write!(s, "  condition {}", c.type_);
            if !c.reason.is_empty() {
                let _ = write!(s, " ({})", c.reason);
            }
            if !c.message.is_empty() {
                let _ = write!(s, ": {}", c.message);
            }
            s.push('\n');
        }
        if let Some(unreconciled) = self.unreconciled() {
            let _ = writeln!(s, "  {unreconciled}");
        }
        if let Some(summary) = self.size_summary() {
            let _ = writeln!(s, "  {summary}");
        }
        if self.pods.is_empty() {
            s.push_str("  no pods yet\n");
            if self.companions.is_empty() {
                return s;
            }
        }
        // Columns as wide as their longest entry: long pod and node names keep the table.
        let all = || self.pods.iter().chain(&self.companions);
        let pod_w = all().map(|p| p.name.len()).max().unwrap_or(0).max(3);
        let on = |p: &PodStatus| p.node.clone().unwrap_or_else(|| "(unscheduled)".into());
        let on_w = all().map(|p| on(p).len()).max().unwrap_or(0).max(2);
        let _ = writeln!(
            s,
            "  {:<pod_w$} {:>5} {:<10} {:>5} {:>8}  {:<on_w$}  WHY",
            "POD", "INDEX", "PHASE", "READY", "RESTARTS", "ON"
        );
        for p in all() {
            let _ = writeln!(
                s,
                "  {:<pod_w$} {:>5} {:<10} {:>5} {:>8}  {:<on_w$}  {}",
                p.name,
                p.index.map_or("-".into(), |i| i.to_string()),
                if p.leaving {
                    "Leaving"
                } else if p.spare {
                    "Spare"
                } else {
                    p.phase.as_str()
                },
                if p.ready { "yes" } else { "no" },
                p.restarts,
                on(p),
                p.why
            );
        }
        for index in self.indexes_without_a_pod() {
            let _ = writeln!(
                s,
                "  index {index} has no pod now: the Job controller creates its replacement \
                 after a backoff (10 s, doubling with each failure of that index; a pod that \
                 left on SIGTERM counts too)"
            );
        }
        if self.pods.iter().any(|p| p.index.is_some()) {
            s.push_str(
                "  (INDEX is the pod's place in the job; the rendezvous gives each round's node \
                 ranks in join order, which `job logs` shows as \"node rank N of M\")\n",
            );
        }
        // Every node of a failed job reports the same root cause: it is shown once.
        let mut shown = std::collections::BTreeSet::new();
        for p in self.pods.iter().chain(&self.companions) {
            let Some(words) = &p.last_words else {
                continue;
            };
            if let Some(report) = root_cause(words) {
                if shown.insert(report.clone()) {
                    let _ = writeln!(
                        s,
                        "  {} failed; the root cause, as trainctl run reported it:",
                        p.name
                    );
                    for line in report {
                        let _ = writeln!(s, "    {line}");
                    }
                }
                continue;
            }
            let _ = writeln!(s, "  {} failed; its last lines:", p.name);
            for line in last_lines(words, LAST_WORDS_LINES) {
                let _ = writeln!(s, "    {line}");
            }
        }
        s
    }
}

/// How many lines of a root-cause report `job status` shows (the report's own are fewer).
const ROOT_CAUSE_LINES: usize = 24;

/// The root-cause report `trainctl run --termination-log` wrote into a termination message
/// (from its first "trainctl run:" line), if the message is one.
fn root_cause(words: &str) -> Option<Vec<String>> {
    let start = words.find("trainctl run: ")?;
    let report = &words[start..];
    report.contains("root cause (first failure)").then(|| {
        report
            .lines()
            .map(|l| strip_ansi(l).trim_end().to_string())
            .filter(|l| !l.is_empty())
            .take(ROOT_CAUSE_LINES)
            .collect()
    })
}

/// How many of a failed container's last lines `job status` shows.
const LAST_WORDS_LINES: usize = 10;

/// The last `n` non-empty lines of `text`, without terminal colour codes.
fn last_lines(text: &str, n: usize) -> Vec<String> {
    let lines: Vec<String> = text
        .lines()
        .map(|l| strip_ansi(l).trim_end().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// `line` without ANSI escape sequences (CSI: ESC [ ... final byte).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

fn phase_from_conditions(cs: &[Condition], success: &[&str], failure: &[&str]) -> Option<Phase> {
    let is_true = |names: &[&str]| {
        cs.iter()
            .any(|c| names.contains(&c.type_.as_str()) && c.status == "True")
    };
    if is_true(failure) {
        Some(Phase::Failed)
    } else if is_true(success) {
        Some(Phase::Succeeded)
    } else {
        None
    }
}

/// What is wrong with `node`, if it is not Ready: "is NotReady (Kubelet stopped posting node
/// status.)".
pub(crate) fn node_problem(node: &Node) -> Option<String> {
    let ready = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    if ready.status == "True" {
        return None;
    }
    let state = if ready.status == "Unknown" {
        "is unreachable"
    } else {
        "is NotReady"
    };
    Some(match ready.message.as_deref() {
        Some(m) if !m.is_empty() => format!("{state} ({m})"),
        _ => state.to_string(),
    })
}

/// What `job status` says of a container that exited 143 (`contract::exit::PREEMPTED`): its
/// `trainctl run` was asked to stop (SIGTERM: a deleted or evicted pod, a deleted job) and left
/// the job or checkpointed it. Not a failure: the Job's podFailurePolicy replaces the pod
/// without counting it, so neither its exit nor its last lines are shown as one.
const LEFT: &str = "left the job (exit 143 after a SIGTERM: not a failure, never counted; the \
                    Job replaces the pod unless `job scale` removed its index)";
/// A node that left the job on its own (evicted as a straggler), after what it said.
const LEFT_SHORT: &str = "exit 143: not a failure, never counted; the Job replaces the pod \
                          unless `job scale` removed its index";

/// One pod of a job.
#[derive(Debug, Clone)]
pub struct PodStatus {
    pub name: String,
    pub uid: String,
    /// What it is to its job (its `trainctl.dev/component` label): `worker`, `etcd`,
    /// `tensorboard`; empty for a pod trainctl did not label.
    pub component: String,
    /// The container whose logs are the pod's: its first (`pytorch` in a training pod, `data`,
    /// `test` or `doctor` in a helper's).
    pub container: String,
    /// The node index: the Indexed Job's completion index (a TrainJob's too) or the replica
    /// index of a Kubeflow job's worker; none for an MPIJob's launcher.
    /// (The rendezvous assigns node ranks in join order; the logs say which each got.)
    pub index: Option<u32>,
    pub phase: String,
    pub ready: bool,
    pub restarts: i32,
    pub node: Option<String>,
    pub ip: Option<String>,
    /// Why it is not running well: unschedulable and the scheduler's message, a waiting reason
    /// (ImagePullBackOff...), the last termination (OOMKilled, exit code).
    pub why: String,
    /// A failed container's termination message: what it wrote there, or its last log lines
    /// (`FallbackToLogsOnError`).
    pub last_words: Option<String>,
    /// What is wrong with its node ("node n2 is NotReady (...)", "node n2 is gone"): its
    /// kubelet cannot serve its logs, and the API's word on the pod is stale.
    pub node_problem: Option<String>,
    /// Deleted, and stopping (scaled away, evicted, deleted by hand): its node leaves the job.
    pub leaving: bool,
    /// Its agent waits as a spare (its last word), workers warm, while the job trains at its
    /// `--nnodes` MAX without it.
    pub spare: bool,
}

/// The pod's first container: the one trainctl runs in (init containers aside).
pub(crate) fn main_container(p: &Pod) -> &str {
    p.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map_or(crate::manifests::CONTAINER, |c| c.name.as_str())
}

impl PodStatus {
    pub(crate) fn from_pod(p: &Pod) -> PodStatus {
        let labels = p.metadata.labels.clone().unwrap_or_default();
        // An MPIJob's launcher has no node index: it sorts (and its logs come) first.
        let launcher = labels
            .get("training.kubeflow.org/job-role")
            .map(String::as_str)
            == Some("launcher");
        let index = [
            "batch.kubernetes.io/job-completion-index",
            "training.kubeflow.org/replica-index",
        ]
        .iter()
        .filter(|_| !launcher)
        .find_map(|k| labels.get(*k).and_then(|v| v.parse().ok()));
        let status = p.status.clone().unwrap_or_default();
        let containers = status.container_statuses.clone().unwrap_or_default();
        let restarts = containers.iter().map(|c| c.restart_count).sum();
        let ready = !containers.is_empty() && containers.iter().all(|c| c.ready);
        let mut why = Vec::new();
        let mut last_words = None;
        for c in status.conditions.iter().flatten() {
            if c.type_ == "PodScheduled" && c.status == "False" {
                why.push(format!(
                    "{}: {}",
                    c.reason.as_deref().unwrap_or("not scheduled"),
                    c.message.as_deref().unwrap_or("")
                ));
            }
        }
        for c in &containers {
            let state = c.state.clone().unwrap_or_default();
            if let Some(w) = state.waiting
                && let Some(reason) = w.reason.filter(|r| r != "ContainerCreating")
            {
                why.push(match w.message {
                    Some(m) => format!("{reason}: {m}"),
                    None => reason,
                });
            }
            if let Some(t) = state.terminated.filter(|t| t.exit_code != 0) {
                if t.exit_code == contract::exit::PREEMPTED {
                    // A node evicted as a straggler says why in its termination message.
                    why.push(match t.message.as_deref().map(str::trim) {
                        Some(m) if m.contains(contract::exit::EVICTED) => {
                            format!("{m} ({LEFT_SHORT})")
                        }
                        _ => LEFT.into(),
                    });
                } else {
                    why.push(format!(
                        "exited {} ({})",
                        t.exit_code,
                        t.reason.unwrap_or_else(|| "Error".into())
                    ));
                    last_words = last_words.or(t.message);
                }
            }
            if let Some(t) = c.last_state.as_ref().and_then(|s| s.terminated.as_ref()) {
                if t.exit_code == contract::exit::PREEMPTED {
                    why.push(format!("last run {LEFT}"));
                } else {
                    why.push(format!(
                        "last run exited {} ({})",
                        t.exit_code,
                        t.reason.clone().unwrap_or_else(|| "Error".into())
                    ));
                    last_words = last_words.or_else(|| t.message.clone());
                }
            }
        }
        let leaving = p.metadata.deletion_timestamp.is_some()
            && matches!(status.phase.as_deref(), Some("Running" | "Pending"));
        if leaving {
            why.insert(
                0,
                "deleted: its node leaves the job (a `job scale`, an eviction or a delete)".into(),
            );
        }
        PodStatus {
            name: p.metadata.name.clone().unwrap_or_default(),
            uid: p.metadata.uid.clone().unwrap_or_default(),
            component: labels
                .get(crate::manifests::COMPONENT_LABEL)
                .cloned()
                .unwrap_or_default(),
            container: main_container(p).to_string(),
            index,
            phase: status.phase.clone().unwrap_or_else(|| "Unknown".into()),
            ready,
            restarts,
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            ip: status.pod_ip.clone(),
            why: why.join("; "),
            last_words: last_words.filter(|m: &String| !m.trim().is_empty()),
            node_problem: None,
            leaving,
            spare: false,
        }
    }

    pub(crate) fn has_started(&self) -> bool {
        matches!(self.phase.as_str(), "Running" | "Succeeded" | "Failed")
    }

    pub(crate) fn prefix(&self) -> String {
        match self.index {
            Some(i) => format!("[{} pod {i}] ", self.name),
            None => format!("[{}] ", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Round, last_round};

    #[test]
    fn a_pod_whose_agent_last_said_it_is_a_spare_is_one() {
        let spare = "trainctl run: its workers are ready after 9.1 s (their start); asking for a place in the job
trainctl run: a spare: the job trains at its --nnodes maximum (3 nodes) without this node, which waits";
        assert!(super::waits_as_a_spare(spare));
        let took_a_place = format!(
            "{spare}\ntrainctl run: round 4: node rank 2 of 3, first rank 2, world size 3, restart count 0, store at a:1"
        );
        assert!(!super::waits_as_a_spare(&took_a_place));
        assert!(!super::waits_as_a_spare("[0]: loss: 2.1"));
    }

    #[test]
    fn the_last_round_a_pod_joined_is_read_from_its_output() {
        let log = "\
2026-11-28T08:00:00Z trainctl run: round 1: node rank 0 of 3, first rank 0, world size 3, restart count 0, store at a:1
[rank 0] loss: 2.1
trainctl run: round 2: node rank 1 of 2, first rank 1, world size 2, restart count 0, store at a:1
trainctl run: regrouped in place: world size 3 → 2, from step 9";
        assert_eq!(
            last_round(log),
            Some(Round {
                round: 2,
                nodes: 2,
                world_size: 2
            })
        );
        assert_eq!(last_round("[rank 0] loss: 2.1\n"), None);
        assert_eq!(last_round("trainctl run: round x: node rank"), None);
    }
}
