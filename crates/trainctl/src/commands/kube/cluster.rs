//! `trainctl cluster create|delete|config|addons`: eksctl's ClusterConfig, eksctl run or
//! printed, and the add-ons.

use std::path::{Path, PathBuf};

use anyhow::Context;
use deploy::config::Project;
use deploy::{eksctl, manifests};

use super::super::project::{ProjectArgs, uses};
use super::{apply_and_report, bad_settings_are_usage, connect, print_yaml, runtime};
use crate::output;

#[derive(clap::Subcommand)]
pub(crate) enum ClusterCommand {
    /// Print eksctl's ClusterConfig for the preset (or write it with --file).
    Config {
        #[command(flatten)]
        project: ProjectArgs<uses::Cluster>,
        /// Write the config here instead of printing it.
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Create the cluster with eksctl (or print the command when eksctl is not installed).
    Create {
        #[command(flatten)]
        project: ProjectArgs<uses::Cluster>,
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
        project: ProjectArgs<uses::ClusterDelete>,
        /// Print the eksctl command instead of running it.
        #[arg(long)]
        dry_run: bool,
    },
    /// Install metrics-server and the EFS CSI driver (EKS add-ons), the NVIDIA device plugin
    /// on GPU presets, and say how to install the operator --launcher needs (pytorchjob, trainjob, mpijob).
    Addons {
        #[command(flatten)]
        project: ProjectArgs<uses::Addons>,
        /// Where the ClusterConfig that eksctl reads the add-ons from is written [default:
        /// eksctl-CLUSTER.yaml].
        #[arg(long)]
        file: Option<PathBuf>,
        /// Write the config, print the eksctl command and the device plugin's objects, and run
        /// or apply nothing.
        #[arg(long)]
        dry_run: bool,
    },
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
        output::kube::command(&shown);
        return Ok(0);
    }
    output::kube::running(&shown);
    match std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .status()
    {
        Ok(status) => Ok(status.code().unwrap_or(1)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            output::kube::not_installed(&argv[0]);
            output::kube::command(&shown);
            Ok(0)
        }
        Err(e) => Err(e).with_context(|| format!("cannot run {}", argv[0])),
    }
}

/// When the zones were not given, which ones the cluster config uses.
fn say_picked_zones(project: &Project) {
    let c = &project.cluster;
    if c.zones_picked {
        output::kube::zones_picked(&c.availability_zones, &c.region, c.instance_type.name);
    }
}

fn cluster_file(project: &Project, file: Option<PathBuf>) -> PathBuf {
    file.unwrap_or_else(|| PathBuf::from(format!("eksctl-{}.yaml", project.cluster.name)))
}

/// The eksctl config of `project` written to `file` (default `eksctl-CLUSTER.yaml`), for
/// eksctl to read.
fn write_cluster_file(project: &Project, file: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    say_picked_zones(project);
    let yaml = manifests::to_yaml(&[eksctl::cluster_config(project)?]);
    let path = cluster_file(project, file);
    write_atomically(&path, &yaml)?;
    Ok(path)
}

pub(crate) fn cluster(cmd: ClusterCommand) -> anyhow::Result<i32> {
    bad_settings_are_usage(run(cmd))
}

fn run(cmd: ClusterCommand) -> anyhow::Result<i32> {
    match cmd {
        ClusterCommand::Config { project, file } => {
            let project = project.project()?;
            say_picked_zones(&project);
            let yaml = manifests::to_yaml(&[eksctl::cluster_config(&project)?]);
            match file {
                Some(path) => {
                    write_atomically(&path, &yaml)?;
                    output::kube::wrote(&path);
                }
                None => output::kube::yaml(&yaml),
            }
            Ok(0)
        }
        ClusterCommand::Create {
            project,
            file,
            dry_run,
        } => {
            let project = project.project()?;
            let path = write_cluster_file(&project, file)?;
            output::kube::wrote(&path);
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
            let path = write_cluster_file(&project, file)?;
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
            if let Some(operator) = project.job.launcher.operator() {
                output::kube::install_operator(&operator);
            }
            Ok(0)
        }
    }
}
