//! `trainctl run`: torchrun's standalone and static modes, and the elastic agent
//! (`--rdzv-backend c10d|etcd`, `--nnodes MIN:MAX`): parse, plan ([`plan::Plan`]: the flags
//! resolved and checked), launch, report.

mod plan;

use contract::choices::{HealthCheck, Stragglers};
use contract::rdzv::Backend as RdzvBackend;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::io::{IsTerminal, Write};

use anyhow::{Context, bail};
use launcher::rendezvous::{self, Limits};

use launcher::{LaunchSpec, Outcome};

use super::args::choice;
use plan::{Endpoint, Plan, Topology};
use telemetry::prometheus::JobGauges;

/// Whether a node joining a job under way starts its workers before it asks for a place
/// (`--warm-start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum WarmStart {
    Auto,
    Off,
}

/// What an elastic job's workers do when the group changes (`--regroup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Regroup {
    InProcess,
    Restart,
}

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Single-node job on this machine: loopback rendezvous on a free port.
    #[arg(long, env = "PET_STANDALONE")]
    pub(crate) standalone: bool,
    /// Workers on this node: a number, or `auto`/`cpu` for one per CPU core.
    #[arg(long, env = "PET_NPROC_PER_NODE", default_value = "1")]
    pub(crate) nproc_per_node: String,
    /// Number of nodes: `N`, or `MIN:MAX` for an elastic job.
    #[arg(long, env = "PET_NNODES", default_value = "1")]
    pub(crate) nnodes: String,
    /// Rendezvous: `static` (fixed nodes, --node-rank and --master-addr), `c10d` (a store
    /// hosted by the agent at the endpoint) or `etcd` (etcd's v3 API). Default: c10d when
    /// --rdzv-endpoint or a MIN:MAX range is given, else static.
    #[arg(
        long,
        env = "PET_RDZV_BACKEND",
        value_parser = rdzv_backend_parser()
    )]
    pub(crate) rdzv_backend: Option<RdzvBackend>,
    /// HOST[:PORT] of the rendezvous store (c10d: default port 29400; etcd: 2379, or a URL).
    #[arg(long, env = "PET_RDZV_ENDPOINT")]
    pub(crate) rdzv_endpoint: Option<String>,
    /// Rendezvous settings, `key=value,...`: join_timeout (600), last_call_timeout (1),
    /// join_window (2: nodes arriving while the job runs are admitted together after it),
    /// close_timeout (10), exit_barrier_timeout (300: how long a node whose workers finished
    /// waits for the others'), heartbeat (0.5), heartbeat_timeout (2), timeout (3), is_host.
    #[arg(long, env = "PET_RDZV_CONF", default_value = "")]
    pub(crate) rdzv_conf: String,
    /// Address other nodes reach this node's workers at (default: this host's address on the
    /// route to the rendezvous store).
    #[arg(long, env = "PET_LOCAL_ADDR")]
    pub(crate) local_addr: Option<String>,
    /// This node's rank among the nodes.
    #[arg(long, env = "PET_NODE_RANK", default_value_t = 0)]
    pub(crate) node_rank: u32,
    /// Address of node 0, where rank 0 hosts the store.
    #[arg(long, env = "PET_MASTER_ADDR", default_value = "127.0.0.1")]
    pub(crate) master_addr: String,
    /// Port of the store on node 0 (0: pick a free one; single node only).
    #[arg(long, env = "PET_MASTER_PORT", default_value_t = contract::ports::MASTER)]
    pub(crate) master_port: u16,
    /// Job id: names the output folder and must match across nodes.
    #[arg(long = "rdzv-id", alias = "run-id", env = "PET_RDZV_ID")]
    pub(crate) run_id: Option<String>,
    /// Restarts after a worker fails; workers resume from their checkpoint. Elastic jobs count
    /// failures across all nodes (a lost or new node is not a failure). Passed to workers as
    /// TORCHELASTIC_MAX_RESTARTS.
    #[arg(long, env = "PET_MAX_RESTARTS", default_value_t = 0)]
    pub(crate) max_restarts: u32,
    /// Elastic jobs, when a node is lost or one joins: `in-process` (the default) keeps the
    /// built-in trainer's workers running: they regroup at the new world size from the step
    /// they hold, a joining node's workers take the state from a peer, and no checkpoint is
    /// read; `restart` stops and starts every worker from the last checkpoint, as torchrun
    /// does. Other programs always restart.
    #[arg(long, env = "TRAINCTL_REGROUP", value_enum, default_value_t = Regroup::InProcess)]
    pub(crate) regroup: Regroup,
    /// Elastic jobs: a node that joins a job under way whose workers regroup in place (the
    /// built-in trainer, a program using trainctl.torch) starts its workers first, warm: they
    /// run their start (imports, data, model) with no place in the job yet, and the node asks
    /// for one once they are ready, so the others pause only for the state's transfer. `auto`
    /// (the default) does so; `off` starts them once the node has a place. A node waiting
    /// while the job is at --nnodes MAX is a spare, kept warm the same way.
    #[arg(long, env = "TRAINCTL_WARM_START", value_enum, default_value_t = WarmStart::Auto)]
    pub(crate) warm_start: WarmStart,
    /// A node whose ranks take longer than the others' for a window of steps is a straggler
    /// (the built-in trainer compares them at every step: `train --straggler-factor` and
    /// `--straggler-window`): `warn` (the default) says so when it starts and when it ends;
    /// `evict` also drops the node, which leaves the job at a step boundary while the others
    /// regroup in place, never below --nnodes MIN.
    #[arg(long, env = "TRAINCTL_STRAGGLERS", default_value_t, value_parser = choice::<Stragglers>())]
    pub(crate) stragglers: Stragglers,
    /// Elastic jobs: before it joins, a node measures a CPU matrix multiply and a loopback TCP
    /// stream (about 0.15 s) and compares them with the nodes already in the job; one under
    /// half their median on either is far below them: `warn` (the default) lets it join,
    /// saying the figures; `refuse` keeps it out (exit 75: try again later); `off` does not
    /// measure. (Nodes sharing a machine with the job measure low while it trains.)
    #[arg(long, env = "TRAINCTL_HEALTH_CHECK", default_value_t, value_parser = choice::<HealthCheck>())]
    pub(crate) health_check: HealthCheck,
    /// Also write each rank's output to LOG_DIR/RUN_ID/attempt_0/RANK/{stdout,stderr}.log.
    #[arg(long, env = "PET_LOG_DIR")]
    pub(crate) log_dir: Option<PathBuf>,
    /// A node whose workers show no progress for this many seconds, neither a line of output
    /// nor CPU time, is hung: trainctl takes every worker's stack (Python stacks with py-spy's
    /// reader, else where each thread waits), names where each rank is, writes the stacks to
    /// the log folder, and stops the workers (a failure: restarted as --max-restarts says). A
    /// silent start (imports, a model loading) uses the CPU and is not a hang; a wait in a
    /// collective or a sleep is one, however early. Off by default.
    #[arg(long, env = "TRAINCTL_HANG_TIMEOUT", value_name = "SECONDS")]
    pub(crate) hang_timeout: Option<f64>,
    /// Serve torch.distributed.elastic.timer's file-based timers, as torchrun does when
    /// TORCHELASTIC_ENABLE_FILE_TIMER=1: workers get TORCHELASTIC_TIMER_FILE for their
    /// FileTimerClient, and a worker whose timer expires is killed with the signal it asked for.
    #[arg(
        long,
        env = contract::env::ENABLE_FILE_TIMER,
        value_parser = clap::builder::BoolishValueParser::new(),
        num_args = 0..=1,
        default_missing_value = "true",
        default_value = "false"
    )]
    pub(crate) file_timer: bool,
    /// Where the file timers' named pipe is made (default: a new one in the temporary folder).
    #[arg(long, env = "TORCHELASTIC_TIMER_FILE", value_name = "PATH")]
    pub(crate) timer_file: Option<PathBuf>,
    /// Also write the root cause of a failure to this file, at most 4096 bytes (in a pod:
    /// /dev/termination-log, which `kubectl describe pod` and `trainctl job status` show).
    #[arg(long, env = "TRAINCTL_TERMINATION_LOG", value_name = "PATH")]
    pub(crate) termination_log: Option<PathBuf>,
    /// Seconds between checks of the workers.
    #[arg(long, env = "PET_MONITOR_INTERVAL", default_value_t = 0.1)]
    pub(crate) monitor_interval: f64,
    /// Seconds a worker gets to exit after SIGTERM before SIGKILL.
    #[arg(long, env = "TRAINCTL_GRACE_PERIOD", default_value_t = 5.0)]
    pub(crate) grace_period: f64,
    /// Seconds after which a silent or vanished peer is an error in the workers' collective
    /// (default: 120).
    #[arg(long, env = "TRAINCTL_COLLECTIVE_TIMEOUT")]
    pub(crate) collective_timeout: Option<f64>,
    /// Serve this node's metrics (the agent's and its workers': steps, images/s, restarts,
    /// world size, last checkpoint age) in Prometheus's text format at
    /// http://0.0.0.0:PORT/metrics; 0 picks a free port.
    #[arg(long, env = "TRAINCTL_METRICS_PORT")]
    pub(crate) metrics_port: Option<u16>,
    /// Shared secret of the job's connections (default: random for one node; set it for several).
    #[arg(long, env = "TRAINCTL_JOB_TOKEN", hide_env_values = true)]
    pub(crate) job_token: Option<String>,
    /// Before starting the workers, copy this S3 object (a script: s3://BUCKET/main.py) or
    /// prefix (a folder of code) into --fetch-dir, as the torchelastic example's pods download
    /// their main.py. Repeatable; files already there and identical are not copied again.
    #[arg(
        long,
        env = "TRAINCTL_FETCH",
        value_delimiter = ' ',
        value_name = "S3_URI"
    )]
    pub(crate) fetch: Vec<String>,
    /// Where --fetch copies to; with --fetch, the workers start in this folder.
    #[arg(long, env = "TRAINCTL_FETCH_DIR", default_value = ".")]
    pub(crate) fetch_dir: PathBuf,
    /// `train ARGS...` for the built-in trainer, or `-- PROGRAM ARGS...` for any program
    /// (a PyTorch DDP script works: same environment as under torchrun).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub(crate) command: Vec<OsString>,
}

