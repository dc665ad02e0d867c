//! The Kubernetes and EKS commands: `config`, `cluster`, `storage`, `job`, `test`, `doctor`,
//! `tensorboard` and `data job`. Rendering is in `deploy::{eksctl, manifests}`, the API calls in
//! `deploy::kube_api`; this module parses, prints and runs eksctl.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use deploy::config::{Launcher, Project, SETTINGS};
use deploy::kube_api::{Kube, Phase};
use deploy::{doctor, eksctl, manifests};
use serde_json::Value;

use super::project::ProjectArgs;
use crate::output;

#[derive(clap::Subcommand)]
pub enum ConfigCommand {
    /// Print every setting's effective value and where it came from.
    Show {
        #[command(flatten)]
        project: ProjectArgs,
    },
}

#[derive(clap::Subcommand)]
pub enum ClusterCommand {
    /// Print eksctl's ClusterConfig for the preset (or write it with --file).
    Config {
        #[command(flatten)]
        project: ProjectArgs,
        /// Write the config here instead of printing it.
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Create the cluster with eksctl (or print the command when eksctl is not installed).
    Create {
        #[command(flatten)]
        project: ProjectArgs,
        /// Where the ClusterConfig is written [default: eksctl-CLUSTER.yaml].
        #[arg(long)]
        file: Option<PathBuf>,
        /// Write the config and print the command, run nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete the cluster with eksctl (or print the command).
    Delete {
        #[command(flatten)]
        project: ProjectArgs,
        #[arg(long)]
        dry_run: bool,
    },
    /// Install metrics-server and the EFS CSI driver (EKS add-ons), the NVIDIA device plugin
    /// on GPU presets, and say how to install the training operator for --launcher pytorchjob.
    Addons {
        #[command(flatten)]
        project: ProjectArgs,
        #[arg(long)]
        file: Option<PathBuf>,
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(clap::Subcommand)]
pub enum JobCommand {
    /// Print the training job's objects (YAML).
    Render {
        #[command(flatten)]
        project: ProjectArgs,
        /// `-- PROGRAM ARGS...`: your program instead of the built-in trainer (sets job.command).
        #[arg(last = true, value_name = "PROGRAM")]
        program: Vec<String>,
    },
    /// Create the training job in the cluster.
    Launch {
        #[command(flatten)]
        project: ProjectArgs,
        /// `-- PROGRAM ARGS...`: your program instead of the built-in trainer; every pod runs
        /// it under `trainctl run`, with torchrun's environment (sets job.command).
        #[arg(last = true, value_name = "PROGRAM")]
        program: Vec<String>,
    },
    /// The job, its conditions and its pods: phase, node, restarts, and why a pod is stuck.
    Status {
        #[command(flatten)]
        project: ProjectArgs,
    },
    /// Wait until the job succeeds (exit 0) or fails (exit 1).
    Wait {
        #[command(flatten)]
        project: ProjectArgs,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 3600.0)]
        timeout: f64,
    },
    /// All pods' logs interleaved, each line prefixed with its pod and node index.
    Logs {
        #[command(flatten)]
        project: ProjectArgs,
        /// Keep streaming, from pods as they start, until the job has finished.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// CPU and memory per pod and per node (the metrics API).
    Top {
        #[command(flatten)]
        project: ProjectArgs,
    },
    /// Delete the job, its pods, Service, token and helper jobs (never the storage).
    Delete {
        #[command(flatten)]
        project: ProjectArgs,
    },
}

#[derive(clap::Subcommand)]
pub enum TestCommand {
    /// Run `trainctl eval` on the saved model in the cluster and print the per-class table.
    Job {
        #[command(flatten)]
        project: ProjectArgs,
        /// Print the Job instead of creating it.
        #[arg(long)]
        dry_run: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, default_value_t = 1800.0)]
        timeout: f64,
    },
}

#[derive(clap::Args)]
pub struct StorageArgs {
    #[command(flatten)]
    project: ProjectArgs,
    /// Print the objects instead of creating them.
    #[arg(long)]
    dry_run: bool,
    /// Remove the claim, the volume and the class instead (the data stays on the file system:
    /// the volume's reclaim policy is Retain). Stop the jobs that use it first.
    #[arg(long, conflicts_with = "dry_run")]
    delete: bool,
}

