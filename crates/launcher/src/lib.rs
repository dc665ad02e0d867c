//! The launcher: torchrun's job for one node. Spawns the workers with torchrun's environment,
//! multiplexes their output line by line, watches them, and when one fails stops the rest and
//! reports the first failure. Knows nothing of burn; it launches any program.
//!
//! Invariant: every worker runs in its own process group and dies with the launcher
//! (`PR_SET_PDEATHSIG`), so no worker outlives `trainctl run`, whatever happens to it.

mod agent;
pub mod error_file;
pub mod health;
pub mod output;
mod report;
pub mod stacks;
mod supervise;
mod telemetry;
pub mod timer;

pub use agent::run_elastic;
pub use rendezvous;
pub use report::{ExitKind, Failure, Outcome, Stuck};
pub use supervise::{agent_without_huge_pages, launch, record_stop_signals, stop_signal};
pub use telemetry::Telemetry;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// One node's launch, resolved: every value is final (the CLI did the parsing and defaults).
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub nproc_per_node: u32,
    pub nnodes: u32,
    pub node_rank: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    pub world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub run_id: String,
    pub token: String,
    /// Times the whole group of this node is restarted after a failure.
    pub max_restarts: u32,
    pub log_dir: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    pub monitor_interval: Duration,
    /// Program and arguments of every worker.
    pub program: Vec<OsString>,
    /// Extra environment for every worker (after torchrun's variables).
    pub extra_env: Vec<(String, String)>,
    /// Where the workers start (default: the launcher's working directory).
    pub working_dir: Option<PathBuf>,
    /// Where the workers' metrics records go, if anywhere (`TRAINCTL_TELEMETRY_FD`).
    pub telemetry: Option<Telemetry>,
    /// A node whose workers show no progress for this long, neither a line of output nor CPU
    /// time (`supervise::cpu`), is hung: their stacks are taken and they are stopped (a
    /// failure, restarted as `max_restarts` says).
    pub hang_timeout: Option<Duration>,
    /// Serve torch.distributed.elastic's file-based timers at this named pipe
    /// (`TORCHELASTIC_ENABLE_FILE_TIMER=1`; the workers get `TORCHELASTIC_TIMER_FILE`).
    pub file_timer: Option<PathBuf>,
    /// Elastic jobs: workers that offer to (the built-in trainer) go on in the next round's
    /// group without a restart when the group changes (`--regroup in-process`); otherwise
    /// every change restarts them (`--regroup restart`, torchrun's way).
    pub regroup: bool,
    /// Elastic jobs: a node that joins a job under way whose workers regroup in place starts
    /// its workers warm, before it asks for a place (`--warm-start auto`, the default; `off`:
    /// they start once the node has one, as before).
    pub warm_start: bool,
    /// How long a worker asked to regroup (pause, or join the next round's group) may take to
    /// answer before it counts as hung: it must finish its step, or wait for the joiners, up to
    /// its collective timeout.
    pub regroup_timeout: Duration,
    /// Elastic jobs whose workers regroup in place: a node the ranks find a straggler leaves
    /// the job (`--stragglers evict`) when the others can go on without it; otherwise it is
    /// only said.
    pub evict_stragglers: bool,
    /// Elastic jobs: what a node whose health check is far below the others' does before it
    /// joins (`--health-check`).
    pub health_check: HealthCheck,
}

/// What a node far below the others in its health check does (`trainctl run --health-check`).
pub use contract::choices::HealthCheck;

/// A worker the launcher started.
#[derive(Debug, Clone, Copy)]
pub struct Started {
    pub rank: u32,
    pub local_rank: u32,
    pub pid: u32,
    /// Started warm: before its node has a place in the job (its rank is not known yet).
    pub warm: bool,
}

