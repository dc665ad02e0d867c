//! `trainctl job render|launch|status|wait|logs|top|delete`: the training job.

use deploy::kube_api::Phase;
use deploy::manifests;

use super::super::project::ProjectArgs;
use super::{
    at_namespace, connect, print_yaml, runtime, seconds, warn_if_no_node_fits, with_program,
};
use crate::output;

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
                output::kube::applied(&kube.launch(&name, &docs).await?, false);
                output::kube::launched(&name, &at_namespace(&project));
                Ok(0)
            })
        }
        JobCommand::Status { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let status = connect(&project).await?.status(&project.job.name).await?;
                output::kube::status(&status, false);
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
                output::kube::status(&status, false);
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
                    .logs(&project.job.name, follow, &mut output::kube::line)
                    .await?;
                Ok(0)
            })
        }
        JobCommand::Top { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let top = connect(&project).await?.top(&project.job.name).await?;
                output::kube::top(&top);
                Ok(0)
            })
        }
        JobCommand::Delete { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let deleted = connect(&project).await?.delete(&project.job.name).await?;
                output::kube::deleted(&deleted, None);
                Ok(0)
            })
        }
    }
}
