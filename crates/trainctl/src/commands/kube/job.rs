//! `trainctl job render|launch|status|wait|logs|top|delete`: the training job.

use deploy::config::{Project, Renders};
use deploy::kube_api::{JobStatus, Kube, Phase};
use deploy::launchers;

use super::super::project::{ProjectArgs, uses};
use super::{
    at_namespace, bad_settings_are_usage, connect, print_yaml, reviewed, runtime, seconds,
    warn_if_no_node_fits, with_program,
};
use crate::output;

#[derive(clap::Subcommand)]
pub(crate) enum JobCommand {
    /// Print the training job's objects (YAML), its token Secret without the token.
    Render {
        #[command(flatten)]
        project: ProjectArgs<uses::Training>,
        /// As `job launch --train-again`.
        #[arg(long)]
        train_again: bool,
        /// `-- PROGRAM ARGS...`: your program instead of the built-in trainer (sets job.command).
        #[arg(last = true, value_name = "PROGRAM")]
        program: Vec<String>,
    },
    /// Create the training job in the cluster, with a random token in its Secret.
    Launch {
        #[command(flatten)]
        project: ProjectArgs<uses::Training>,
        /// The built-in trainer: when the job's checkpoint holds a finished run (the same
        /// --name launched before), train again from scratch instead of failing at once.
        #[arg(long)]
        train_again: bool,
        /// `-- PROGRAM ARGS...`: your program instead of the built-in trainer; every pod runs
        /// it under `trainctl run`, with torchrun's environment (sets job.command).
        #[arg(last = true, value_name = "PROGRAM")]
        program: Vec<String>,
    },
    /// The job, its conditions and its pods: phase, node, restarts, and why a pod is stuck.
    Status {
        #[command(flatten)]
        project: ProjectArgs<uses::Lookup>,
    },
    /// Change a running job's number of nodes in place, within its --nnodes MIN:MAX: scaling
    /// down removes the highest node indexes (their agents leave, the others regroup), scaling
    /// up adds indexes that join at the next step and take the state from a peer.
    Scale {
        #[command(flatten)]
        project: ProjectArgs<uses::Lookup>,
        /// The number of nodes (pods) the job should train on.
        #[arg(value_name = "NODES")]
        nodes: u32,
    },
    /// Wait until the job succeeds (exit 0) or fails (exit 1).
    Wait {
        #[command(flatten)]
        project: ProjectArgs<uses::Lookup>,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 3600.0)]
        timeout: f64,
    },
    /// All pods' logs interleaved, each line prefixed with its pod and node index.
    Logs {
        #[command(flatten)]
        project: ProjectArgs<uses::Lookup>,
        /// Keep streaming, from pods as they start, until the job has finished.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// CPU and memory per pod and per node (the metrics API).
    Top {
        #[command(flatten)]
        project: ProjectArgs<uses::Lookup>,
    },
    /// Delete the job, its pods, Service, token and helper jobs (never the storage).
    Delete {
        #[command(flatten)]
        project: ProjectArgs<uses::Lookup>,
    },
}

pub(crate) fn job(cmd: JobCommand) -> anyhow::Result<i32> {
    bad_settings_are_usage(run(cmd))
}

fn run(cmd: JobCommand) -> anyhow::Result<i32> {
    match cmd {
        JobCommand::Render {
            project,
            program,
            train_again,
        } => {
            let mut project = with_program(project, program)?.project()?;
            project.job.train_again = train_again_for(&project, train_again)?;
            let project = reviewed(project, Renders::TrainingJob)?;
            let docs = launchers::training_job(&project, launchers::Token::Withheld);
            let secret = launchers::token_secret_name(&project);
            // An MPIJob's pods do not run trainctl: no token.
            if docs.iter().any(|d| d.name() == secret) {
                output::kube::token_withheld(&secret, &project.namespace);
            }
            print_yaml(&docs);
            Ok(0)
        }
        JobCommand::Launch {
            project,
            program,
            train_again,
        } => launch(project, program, train_again),
        JobCommand::Status { project } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let kube = connect(&project).await?;
                let mut status = kube.status(&project.job.name).await?;
                if !status.phase.is_finished() {
                    kube.read_training_round(&mut status).await;
                }
                output::kube::status(&status, false);
                stop_etcd_if_finished(&kube, &status, &project).await;
                Ok(0)
            })
        }
        JobCommand::Scale { project, nodes } => {
            let project = project.project()?;
            runtime()?.block_on(async {
                let kube = connect(&project).await?;
                let scaled = kube.scale(&project.job.name, nodes).await?;
                output::kube::scaled(&scaled);
                Ok(0)
            })
        }
        JobCommand::Wait { project, timeout } => {
            let project = project.project()?;
            let timeout = seconds("timeout", timeout)?;
            runtime()?.block_on(async {
                let kube = connect(&project).await?;
                let status = kube.wait(&project.job.name, timeout).await?;
                output::kube::status(&status, false);
                stop_etcd_if_finished(&kube, &status, &project).await;
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
                let kube = connect(&project).await?;
                kube.logs(&project.job.name, follow, &mut output::kube::line)
                    .await?;
                if follow
                    // Gone since (deleted): nothing left to stop.
                    && let Ok(status) = kube.status(&project.job.name).await
                {
                    stop_etcd_if_finished(&kube, &status, &project).await;
                }
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

/// `job launch`: the job's objects applied, with a random token.
fn launch(
    project: ProjectArgs<uses::Training>,
    program: Vec<String>,
    train_again: bool,
) -> anyhow::Result<i32> {
    let mut project = with_program(project, program)?.project()?;
    project.job.train_again = train_again_for(&project, train_again)?;
    let project = reviewed(project, Renders::TrainingJob)?;
    let token = launcher::random_id(16);
    let docs = launchers::training_job(&project, launchers::Token::Value(&token));
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

/// `--train-again`, which only the built-in trainer takes: with a program of the user's it is
/// a bad command line (the program decides how it resumes).
fn train_again_for(project: &Project, asked: bool) -> anyhow::Result<bool> {
    if asked && let Some(program) = &project.job.command {
        return Err(crate::commands::usage(anyhow::anyhow!(
            "--train-again is the built-in trainer's, but this job runs your program ({}): it \
             decides itself whether to resume; leave --train-again out (or remove its \
             checkpoint from the volume to start afresh)",
            program.join(" ")
        )));
    }
    Ok(asked)
}

/// A finished job's etcd is scaled to zero by whichever command sees the job finished (`job
/// status`, `job wait`, `job logs --follow`); a failure to is said, not fatal: the job's TTL
/// takes the etcd with the job in any case.
async fn stop_etcd_if_finished(kube: &Kube, status: &JobStatus, project: &Project) {
    match kube.stop_etcd_if_finished(status).await {
        Ok(stopped) => output::kube::etcd_stopped(&stopped, &status.name),
        Err(e) => output::warn(&format!(
            "the etcd of finished job {} still runs: {e}; `trainctl job delete --name {}{}` \
             removes it with the job, and the job's TTL (job.ttl_seconds) in any case",
            status.name,
            status.name,
            at_namespace(project)
        )),
    }
}
