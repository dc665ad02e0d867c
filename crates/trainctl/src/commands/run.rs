//! `trainctl run`: torchrun's standalone and static multi-node modes.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use launcher::{LaunchSpec, Outcome};

#[derive(clap::Args)]
pub struct Args {
    /// Single-node job on this machine: loopback rendezvous on a free port.
    #[arg(long, env = "PET_STANDALONE")]
    standalone: bool,
    /// Workers on this node: a number, or `auto`/`cpu` for one per CPU core.
    #[arg(long, env = "PET_NPROC_PER_NODE", default_value = "1")]
    nproc_per_node: String,
    /// Number of nodes (`N`, or `N:N`; elastic `MIN:MAX` ranges need the rendezvous).
    #[arg(long, env = "PET_NNODES", default_value = "1")]
    nnodes: String,
    /// This node's rank among the nodes.
    #[arg(long, env = "PET_NODE_RANK", default_value_t = 0)]
    node_rank: u32,
    /// Address of node 0, where rank 0 hosts the store.
    #[arg(long, env = "PET_MASTER_ADDR", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store on node 0 (0: pick a free one; single node only).
    #[arg(long, env = "PET_MASTER_PORT", default_value_t = collective::world::DEFAULT_MASTER_PORT)]
    master_port: u16,
    /// Job id: names the output folder and must match across nodes.
    #[arg(long = "rdzv-id", alias = "run-id", env = "PET_RDZV_ID")]
    run_id: Option<String>,
    /// Restarts of the whole group after a worker fails (single node); workers resume from
    /// their checkpoint. Passed to workers as TORCHELASTIC_MAX_RESTARTS.
    #[arg(long, env = "PET_MAX_RESTARTS", default_value_t = 0)]
    max_restarts: u32,
    /// Also write each rank's output to LOG_DIR/RUN_ID/attempt_0/RANK/{stdout,stderr}.log.
    #[arg(long, env = "PET_LOG_DIR")]
    log_dir: Option<PathBuf>,
    /// Seconds between checks of the workers.
    #[arg(long, env = "PET_MONITOR_INTERVAL", default_value_t = 0.1)]
    monitor_interval: f64,
    /// Seconds a worker gets to exit after SIGTERM before SIGKILL.
    #[arg(long, env = "TRAINCTL_GRACE_PERIOD", default_value_t = 5.0)]
    grace_period: f64,
    /// Seconds after which a silent or vanished peer is an error in the workers' collective.
    #[arg(long, env = "TRAINCTL_COLLECTIVE_TIMEOUT")]
    collective_timeout: Option<f64>,
    /// Shared secret of the job's connections (default: random for one node; set it for several).
    #[arg(long, env = "TRAINCTL_JOB_TOKEN", hide_env_values = true)]
    job_token: Option<String>,
    /// `train ARGS...` for the built-in trainer, or `-- PROGRAM ARGS...` for any program
    /// (a PyTorch DDP script works: same environment as under torchrun).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    command: Vec<OsString>,
}

fn seconds(name: &str, v: f64) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("{name} must be a non-negative number of seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

fn parse_nproc(v: &str) -> anyhow::Result<u32> {
    match v {
        "auto" | "cpu" => Ok(std::thread::available_parallelism().map_or(1, |n| n.get() as u32)),
        "gpu" => {
            bail!("--nproc-per-node gpu: this build has no GPU backend; use a number or `cpu`")
        }
        n => match n.parse::<u32>() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("--nproc-per-node must be a positive number, `auto` or `cpu`, got {n:?}"),
        },
    }
}

fn parse_nnodes(v: &str) -> anyhow::Result<u32> {
    let (min, max) = v.split_once(':').unwrap_or((v, v));
    let parse = |s: &str| s.trim().parse::<u32>().ok().filter(|&n| n > 0);
    match (parse(min), parse(max)) {
        (Some(a), Some(b)) if a == b => Ok(a),
        (Some(_), Some(_)) => bail!(
            "--nnodes {v}: elastic ranges need the elastic agent, which this version lacks; give a fixed node count"
        ),
        _ => bail!("--nnodes must be a positive number (or N:N), got {v:?}"),
    }
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let nproc_per_node = parse_nproc(&args.nproc_per_node)?;
    let nnodes = if args.standalone {
        1
    } else {
        parse_nnodes(&args.nnodes)?
    };
    if args.node_rank >= nnodes {
        bail!(
            "--node-rank {} is not below --nnodes {nnodes}",
            args.node_rank
        );
    }
    let (master_addr, master_port) = if args.standalone || args.master_port == 0 {
        if nnodes > 1 {
            bail!(
                "--master-port 0 picks a free port on this node, which other nodes cannot know: give a port"
            );
        }
        let addr = if args.standalone {
            "127.0.0.1".to_string()
        } else {
            args.master_addr.clone()
        };
        (addr, launcher::free_port()?)
    } else {
        (args.master_addr.clone(), args.master_port)
    };
    if nnodes > 1 && args.max_restarts > 0 {
        bail!(
            "--max-restarts {} with --nnodes {nnodes}: restarting a static multi-node job needs every node to restart together, which takes the elastic agent; use --max-restarts 0",
            args.max_restarts
        );
    }
    let run_id = args.run_id.clone().unwrap_or_else(|| {
        if nnodes == 1 {
            "local".into()
        } else {
            "none".into()
        }
    });
    let token = match args.job_token.clone() {
        Some(t) => t,
        None if nnodes == 1 => launcher::random_id(16),
        None => {
            crate::output::warn(
                "several nodes and no --job-token: using one derived from the run id; set TRAINCTL_JOB_TOKEN to a shared secret",
            );
            format!("run:{run_id}")
        }
    };
    let mut program = args.command.clone();
    if program.first().is_some_and(|c| c == "train") {
        let exe = std::env::current_exe()
            .context("cannot find the trainctl executable to start workers")?;
        program.insert(0, exe.into_os_string());
    }
    let spec = LaunchSpec {
        nproc_per_node,
        nnodes,
        node_rank: args.node_rank,
        master_addr,
        master_port,
        run_id,
        token,
        max_restarts: args.max_restarts,
        log_dir: args.log_dir.clone(),
        grace: seconds("--grace-period", args.grace_period)?,
        monitor_interval: seconds("--monitor-interval", args.monitor_interval)?
            .max(Duration::from_millis(10)),
        program,
        extra_env: match args.collective_timeout {
            Some(t) if t.is_finite() && t > 0.0 => {
                vec![("TRAINCTL_COLLECTIVE_TIMEOUT".into(), t.to_string())]
            }
            Some(t) => bail!("--collective-timeout must be a positive number of seconds, got {t}"),
            None => vec![],
        },
    };
    let stdout: launcher::output::Sink = Arc::new(Mutex::new(std::io::stdout()));
    let stderr: launcher::output::Sink = Arc::new(Mutex::new(std::io::stderr()));
    crate::output::launching(&spec);
    let mut events = crate::output::launch_event;
    match launcher::launch(&spec, stdout, stderr.clone(), &mut events)? {
        Outcome::Succeeded => Ok(0),
        Outcome::Failed(failure) => {
            let mut err = stderr.lock().unwrap_or_else(|p| p.into_inner());
            let _ = write!(err, "trainctl run: {failure}");
            Ok(1)
        }
        Outcome::Interrupted(sig) => {
            crate::output::warn(&format!(
                "interrupted by signal {sig}; all workers were stopped"
            ));
            Ok(128 + sig)
        }
    }
}