/// What the launcher tells its caller while it runs.
#[derive(Debug, Clone)]
pub enum LaunchEvent {
    Started(Started),
    /// The group failed and is being started again (`restart_count` of `max_restarts`).
    Restarting {
        failure: Failure,
        restart_count: u32,
    },
    /// The agent joins the next rendezvous round.
    Joining {
        node: String,
    },
    /// The node's health check, before it joins: its figures against the others' (`None`
    /// when no other node had measured yet); `far_below` when it is.
    HealthChecked {
        health: rendezvous::Health,
        against: Option<String>,
        far_below: bool,
    },
    /// This node's ranks found it a straggler (`slow`), or no longer one.
    Straggler {
        slow: bool,
        report: String,
    },
    /// This node is a straggler, but it stays: the others cannot go on without it.
    EvictRefused {
        report: String,
        why: String,
    },
    /// Joining has waited [`rendezvous::still_joining_every`] more without a round.
    StillJoining(rendezvous::StillJoining),
    /// A round completed with this node in it.
    Joined(rendezvous::Assignment),
    /// The round was reopened by another node (a node lost, one arriving, a failure there).
    Reopened {
        reason: String,
    },
    /// The job finished before this agent joined.
    JobAlreadyOver,
    /// The job ended in a round without this node (it was cut off, or stopped, meanwhile):
    /// its workers leave without saving, their state behind the job's.
    LeftBehind {
        succeeded: bool,
        /// Its workers never trained: they started warm, and the job ended before the node
        /// had a place (a spare, or a joiner too late).
        warm: bool,
    },
    /// The job is over and this node hosts the store: it keeps the store up to `up_to` more
    /// for the nodes named, lost during the job without leaving, so that one only cut off
    /// learns how the job ended.
    KeepingStore {
        nodes: Vec<String>,
        up_to: std::time::Duration,
    },
    /// This node's workers finished; it waits (the exit barrier) for the nodes named, whose
    /// workers have not, `waited` so far.
    AwaitingOthers {
        nodes: Vec<String>,
        waited: std::time::Duration,
    },
    /// The exit barrier gave up on the nodes named: this node exits anyway.
    OthersUnfinished {
        nodes: Vec<String>,
        waited: std::time::Duration,
    },
    /// The rendezvous store cannot be reached; the workers go on.
    StoreUnreachable(String),
    /// A worker failed and the store cannot record it: the agent joins again, waiting up to
    /// `wait` for a store at the endpoint (a replacement of the node that hosted it).
    StoreLost {
        error: String,
        failure: Failure,
        wait: std::time::Duration,
    },
    StoreBack,
    /// This node's workers left their group and the store cannot be reached to say so (it
    /// went with the node that hosted it): the agent joins again, waiting up to `wait` for a
    /// store at the endpoint; the workers keep running meanwhile.
    StoreLostRegrouping {
        error: String,
        wait: std::time::Duration,
    },
    /// This node's workers left their group (`reason`: a peer lost, a node joining) and wait,
    /// still running, for the next round.
    Regrouping {
        reason: String,
    },
    /// This node's workers train in the new round's group, none restarted.
    Regrouped(NodeRegrouped),
    /// `failed` regroups in a row failed (more than `--max-restarts`): the workers are stopped
    /// and started again, as with `--regroup restart`.
    RegroupFallback {
        failed: u32,
    },
    /// This node was asked to go and leaves (`reason`: "node X leaves (SIGTERM)"); `nodes`
    /// others go on at `world_size`, in place.
    Leaving {
        reason: String,
        nodes: u32,
        world_size: u32,
    },
    /// This node was asked to go but the others cannot go on without it now (`why`): the whole
    /// job stops and checkpoints.
    LeaveRefused {
        node: String,
        signal: i32,
        why: String,
    },
    /// This node was asked to go while it joined the next round (`reason`), its workers kept
    /// from the last: `nodes` others go on, holding the same state, and its workers leave
    /// without saving.
    Withdrawing {
        reason: String,
        nodes: u32,
    },
    /// This node joins a job under way: its workers start warm, before it asks for a place.
    Warming,
    /// A node waiting for a place with no workers yet heard that the job now regroups in
    /// place: it starts its workers warm as it waits.
    WarmingWhileWaiting,
    /// Its warm workers are ready, `seconds` after their start: it joins with them.
    Warm {
        seconds: f64,
    },
    /// A warm start did not work out (why): the node joins and starts its workers once it has
    /// a place.
    WarmStartFailed(String),
    /// This node was asked to go as it joined, before it had workers (`reason`): the round
    /// forms without it, `nodes` others in it.
    NeverJoined {
        reason: String,
        nodes: u32,
    },
    /// As [`LaunchEvent::Withdrawing`], but the others cannot go on without this node's state
    /// (`why`): its workers stop, the one that was rank 0 saving a checkpoint.
    WithdrawRefused {
        node: String,
        signal: i32,
        why: String,
    },
}

