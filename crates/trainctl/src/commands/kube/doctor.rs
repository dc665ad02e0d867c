//! `trainctl doctor`: the in-pod checks as a job on the training nodes (`doctor check` is what
//! each pod runs).

use std::path::PathBuf;

use deploy::config::Renders;
use deploy::kube_api::Phase;
use deploy::{doctor, manifests};

use super::super::project::{ProjectArgs, uses};
use super::{
    bad_settings_are_usage, connect, print_yaml, reviewed, runtime, seconds, start_helper,
    warn_if_no_node_fits,
};
use crate::output;

#[derive(clap::Args)]
pub(crate) struct DoctorArgs {
    #[command(subcommand)]
    check: Option<DoctorCommand>,
    #[command(flatten)]
    project: ProjectArgs<uses::Doctor>,
    /// Print the doctor job instead of running it.
    #[arg(long)]
    dry_run: bool,
    /// Seconds to wait for the doctor job's pods to finish their checks.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

#[derive(clap::Subcommand)]
pub(super) enum DoctorCommand {
    /// Run the checks in this pod (what each pod of the doctor job runs).
    Check {
        /// Every node's stable name, pod 0 (the rendezvous host) first.
        #[arg(long, value_delimiter = ',', required = true)]
        peers: Vec<String>,
        /// The rendezvous port: this pod listens on it, and every peer must accept
        /// connections on it.
        #[arg(long, default_value_t = contract::ports::C10D)]
        port: u16,
        /// Where the claim is mounted.
        #[arg(long, default_value = "/data")]
        claim: PathBuf,
        /// Where CIFAR-10 should be.
        #[arg(long)]
        data: Option<PathBuf>,
        /// This pod's name [default: the host name].
        #[arg(long)]
        me: Option<String>,
        /// Address to listen on [default: 0.0.0.0].
        #[arg(long)]
        listen: Option<std::net::IpAddr>,
        /// Seconds the checks may take: resolving and reaching every peer, and staying up
        /// until the peers have checked this pod.
        #[arg(long, default_value_t = 120.0)]
        timeout: f64,
        /// GPUs this pod requested: fewer in /dev fails the check.
        #[arg(long, default_value_t = 0)]
        expect_gpus: u32,
        /// EFA adapters this pod requested: fewer in /dev/infiniband fails the check.
        #[arg(long, default_value_t = 0)]
        expect_efa: u32,
        /// Where dev/ and sys/ are looked for (tests) [default: /].
        #[arg(long, hide = true, default_value = "/")]
        root: PathBuf,
    },
}

pub(crate) fn doctor(args: DoctorArgs) -> anyhow::Result<i32> {
    bad_settings_are_usage(run(args))
}

fn run(args: DoctorArgs) -> anyhow::Result<i32> {
    if let Some(DoctorCommand::Check {
        peers,
        port,
        claim,
        data,
        me,
        listen,
        timeout,
        expect_gpus,
        expect_efa,
        root,
    }) = args.check
    {
        let me = match me {
            Some(me) => me,
            None => nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_default(),
        };
        let plan = doctor::Plan {
            peers,
            port,
            claim,
            data,
            me,
            listen: (listen.unwrap_or([0, 0, 0, 0].into()), port).into(),
            timeout: seconds("timeout", timeout)?,
            accelerators: doctor::Accelerators {
                gpus: expect_gpus,
                efa: expect_efa,
                root,
                env: nccl_variables(),
            },
        };
        let checks = doctor::run(&plan, &mut |c| output::kube::line(&c.to_string()));
        let failed = checks
            .iter()
            .filter(|c| c.verdict == doctor::Verdict::Fail)
            .count();
        output::kube::checks_done(failed);
        return Ok(if failed > 0 { 1 } else { 0 });
    }
    let project = reviewed(args.project.project()?, Renders::Doctor)?;
    let docs = manifests::doctor_job(&project);
    if args.dry_run {
        print_yaml(&docs);
        return Ok(0);
    }
    let name = manifests::doctor_job_name(&project);
    let timeout = seconds("timeout", args.timeout)?;
    runtime()?.block_on(async {
        let kube = connect(&project).await?;
        let selector = manifests::component_selector(&project.job.name, "doctor");
        warn_if_no_node_fits(&kube, &project, manifests::HELPER_SIZE).await;
        start_helper(&kube, &name, &docs).await?;
        let waited = kube.wait(&name, timeout).await;
        if waited.is_ok() {
            kube.logs(&name, false, &mut output::kube::line).await?;
        }
        // The doctor's objects go, whatever happened; its findings are printed above.
        kube.delete_matching(&selector).await?;
        let status = waited?;
        if status.phase == Phase::Succeeded {
            output::kube::doctor_passed();
            Ok(0)
        } else {
            output::kube::status(&status, false);
            Ok(1)
        }
    })
}

/// The pod's `NCCL_*` and `FI_*` variables, which the doctor reports (what NCCL and
/// libfabric will read in the training pods of the same template).
#[allow(clippy::disallowed_methods)]
fn nccl_variables() -> Vec<(String, String)> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("NCCL_") || k.starts_with("FI_"))
        .collect()
}