/// What `trainctl run` was asked to start, checked before anything starts: `train ARGS` is
/// parsed and checked as each worker would (a typo fails once, not once per worker), and a
/// word starting with `-` where the program should be is an unknown flag of `run`, not a
/// program to start.
fn check_program(command: &[OsString]) -> anyhow::Result<()> {
    let Some(first) = command.first().and_then(|c| c.to_str()) else {
        return Ok(());
    };
    if first == "train" {
        return super::train::check_argv(command);
    }
    if first.starts_with('-') && first != "--" {
        let flag = first.split('=').next().unwrap_or(first);
        let closest = closest_flag(flag)
            .map(|f| format!(" (did you mean {f}?)"))
            .unwrap_or_default();
        bail!(
            "unknown flag {flag} for trainctl run{closest}; flags go before the program: `trainctl run [FLAGS] train ...` or `trainctl run [FLAGS] -- PROGRAM ...` (trainctl run --help lists them)"
        );
    }
    Ok(())
}

/// The flag of `trainctl run` closest to `flag` by edit distance, when one is close.
fn closest_flag(flag: &str) -> Option<String> {
    use clap::Args as _;
    let cmd = Args::augment_args(clap::Command::new("run"));
    let word = flag.trim_start_matches('-');
    cmd.get_arguments()
        .filter_map(|a| a.get_long())
        .map(|long| (strsim::levenshtein(word, long), long))
        .filter(|(distance, long)| *distance <= (long.len() / 3).max(2))
        .min()
        .map(|(_, long)| format!("--{long}"))
}