/// A regroup in place as this node saw it: why, and its local rank 0's own report.
#[derive(Debug, Clone)]
pub struct NodeRegrouped {
    pub node: String,
    pub reason: String,
    /// What the worker told the agent: the sizes, the step, what streamed, how long.
    pub worker: collective::control::Regrouped,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot start worker {rank} ({program}): {source}")]
    Spawn {
        rank: u32,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    LogDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot find a free port: {0}")]
    NoFreePort(std::io::Error),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    Rendezvous(#[from] rendezvous::RendezvousError),
}

/// A TCP port nobody listens on right now (torchrun's `--standalone` does the same).
pub fn free_port() -> Result<u16, LaunchError> {
    std::net::TcpListener::bind(("0.0.0.0", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(LaunchError::NoFreePort)
}

/// A random identifier: run ids for standalone jobs and job tokens.
pub fn random_id(bytes: usize) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..bytes)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect()
}

/// The environment of worker `local_rank`, with torchrun's names; `error_file` is where its
/// `@record` writes the exception that ends it. A `warm` worker (started before its node has a
/// place in the job) gets none of the round's names, and `TRAINCTL_WARM_START=1`.
pub(crate) fn worker_env(
    spec: &LaunchSpec,
    local_rank: u32,
    restart_count: u32,
    omp_is_set: bool,
    error_file: &std::path::Path,
    warm: bool,
) -> Vec<(String, String)> {
    use contract::env as vars;
    let rank = spec.rank_offset + local_rank;
    let world_size = spec.world_size;
    const ROUND: [&str; 8] = [
        vars::RANK,
        vars::WORLD_SIZE,
        vars::GROUP_RANK,
        vars::GROUP_WORLD_SIZE,
        vars::ROLE_RANK,
        vars::ROLE_WORLD_SIZE,
        vars::MASTER_ADDR,
        vars::MASTER_PORT,
    ];
    let mut env: Vec<(String, String)> = [
        (vars::RANK, rank.to_string()),
        (vars::LOCAL_RANK, local_rank.to_string()),
        (vars::WORLD_SIZE, world_size.to_string()),
        (vars::LOCAL_WORLD_SIZE, spec.nproc_per_node.to_string()),
        (vars::GROUP_RANK, spec.node_rank.to_string()),
        (vars::GROUP_WORLD_SIZE, spec.nnodes.to_string()),
        (vars::ROLE_RANK, rank.to_string()),
        (vars::ROLE_WORLD_SIZE, world_size.to_string()),
        ("ROLE_NAME", "default".to_string()),
        (vars::MASTER_ADDR, spec.master_addr.clone()),
        (vars::MASTER_PORT, spec.master_port.to_string()),
        (vars::RUN_ID, spec.run_id.clone()),
        (vars::RESTART_COUNT, restart_count.to_string()),
        (vars::MAX_RESTARTS, spec.max_restarts.to_string()),
        // Workers host their own store, as PyTorch's do under torchrun's static rendezvous.
        ("TORCHELASTIC_USE_AGENT_STORE", "False".to_string()),
        (vars::JOB_TOKEN, spec.token.clone()),
        (vars::ERROR_FILE, error_file.display().to_string()),
    ]
    .into_iter()
    .filter(|(k, _)| !(warm && ROUND.contains(k)))
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if warm {
        env.push((vars::WARM_START.to_string(), "1".to_string()));
    }
    if let Some(timers) = &spec.file_timer {
        env.push((vars::TIMER_FILE.to_string(), timers.display().to_string()));
    }
    if spec.nproc_per_node > 1 && !omp_is_set {
        env.push((vars::OMP_NUM_THREADS.to_string(), "1".to_string()));
    }
    env.extend(spec.extra_env.iter().cloned());
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            nproc_per_node: 2,
            nnodes: 3,
            node_rank: 1,
            rank_offset: 2,
            world_size: 6,
            master_addr: "node0".into(),
            master_port: 29500,
            run_id: "job".into(),
            token: "tok".into(),
            max_restarts: 0,
            log_dir: None,
            grace: Duration::from_secs(1),
            monitor_interval: Duration::from_millis(100),
            program: vec!["true".into()],
            extra_env: vec![],
            working_dir: None,
            telemetry: None,
            hang_timeout: None,
            file_timer: None,
            regroup: false,
            warm_start: false,
            regroup_timeout: Duration::from_secs(240),
            evict_stragglers: false,
            health_check: HealthCheck::Off,
        }
    }

    #[test]
    fn worker_environment_follows_torchrun() {
        let env: std::collections::HashMap<_, _> =
            worker_env(&spec(), 1, 0, false, "/logs/1/error.json".as_ref(), false)
                .into_iter()
                .collect();
        assert_eq!(env["RANK"], "3");
        assert_eq!(env["LOCAL_RANK"], "1");
        assert_eq!(env["WORLD_SIZE"], "6");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["MASTER_ADDR"], "node0");
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "job");
        assert_eq!(env["OMP_NUM_THREADS"], "1");
        assert_eq!(env["TORCHELASTIC_ERROR_FILE"], "/logs/1/error.json");
        let env: std::collections::HashMap<_, _> =
            worker_env(&spec(), 0, 0, true, "/logs/0/error.json".as_ref(), false)
                .into_iter()
                .collect();
        assert!(
            !env.contains_key("OMP_NUM_THREADS"),
            "a user's OMP_NUM_THREADS is kept"
        );
    }

    #[test]
    fn a_warm_worker_has_no_place_in_a_round_yet() {
        let env: std::collections::HashMap<_, _> =
            worker_env(&spec(), 1, 0, false, "/logs/1/error.json".as_ref(), true)
                .into_iter()
                .collect();
        for round in [
            "RANK",
            "WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            assert!(!env.contains_key(round), "{round}");
        }
        assert_eq!(env["TRAINCTL_WARM_WORKER"], "1");
        assert_eq!(env["LOCAL_RANK"], "1");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "job");
    }
}