#[derive(clap::Args)]
pub struct DoctorArgs {
    #[command(subcommand)]
    check: Option<DoctorCommand>,
    #[command(flatten)]
    project: ProjectArgs,
    /// Print the doctor job instead of running it.
    #[arg(long)]
    dry_run: bool,
    /// Seconds the checks may take.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

#[derive(clap::Subcommand)]
pub enum DoctorCommand {
    /// Run the checks in this pod (what each pod of the doctor job runs).
    Check {
        /// Every node's stable name, pod 0 (the rendezvous host) first.
        #[arg(long, value_delimiter = ',', required = true)]
        peers: Vec<String>,
        #[arg(long, default_value_t = 29400)]
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

#[derive(clap::Args)]
pub struct TensorboardArgs {
    #[command(flatten)]
    project: ProjectArgs,
    /// Print the objects instead of creating them.
    #[arg(long)]
    dry_run: bool,
    /// Remove TensorBoard's Deployment and Service (`job delete` removes them too).
    #[arg(long, conflicts_with = "dry_run")]
    delete: bool,
}

/// The project with `-- PROGRAM ARGS...` as its job.command, as if given by flag.
fn with_program(mut project: ProjectArgs, program: Vec<String>) -> anyhow::Result<ProjectArgs> {
    if !program.is_empty() {
        let words = deploy::config::join_words(&program).map_err(anyhow::Error::msg)?;
        project.flags.push(("job.command", words));
    }
    Ok(project)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn seconds(name: &str, v: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        v.is_finite() && v > 0.0,
        "--{name} must be a positive number of seconds, got {v}"
    );
    Ok(Duration::from_secs_f64(v))
}

async fn connect(project: &Project) -> anyhow::Result<Kube> {
    Ok(Kube::connect(&project.namespace, kubeconfig().as_deref()).await?)
}

/// KUBECONFIG, read here as kubectl reads it (the client skips the files it names that do not
/// exist); the Kubernetes client's own variable, not one of trainctl's settings.
#[allow(clippy::disallowed_methods)]
fn kubeconfig() -> Option<std::ffi::OsString> {
    std::env::var_os("KUBECONFIG")
}

/// ` --namespace NS` when the project is not in the default namespace: hints that name a job
/// must name where it is.
fn at_namespace(project: &Project) -> String {
    if project.namespace == "default" {
        String::new()
    } else {
        format!(" --namespace {}", project.namespace)
    }
}

fn print_yaml(docs: &[Value]) {
    print!("{}", manifests::to_yaml(docs));
}

async fn apply_and_report(kube: &Kube, docs: &[Value]) -> anyhow::Result<()> {
    for a in kube.apply(docs).await? {
        println!("applied {} {}", a.kind, a.name);
    }
    Ok(())
}

pub fn config(cmd: ConfigCommand) -> anyhow::Result<i32> {
    let ConfigCommand::Show { project } = cmd;
    let resolved = project.resolve()?;
    let width = SETTINGS.iter().map(|s| s.key.len()).max().unwrap_or(0);
    for s in SETTINGS {
        match resolved.values.get(s.key) {
            Some((value, source)) => println!("{:<width$}  {:<40}  {source}", s.key, value),
            None => println!("{:<width$}  {:<40}  (not set)", s.key, "-"),
        }
    }
    // Show the values first, then refuse the bad ones with the reason.
    Project::from_resolved(&resolved)?;
    Ok(0)
}

/// Writes `text` to `path` through a temporary file and a rename.
fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Runs `argv` with the terminal, or prints it when the program is not installed.
fn run_or_print(argv: &[String], dry_run: bool) -> anyhow::Result<i32> {
    let shown = argv.join(" ");
    if dry_run {
        println!("{shown}");
        return Ok(0);
    }
    eprintln!("running: {shown}");
    match std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .status()
    {
        Ok(status) => Ok(status.code().unwrap_or(1)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "{} is not installed here; run this where it is (https://eksctl.io/installation/):",
                argv[0]
            );
            println!("{shown}");
            Ok(0)
        }
        Err(e) => Err(e).with_context(|| format!("cannot run {}", argv[0])),
    }
}

/// When the zones were not given, which ones the cluster config uses.
fn say_picked_zones(project: &Project) {
    let c = &project.cluster;
    if c.zones_picked {
        eprintln!(
            "availability zones: {} (the first of {}; give --az to choose others, e.g. where {} is offered)",
            c.availability_zones.join(", "),
            c.region,
            c.instance_type.name
        );
    }
}

fn cluster_file(project: &Project, file: Option<PathBuf>) -> PathBuf {
    file.unwrap_or_else(|| PathBuf::from(format!("eksctl-{}.yaml", project.cluster.name)))
}

pub fn cluster(cmd: ClusterCommand) -> anyhow::Result<i32> {
    match cmd {
        ClusterCommand::Config { project, file } => {
            let project = project.project()?;
            say_picked_zones(&project);
            let yaml = manifests::to_yaml(&[eksctl::cluster_config(&project)?]);
            match file {
                Some(path) => {
                    write_atomically(&path, &yaml)?;
                    eprintln!("wrote {}", path.display());
                }
                None => print!("{yaml}"),
            }
            Ok(0)
        }
        ClusterCommand::Create {
            project,
            file,
            dry_run,
        } => {
            let project = project.project()?;
            say_picked_zones(&project);
            let yaml = manifests::to_yaml(&[eksctl::cluster_config(&project)?]);
            let path = cluster_file(&project, file);
            write_atomically(&path, &yaml)?;
            eprintln!("wrote {}", path.display());
            run_or_print(
                &eksctl::create_command(&path.display().to_string()),
                dry_run,
            )
        }
        ClusterCommand::Delete { project, dry_run } => {
            let project = project.project()?;
            run_or_print(&eksctl::delete_command(&project), dry_run)
        }
        ClusterCommand::Addons {
            project,
            file,
            dry_run,
        } => {
            let project = project.project()?;
            say_picked_zones(&project);
            let yaml = manifests::to_yaml(&[eksctl::cluster_config(&project)?]);
            let path = cluster_file(&project, file);
            write_atomically(&path, &yaml)?;
            let code = run_or_print(
                &eksctl::addons_command(&path.display().to_string()),
                dry_run,
            )?;
            if code != 0 {
                return Ok(code);
            }
            if project.cluster.instance_type.gpus > 0 {
                let plugin = manifests::nvidia_device_plugin();
                if dry_run {
                    print_yaml(&[plugin]);
                } else {
                    runtime()?.block_on(async {
                        apply_and_report(&connect(&project).await?, &[plugin]).await
                    })?;
                }
            }
            if project.job.launcher == Launcher::PyTorchJob {
                println!(
                    "The Kubeflow training operator is installed from its release manifests \
                     (kustomize), which trainctl does not vendor:\n  kubectl apply \
                     --server-side -k \"github.com/kubeflow/training-operator.git/manifests/\
                     overlays/standalone?ref={}\"",
                    deploy::kube_api::TRAINING_OPERATOR_VERSION
                );
            }
            Ok(0)
        }
    }
}

pub fn storage(args: StorageArgs) -> anyhow::Result<i32> {
    let project = args.project.project()?;
    let docs = manifests::storage(&project)?;
    if args.dry_run {
        print_yaml(&docs);
        return Ok(0);
    }
    runtime()?.block_on(async {
        let kube = connect(&project).await?;
        if args.delete {
            let deleted = kube.delete_storage(&docs).await?;
            if deleted.is_empty() {
                println!("no storage {} to delete", project.storage.claim);
            }
            for d in deleted {
                println!("deleted {} {}", d.kind, d.name);
            }
        } else {
            for a in kube.apply_storage(&docs).await? {
                println!("applied {} {}", a.kind, a.name);
            }
        }
        anyhow::Ok(())
    })?;
    Ok(0)
}

/// Starts helper job `name` (data, test, doctor): a finished one from before is replaced; a
/// running one is refused, named, rather than silently waited for in place of this request.
async fn start_helper(kube: &Kube, name: &str, docs: &[Value]) -> anyhow::Result<()> {
    if !kube.clear_finished(name).await? {
        let ns = kube.namespace();
        anyhow::bail!(
            "job {name} is still running from an earlier request in namespace {ns}; wait for it \
             (`trainctl job wait --name {name} --namespace {ns}`) or remove it (`kubectl delete \
             job {name} -n {ns}`), then run this again"
        );
    }
    for a in kube.launch(name, docs).await? {
        eprintln!("applied {} {}", a.kind, a.name);
    }
    Ok(())
}

/// Says up front when no node can take pods of `(cpu, memory)` on the job's nodes (a selector
/// no node has, more CPU or memory than any node has), as the scheduler would only say per pod.
async fn warn_if_no_node_fits(kube: &Kube, project: &Project, (cpu, memory): (&str, &str)) {
    if let Some(why) = kube
        .no_node_fits(project.job.node_selector.as_ref(), cpu, memory)
        .await
    {
        output::warn(&format!(
            "the pods may never be scheduled: {why} (a cluster that adds nodes on demand can \
             still schedule them)"
        ));
    }
}

/// Launches a one-pod helper job (data, test), waits for it and prints its logs.
fn helper_job(project: &Project, doc: Value, timeout: Duration) -> anyhow::Result<i32> {
    let name = doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    runtime()?.block_on(async {
        let kube = connect(project).await?;
        start_helper(&kube, &name, std::slice::from_ref(&doc)).await?;
        // Its output as it comes (a download's progress), until it has finished.
        let mut print = |line: &str| println!("{line}");
        let follow = kube.logs(&name, true, &mut print);
        if tokio::time::timeout(timeout, follow).await.is_err() {
            eprintln!("job {name} has not finished after {timeout:?}");
        }
        let status = kube.status(&name).await?;
        if status.phase == Phase::Succeeded {
            Ok(0)
        } else {
            eprint!("{}", status.render());
            Ok(1)
        }
    })
}

pub fn data_job(
    project: ProjectArgs,
    dry_run: bool,
    timeout: f64,
    synthetic: Option<u32>,
) -> anyhow::Result<i32> {
    let project = project.project()?;
    let doc = manifests::data_job(&project, synthetic);
    if dry_run {
        print_yaml(&[doc]);
        return Ok(0);
    }
    helper_job(&project, doc, seconds("timeout", timeout)?)
}

pub fn test(cmd: TestCommand) -> anyhow::Result<i32> {
    let TestCommand::Job {
        project,
        dry_run,
        timeout,
    } = cmd;
    let project = project.project()?;
    let doc = manifests::test_job(&project);
    if dry_run {
        print_yaml(&[doc]);
        return Ok(0);
    }
    helper_job(&project, doc, seconds("timeout", timeout)?)
}

pub fn job(cmd: JobCommand) -> anyhow::Result<i32> {
    match cmd {
        JobCommand::Render { project, program } => {
            let project = with_program(project, program)?.project()?;
            print_yaml(&manifests::training_job(&project, &launcher::random_id(16)));
            Ok(0)
        }
        JobCommand::Launch { project, program } => {
            let project = with_program(project, program)?.project()?;
            let docs = manifests::training_job(&project, &launcher::random_id(16));
            let name = project.job.name.clone();
            runtime()?.block_on(async {
                let kube = connect(&project).await?;
                let j = &project.job;
                warn_if_no_node_fits(&kube, &project, (&j.cpu, &j.memory)).await;
                for a in kube.launch(&name, &docs).await? {
                    println!("applied {} {}", a.kind, a.name);
                }
                let at = at_namespace(&project);
                println!(
                    "next: trainctl job status --name {name}{at}; trainctl job logs --name {name}{at} --follow"
                );
                Ok(0)
            })
        }
        JobCommand::Status { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let status = connect(&project).await?.status(&project.job.name).await?;
                print!("{}", status.render());
                Ok(0)
            })
        }
        JobCommand::Wait { project, timeout } => {
            let project = project.project()?;
            let timeout = seconds("timeout", timeout)?;
            runtime()?.block_on(async {
                let status = connect(&project)
                    .await?
                    .wait(&project.job.name, timeout)
                    .await?;
                print!("{}", status.render());
                Ok(if status.phase == Phase::Succeeded {
                    0
                } else {
                    1
                })
            })
        }
        JobCommand::Logs { project, follow } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                connect(&project)
                    .await?
                    .logs(&project.job.name, follow, &mut |line: &str| {
                        println!("{line}")
                    })
                    .await?;
                Ok(0)
            })
        }
        JobCommand::Top { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let top = connect(&project).await?.top(&project.job.name).await?;
                print!("{}", top.render());
                Ok(0)
            })
        }
        JobCommand::Delete { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                for d in connect(&project).await?.delete(&project.job.name).await? {
                    println!("deleted {} {}", d.kind, d.name);
                }
                Ok(0)
            })
        }
    }
}