/// `--fetch`: the program's code from S3, before any worker starts.
fn fetch(uris: &[String], dir: &std::path::Path) -> anyhow::Result<()> {
    if uris.is_empty() {
        return Ok(());
    }
    let uris = uris
        .iter()
        .map(|u| super::s3::parse_uri("--fetch", u))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let client = super::s3::client()?;
    for uri in &uris {
        let summary = super::s3::stage(&client, uri, dir)
            .with_context(|| format!("--fetch {uri}: the program's code could not be fetched"))?;
        crate::output::staged(uri, dir, &summary, true);
    }
    Ok(())
}

fn seconds(name: &str, v: f64) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("{name} must be a non-negative number of seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

/// `--rdzv-backend`: one of [`RdzvBackend::NAMES`] (listed in `--help`), parsed by the enum.
fn rdzv_backend_parser() -> impl clap::builder::TypedValueParser<Value = RdzvBackend> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(RdzvBackend::NAMES)
        .try_map(|name| name.parse::<RdzvBackend>())
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    launcher::agent_without_huge_pages();
    let refused = |e| refuse(e, args.termination_log.as_deref());
    check_program(&args.command).map_err(refused)?;
    let plan = Plan::from_args(&args).map_err(refused)?;
    fetch(&args.fetch, &args.fetch_dir)?;
    match plan.topology {
        Topology::Elastic { limits, endpoint } => {
            run_elastic(&args, plan.nproc_per_node, plan.run_id, limits, endpoint)
        }
        Topology::Static {
            nnodes,
            master_addr,
            master_port,
        } => run_static(
            &args,
            plan.nproc_per_node,
            plan.run_id,
            nnodes,
            master_addr,
            master_port,
        ),
    }
}

