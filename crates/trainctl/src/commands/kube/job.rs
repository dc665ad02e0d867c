//! `trainctl job render|launch|status|wait|logs|top|delete`: the training job.

use deploy::kube_api::Phase;
use deploy::manifests;

use super::super::project::ProjectArgs;
use super::{
    at_namespace, connect, print_yaml, runtime, seconds, warn_if_no_node_fits, with_program,
};

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
