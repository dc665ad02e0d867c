//! The Kubernetes and EKS commands, one file each: `config`, `cluster`, `storage`, `job`, the
//! helper jobs (`data job`, `test job`), `doctor` and `tensorboard`. Rendering is in
//! `deploy::{eksctl, manifests}`, the API calls in `deploy::kube_api`; these files parse, call
//! and print. What several of them share is here.

mod cluster;
mod config;
mod doctor;
mod helpers;
mod job;
mod storage;
mod tensorboard;

pub(crate) use cluster::{ClusterCommand, cluster};
pub(crate) use config::{ConfigCommand, config};
pub(crate) use doctor::{DoctorArgs, doctor};
pub(crate) use helpers::{TestCommand, data_job, test};
pub(crate) use job::{JobCommand, job};
pub(crate) use storage::{StorageArgs, storage};
pub(crate) use tensorboard::{TensorboardArgs, tensorboard};

use std::time::Duration;

use deploy::config::{ConfigError, Project, Renders};
use deploy::eksctl::ClusterConfigError;
use deploy::kube_api::{Kube, Phase, ScaleError};
use deploy::manifests::{self, Manifest, NoStorage};

use super::project::ProjectArgs;
use crate::output;

/// A Kubernetes command's result, where settings that cannot work (a value refused, pods no
/// node can hold, a cluster eksctl cannot make, no storage given, a size outside a job's
/// bounds) are a bad command line
/// ([`super::Usage`]: exit 2), said with what to give instead. Anything else (the cluster
/// refused, a job failed) is left as it is.
fn bad_settings_are_usage(result: anyhow::Result<i32>) -> anyhow::Result<i32> {
    result.map_err(|e| {
        let bad_settings = e.chain().any(|c| {
            c.is::<ConfigError>()
                || c.is::<ClusterConfigError>()
                || c.is::<NoStorage>()
                || c.downcast_ref::<ScaleError>()
                    .is_some_and(ScaleError::is_usage)
        });
        if bad_settings { super::usage(e) } else { e }
    })
}

/// `project` once [`Project::review`] has passed it for rendering `what`: its warnings are
/// printed (stderr), a refusal is the error.
fn reviewed(project: Project, what: Renders) -> anyhow::Result<Project> {
    for warning in project.review(what)? {
        output::warn(&warning);
    }
    Ok(project)
}

/// The project with `-- PROGRAM ARGS...` as its job.command, as if given by flag.
fn with_program<U>(
    mut project: ProjectArgs<U>,
    program: Vec<String>,
) -> anyhow::Result<ProjectArgs<U>> {
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

fn print_yaml(docs: &[Manifest]) {
    output::kube::yaml(&manifests::to_yaml(docs));
}

async fn apply_and_report(kube: &Kube, docs: &[Manifest]) -> anyhow::Result<()> {
    output::kube::applied(&kube.apply(docs).await?, false);
    Ok(())
}

/// Starts helper job `name` (data, test, doctor): a finished one from before is replaced; a
/// running one is refused, named, rather than silently waited for in place of this request.
async fn start_helper(kube: &Kube, name: &str, docs: &[Manifest]) -> anyhow::Result<()> {
    if !kube.clear_finished(name).await? {
        let ns = kube.namespace();
        anyhow::bail!(
            "job {name} is still running from an earlier request in namespace {ns}; wait for it \
             (`trainctl job wait --name {name} --namespace {ns}`) or remove it (`kubectl delete \
             job {name} -n {ns}`), then run this again"
        );
    }
    output::kube::applied(&kube.launch(name, docs).await?, true);
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
fn helper_job(project: &Project, doc: Manifest, timeout: Duration) -> anyhow::Result<i32> {
    let name = doc.name().to_string();
    runtime()?.block_on(async {
        let kube = connect(project).await?;
        start_helper(&kube, &name, std::slice::from_ref(&doc)).await?;
        // Its output as it comes (a download's progress), until it has finished.
        let mut print = output::kube::line;
        let follow = kube.logs(&name, true, &mut print);
        if tokio::time::timeout(timeout, follow).await.is_err() {
            output::kube::not_finished(&name, timeout);
        }
        let status = kube.status(&name).await?;
        if status.phase == Phase::Succeeded {
            Ok(0)
        } else {
            output::kube::status(&status, true);
            Ok(1)
        }
    })
}