/// A fixed set of nodes (torchrun's static rendezvous, or `--standalone`).
fn run_static(
    args: &Args,
    nproc_per_node: u32,
    run_id: String,
    nnodes: u32,
    master_addr: String,
    master_port: Option<u16>,
) -> anyhow::Result<i32> {
    let master_port = match master_port {
        Some(port) => port,
        None => launcher::free_port()?,
    };
    let token = job_token(args, nnodes == 1, &run_id);
    let spec = LaunchSpec {
        nnodes,
        node_rank: args.node_rank,
        rank_offset: args.node_rank * nproc_per_node,
        world_size: nnodes * nproc_per_node,
        master_addr,
        master_port,
        ..worker_spec(args, nproc_per_node, run_id, token).map_err(super::usage)?
    };
    let watch = LiveView::start(args)?;
    let spec = LaunchSpec {
        telemetry: Some(watch.telemetry()),
        ..spec
    };
    watch.gauges().world_size = spec.world_size;
    let (stdout, stderr) = sinks();
    crate::output::launching(&spec);
    let mut events = |e| watch.launch_event(e);
    let outcome = launcher::launch(&spec, stdout, stderr.clone(), &mut events)?;
    watch.finish();
    Ok(finish(outcome, &stderr, args.termination_log.as_deref()))
}

/// What the user watches while the workers run: the progress bar (on a terminal) and the
/// `/metrics` endpoint, both fed by the workers' records and the launcher's events.
struct LiveView {
    gauges: Arc<Mutex<JobGauges>>,
    progress: Arc<Mutex<crate::output::ProgressDisplay>>,
    server: Option<telemetry::prometheus::Server>,
}

impl LiveView {
    fn start(args: &Args) -> anyhow::Result<Self> {
        let gauges = Arc::new(Mutex::new(JobGauges::default()));
        let server = match args.metrics_port {
            None => None,
            Some(port) => {
                let listener = std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
                    anyhow::anyhow!(
                        "--metrics-port {port}: cannot listen ({e}); pick another port, or 0 for a free one"
                    )
                })?;
                let shared = gauges.clone();
                let server = telemetry::prometheus::Server::start(listener, move || {
                    let g = shared.lock().unwrap_or_else(|p| p.into_inner());
                    telemetry::prometheus::encode(&g.families())
                })?;
                crate::output::metrics_endpoint(server.addr());
                Some(server)
            }
        };
        Ok(LiveView {
            gauges,
            progress: Arc::new(Mutex::new(crate::output::ProgressDisplay::new(
                std::io::stderr().is_terminal(),
            ))),
            server,
        })
    }

    fn gauges(&self) -> std::sync::MutexGuard<'_, JobGauges> {
        self.gauges.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The launcher's sink for the workers' records.
    fn telemetry(&self) -> launcher::Telemetry {
        let (gauges, progress) = (self.gauges.clone(), self.progress.clone());
        launcher::Telemetry(Arc::new(move |line: &[u8]| {
            // Anything that is not a record (another program's use of the pipe) is ignored.
            let Ok(record) = serde_json::from_slice::<telemetry::Record>(line) else {
                return;
            };
            if let telemetry::Record::Step(s) = &record {
                progress.lock().unwrap_or_else(|p| p.into_inner()).step(s);
            }
            gauges
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(&record);
        }))
    }

    fn launch_event(&self, event: launcher::LaunchEvent) {
        use launcher::LaunchEvent;
        {
            let mut g = self.gauges();
            match &event {
                LaunchEvent::Started(_) => g.worker_starts += 1,
                LaunchEvent::Joined(a) => {
                    g.round = a.round;
                    g.world_size = a.world_size;
                    g.restart_count = a.restart_count;
                }
                LaunchEvent::Restarting { restart_count, .. } => {
                    g.restart_count = *restart_count;
                    g.round += 1;
                }
                LaunchEvent::Regrouped(_) => g.regroups += 1,
                _ => {}
            }
        }
        crate::output::launch_event(event);
    }

    fn finish(self) {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .finish();
        drop(self.server);
    }
}