pub fn doctor(args: DoctorArgs) -> anyhow::Result<i32> {
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
        let checks = doctor::run(&plan, &mut |c| println!("{c}"));
        let failed = checks
            .iter()
            .filter(|c| c.verdict == doctor::Verdict::Fail)
            .count();
        if failed > 0 {
            println!("{failed} check(s) failed");
            return Ok(1);
        }
        println!("all checks passed");
        return Ok(0);
    }
    let project = args.project.project()?;
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
            kube.logs(&name, false, &mut |line: &str| println!("{line}"))
                .await?;
        }
        // The doctor's objects go, whatever happened; its findings are printed above.
        kube.delete_matching(&selector).await?;
        let status = waited?;
        if status.phase == Phase::Succeeded {
            println!("doctor: every check passed on every node");
            Ok(0)
        } else {
            print!("{}", status.render());
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

pub fn tensorboard(args: TensorboardArgs) -> anyhow::Result<i32> {
    let project = args.project.project()?;
    let docs = manifests::tensorboard(&project);
    if args.dry_run {
        print_yaml(&docs);
        return Ok(0);
    }
    let name = manifests::tensorboard_name(&project);
    runtime()?.block_on(async {
        let kube = connect(&project).await?;
        if args.delete {
            let selector = manifests::component_selector(&project.job.name, "tensorboard");
            let deleted = kube.delete_matching(&selector).await?;
            if deleted.is_empty() {
                println!("no TensorBoard of job {} to delete", project.job.name);
            }
            for d in deleted {
                println!("deleted {} {}", d.kind, d.name);
            }
            return Ok(0);
        }
        apply_and_report(&kube, &docs).await?;
        let port = manifests::TENSORBOARD_PORT;
        println!(
            "TensorBoard reads {runs} on the claim. To open it from here:\n  kubectl \
             port-forward -n {ns} service/{name} {port}:{port}\nthen http://localhost:{port} \
             (inside the cluster: http://{name}.{ns}.svc:{port}). Remove it with trainctl \
             tensorboard --delete.",
            runs = project.job.runs_dir,
            ns = project.namespace,
        );
        Ok(0)
    })
}

#[cfg(test)]
mod tests {
    /// deploy keeps its own copy (it must not build burn); the two must agree.
    #[test]
    fn the_data_job_downloads_what_the_trainer_expects() {
        assert_eq!(deploy::config::OFFICIAL_URL, trainer::cifar::OFFICIAL_URL);
        assert_eq!(deploy::config::OFFICIAL_MD5, trainer::cifar::OFFICIAL_MD5);
        let tiny = trainer::data::Dataset::TinyImageNet.official();
        assert_eq!(deploy::config::TINY_IMAGENET_URL, tiny.url);
        assert_eq!(deploy::config::TINY_IMAGENET_MD5, tiny.md5);
    }

    /// The settings accept exactly the networks the trainer knows.
    #[test]
    fn the_job_model_setting_knows_the_trainers_networks() {
        for name in deploy::config::MODELS {
            assert!(
                trainer::model::Architecture::parse(name).is_some(),
                "{name}"
            );
        }
        let choices = trainer::model::Architecture::CHOICES;
        assert_eq!(
            choices.matches(", ").count() + choices.matches(" or ").count() + 1,
            deploy::config::MODELS.len(),
            "{choices}"
        );
    }

    /// The podFailurePolicy ignores the exit code the workers and the launcher use after a
    /// SIGTERM and a checkpoint; deploy does not depend on collective, so it keeps a copy.
    #[test]
    fn the_failure_policy_knows_the_preempted_exit_code() {
        assert_eq!(
            deploy::manifests::PREEMPTED_EXIT_CODE,
            collective::EXIT_PREEMPTED
        );
    }
}