/// The job token: given, random for a job of one node, else derived from the run id.
fn job_token(args: &Args, single_node: bool, run_id: &str) -> String {
    match args.job_token.clone() {
        Some(t) => t,
        None if single_node => launcher::random_id(16),
        None => {
            crate::output::warn(
                "several nodes and no --job-token: using one derived from the run id; set TRAINCTL_JOB_TOKEN to a shared secret",
            );
            format!("run:{run_id}")
        }
    }
}

/// What every node's workers share, static or elastic: program, timings, logs.
/// The workers' part of the launch from the flags; every error is a flag's value (exit 2).
fn worker_spec(
    args: &Args,
    nproc_per_node: u32,
    run_id: String,
    token: String,
) -> anyhow::Result<LaunchSpec> {
    let mut program = args.command.clone();
    if program.first().is_some_and(|c| c == "train") {
        let exe = std::env::current_exe()
            .context("cannot find the trainctl executable to start workers")?;
        program.insert(0, exe.into_os_string());
    }
    let collective_timeout = match args.collective_timeout {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            bail!("--collective-timeout must be a positive number of seconds, got {t}")
        }
        t => t,
    };
    let file_timer = args.file_timer.then(|| {
        args.timer_file.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("trainctl-timers-{run_id}-{}", std::process::id()))
        })
    });
    Ok(LaunchSpec {
        nproc_per_node,
        nnodes: 1,
        node_rank: 0,
        rank_offset: 0,
        world_size: nproc_per_node,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        run_id,
        token,
        max_restarts: args.max_restarts,
        log_dir: args.log_dir.clone(),
        grace: seconds("--grace-period", args.grace_period)?,
        monitor_interval: seconds("--monitor-interval", args.monitor_interval)?
            .max(Duration::from_millis(10)),
        program,
        extra_env: collective_timeout
            .map(|t| vec![(contract::env::COLLECTIVE_TIMEOUT.into(), t.to_string())])
            .unwrap_or_default(),
        working_dir: (!args.fetch.is_empty()).then(|| args.fetch_dir.clone()),
        telemetry: None,
        file_timer,
        regroup: args.regroup == Regroup::InProcess,
        warm_start: args.warm_start == WarmStart::Auto,
        evict_stragglers: args.stragglers == Stragglers::Evict,
        health_check: args.health_check,
        // A worker answers after the step under way, then after its new group's ranks have
        // all joined, each bounded by the collective timeout.
        regroup_timeout: 2 * collective_timeout
            .map_or(collective::world::DEFAULT_TIMEOUT, Duration::from_secs_f64),
        hang_timeout: match args.hang_timeout {
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => bail!(
                "--hang-timeout must be a positive number of seconds, got {t}; leave it out to never declare a hang"
            ),
            None => None,
        },
    })
}

/// Worker output, a line at a time, above the progress bar when one is up.
fn sinks() -> (launcher::output::Sink, launcher::output::Sink) {
    (
        Arc::new(Mutex::new(crate::output::LineSink::new(false))),
        Arc::new(Mutex::new(crate::output::LineSink::new(true))),
    )
}

/// Reports how the job ended (and writes a failure's root cause to `termination_log`);
/// returns the exit code.
fn finish(
    outcome: Outcome,
    stderr: &launcher::output::Sink,
    termination_log: Option<&Path>,
) -> i32 {
    let mut err = stderr.lock().unwrap_or_else(|p| p.into_inner());
    let code = report_outcome(outcome, &mut *err, termination_log);
    let _ = err.flush();
    code
}

/// A command line refused before any worker starts (exit 2: a typo, or `train --precision
/// bf16` on a CPU without it): the reason also goes to the termination log, where a pod's
/// status (`job status`) shows it rather than only its log.
fn refuse(e: anyhow::Error, termination_log: Option<&Path>) -> anyhow::Error {
    if let Some(path) = termination_log {
        let report = format!("trainctl run: {}\n", crate::output::chain(&e));
        let _ = std::fs::write(path, head_of(&report, TERMINATION_MESSAGE_BYTES));
    }
    super::usage(e)
}

/// The most of a termination message Kubernetes keeps (`terminationMessagePath`).
const TERMINATION_MESSAGE_BYTES: usize = 4096;

/// `report` cut to whole lines of at most `limit` bytes.
fn head_of(report: &str, limit: usize) -> &str {
    if report.len() <= limit {
        return report;
    }
    let cut = report[..report.floor_char_boundary(limit)]
        .rfind('\n')
        .map_or(report.floor_char_boundary(limit), |i| i + 1);
    &report[..cut]
}

fn report_outcome(outcome: Outcome, err: &mut dyn Write, termination_log: Option<&Path>) -> i32 {
    let report = match outcome {
        Outcome::Succeeded => return 0,
        Outcome::Failed(failure) => format!("trainctl run: {failure}"),
        Outcome::JobFailed(root_cause) => {
            format!("trainctl run: the job failed; root cause (first failure):\n{root_cause}")
        }
        Outcome::Interrupted {
            signal,
            checkpointed,
        } => return report_interrupted(signal, checkpointed),
        // The leave was said when it happened; the exit code is the signal's, which a Job's
        // podFailurePolicy ignores, so the pod is replaced without counting a failure.
        Outcome::Left { signal } => return 128 + signal,
        // "Try again later" (EX_TEMPFAIL): a Job retries it, counted, so a node that stays
        // unhealthy ends up failing the pod's index rather than looping unseen.
        Outcome::Refused { report } => {
            let report = format!("trainctl run: {report}\n");
            let _ = write!(err, "{report}");
            if let Some(path) = termination_log {
                let _ = std::fs::write(path, head_of(&report, TERMINATION_MESSAGE_BYTES));
            }
            return contract::exit::PEER_LOST;
        }
        // As a leave (the Job replaces the pod uncounted); why, where `job status` reads it.
        Outcome::Evicted { report } => {
            if let Some(path) = termination_log {
                let _ = std::fs::write(path, head_of(&report, TERMINATION_MESSAGE_BYTES));
            }
            return contract::exit::PREEMPTED;
        }
    };
    let _ = write!(err, "{report}");
    if let Some(path) = termination_log
        && let Err(e) = std::fs::write(path, head_of(&report, TERMINATION_MESSAGE_BYTES))
    {
        crate::output::warn(&format!(
            "could not write the root cause to {} ({e}); it is above",
            path.display()
        ));
    }
    1
}

fn report_interrupted(signal: i32, checkpointed: bool) -> i32 {
    if checkpointed {
        crate::output::warn(&format!(
            "stopped by signal {signal}: the workers finished their step and saved a checkpoint; {}",
            crate::output::resume_hint()
        ));
    } else {
        crate::output::warn(&format!(
            "interrupted by signal {signal}; all workers were stopped"
        ));
    }
    128 + signal
}

/// `--rdzv-backend c10d|etcd`: this node's elastic agent.
fn run_elastic(
    args: &Args,
    nproc_per_node: u32,
    run_id: String,
    limits: Limits,
    endpoint: Endpoint,
) -> anyhow::Result<i32> {
    let token = job_token(args, limits.max == 1, &run_id);
    let mut cfg = rendezvous::Config::new(&run_id, limits);
    rendezvous::parse_conf(&mut cfg, &args.rdzv_conf).map_err(|e| super::usage(e.into()))?;
    cfg.token = token.clone();
    let shown = endpoint.given.clone();
    let kind = endpoint.backend;
    let spec = worker_spec(args, nproc_per_node, run_id, token).map_err(super::usage)?;
    let stopped = || launcher::stop_signal().is_some();
    let mut rdzv = match rendezvous::Rendezvous::open_unless(
        cfg,
        &kind,
        nproc_per_node,
        args.local_addr.clone(),
        &stopped,
    ) {
        Err(rendezvous::RendezvousError::Stopped) => {
            let signal = launcher::stop_signal().unwrap_or(15);
            crate::output::warn(&format!(
                "stopped (signal {signal}) while waiting for the rendezvous at {shown}: this node never joined"
            ));
            return Ok(128 + signal);
        }
        opened => opened.with_context(|| format!("cannot reach the rendezvous at {shown}"))?,
    };
    crate::output::agent_starting(&spec, &rdzv);
    let watch = LiveView::start(args)?;
    let spec = LaunchSpec {
        telemetry: Some(watch.telemetry()),
        ..spec
    };
    let (stdout, stderr) = sinks();
    let mut events = |e| watch.launch_event(e);
    let outcome = launcher::run_elastic(&spec, &mut rdzv, stdout, stderr.clone(), &mut events)?;
    drop(rdzv);
    watch.finish();
    Ok(finish(outcome, &stderr, args.termination_log.as_deref()))
}
