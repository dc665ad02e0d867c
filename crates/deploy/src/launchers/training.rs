//! What every launcher builds its training job from: the job token's Secret, the rendezvous
//! objects, the pods' typed command line ([`worker_run_args`]) and the worker's pod template.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PodTemplateSpec, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use contract::argv::{RunArgs, RunFlag, Target, TrainArgs};
use contract::choices::{HealthCheck, Stragglers};

use crate::config::{Project, RdzvBackend};
use crate::manifests::{
    ETCD_PORT, FETCH_DIR, KUEUE_ELASTIC_ANNOTATION, Manifest, NNODES_ANNOTATION, PodOptions,
    QUEUE_LABEL, SPARES_ANNOTATION, TERMINATION_GRACE_SECONDS, TERMINATION_LOG, TRAINER_ANNOTATION,
    etcd, etcd_name, meta, pod_template,
};

/// The job token's place in its Secret, which every training pod reads
/// (`TRAINCTL_JOB_TOKEN`: the collective's connections must present it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token<'a> {
    /// Left out (`job render`): the rendered Secret is the same on every render of the job, so
    /// `kubectl diff` sees no change, and no secret is printed.
    Withheld,
    /// Written in (`job launch`: a random token made for this launch, which a stranger cannot
    /// guess).
    Value(&'a str),
}

/// The Secret holding the job's connection token.
pub fn token_secret(project: &Project, token: Token) -> Manifest {
    let secret = Secret {
        metadata: meta(project, &token_secret_name(project), "worker"),
        string_data: match token {
            Token::Value(token) => Some(BTreeMap::from([("token".into(), token.into())])),
            Token::Withheld => None,
        },
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    Manifest::of(&secret)
}

pub fn token_secret_name(project: &Project) -> String {
    format!("{}-token", project.job.name)
}

/// The `trainctl train` arguments of the job.
fn train_args(project: &Project) -> TrainArgs {
    let j = &project.job;
    TrainArgs {
        model: j.model,
        data: project.data.dir.clone(),
        out: j.runs_dir.clone(),
        epochs: j.epochs,
        batch_size: j.batch_size,
        learning_rate: j.learning_rate,
        // The data job puts the data set on the volume first.
        no_download: true,
        upload: j.upload.clone(),
        precision: j.precision,
        train_again: j.train_again,
    }
}

/// The training job, as its launcher ([`crate::launchers`]) renders it.
pub fn training_job(project: &Project, token: Token) -> Vec<Manifest> {
    super::kind(project.job.launcher).render(project, token)
}

/// What every job whose pods run `trainctl run` needs first: a Secret for the job token, and
/// the job's etcd (its Service and Deployment) with `--rdzv-backend etcd`.
pub(crate) fn rendezvous_objects(project: &Project, token: Token) -> Vec<Manifest> {
    let mut out = vec![token_secret(project, token)];
    if project.job.rdzv_backend == RdzvBackend::Etcd {
        out.extend(etcd(project));
    }
    out
}

/// The host of the rendezvous store: pod 0's stable DNS name.
pub fn rdzv_host(project: &Project) -> String {
    super::kind(project.job.launcher).rdzv_host(project)
}

/// The rendezvous backend's endpoint: the store on pod 0 (c10d), or the job's etcd.
pub(crate) fn rdzv_endpoint(project: &Project) -> String {
    match project.job.rdzv_backend {
        RdzvBackend::C10d => format!("{}:{}", rdzv_host(project), project.job.rdzv_port),
        RdzvBackend::Etcd => format!("{}:{ETCD_PORT}", etcd_name(project)),
    }
}

pub(crate) fn rdzv_flags(project: &Project) -> [RunFlag; 2] {
    [
        RunFlag::RdzvBackend(project.job.rdzv_backend.backend()),
        RunFlag::RdzvEndpoint(rdzv_endpoint(project)),
    ]
}

/// `trainctl run`'s flags for the job's nodes and rendezvous.
pub(crate) fn launch_flags(project: &Project) -> Vec<RunFlag> {
    let j = &project.job;
    let mut flags = vec![
        RunFlag::Nnodes(j.nnodes()),
        RunFlag::NprocPerNode(j.nproc_per_node),
    ];
    flags.extend(rdzv_flags(project));
    flags
}

/// `trainctl run`'s flags for the job's nodes, rendezvous and restarts, when the pods are told
/// them by flags (see [`crate::launchers::Kind::node_flags`]).
pub(crate) fn node_flags(project: &Project) -> Vec<RunFlag> {
    let j = &project.job;
    let mut flags = launch_flags(project);
    flags.push(RunFlag::RdzvId(j.name.clone()));
    flags.push(RunFlag::MaxRestarts(j.max_restarts));
    flags
}

/// A pod of an MPIJob running `command` itself (mpirun on the launcher, sshd on the workers):
/// the workers sized for training with their accelerators, the launcher small.
pub(crate) fn mpi_template(
    project: &Project,
    component: &'static str,
    command: Vec<String>,
    worker: bool,
) -> PodTemplateSpec {
    pod_template(
        project,
        PodOptions {
            component,
            container: component,
            image: project.image.clone(),
            args: command,
            runs_trainctl: false,
            training_size: worker,
            accelerators: worker,
            user_program: true,
            port: None,
            metrics_port: None,
            token_secret: None,
            subdomain: None,
            service_account: true,
        },
    )
}

fn metrics_flag(project: &Project) -> Option<RunFlag> {
    project.job.metrics_port.map(RunFlag::MetricsPort)
}

/// The training pods' command line, for every launcher that runs `trainctl run`: `trainctl run FLAGS... train ...`
/// (or `-- PROGRAM ARGS...`: the user's program, with torchrun's environment).
pub fn worker_run_args(project: &Project) -> RunArgs {
    let j = &project.job;
    let mut flags = super::kind(j.launcher).node_flags(project);
    flags.extend(metrics_flag(project));
    // The workers' share of the pod's grace: finish the step, write the checkpoint; the
    // launcher keeps a few seconds to report and exit.
    flags.push(RunFlag::GracePeriod((TERMINATION_GRACE_SECONDS - 5) as u64));
    // The root cause of a failure, where `kubectl describe` and `trainctl job status` read it.
    flags.push(RunFlag::TerminationLog(TERMINATION_LOG.into()));
    flags.extend(j.hang_timeout.map(RunFlag::HangTimeout));
    // Said only when not trainctl run's own defaults.
    if j.stragglers != Stragglers::default() {
        flags.push(RunFlag::Stragglers(j.stragglers));
    }
    if j.health_check != HealthCheck::default() {
        flags.push(RunFlag::HealthCheck(j.health_check));
    }
    flags.extend(j.fetch.iter().cloned().map(RunFlag::Fetch));
    if !j.fetch.is_empty() {
        // Writable for the pod's user whatever the image (an emptyDir); the workers start there.
        flags.push(RunFlag::FetchDir(FETCH_DIR.into()));
    }
    let target = match &j.command {
        Some(program) => Target::Program(program.clone()),
        None => Target::Train(train_args(project)),
    };
    RunArgs { flags, target }
}

/// A training pod running [`worker_run_args`] in `container`, sized for training, with the
/// rendezvous and metrics ports and the job token.
pub(crate) fn worker_template(
    project: &Project,
    container: &'static str,
    subdomain: Option<String>,
) -> PodTemplateSpec {
    let j = &project.job;
    let args = worker_run_args(project).to_argv();
    pod_template(
        project,
        PodOptions {
            component: "worker",
            container,
            image: project.image.clone(),
            args,
            runs_trainctl: true,
            training_size: true,
            accelerators: true,
            user_program: j.command.is_some(),
            port: Some(j.rdzv_port),
            metrics_port: j.metrics_port,
            token_secret: Some(token_secret_name(project)),
            subdomain,
            service_account: true,
        },
    )
}

/// The training job's Kueue label, when a queue is set (on the Job or PyTorchJob itself, where
/// Kueue looks for it).
pub(crate) fn queue_label(project: &Project, meta: &mut ObjectMeta) {
    if let Some(queue) = &project.job.queue {
        meta.labels
            .get_or_insert_with(BTreeMap::new)
            .insert(QUEUE_LABEL.into(), queue.clone());
    }
}

/// What `job scale` reads from a training job that can change its size: its node bounds and
/// whether it runs the user's program; with a queue, Kueue's opt-in to elastic jobs (without
/// it Kueue would suspend and requeue a job whose size changed: a restart).
pub(crate) fn sizing_annotations(project: &Project, meta: &mut ObjectMeta) {
    let j = &project.job;
    let annotations = meta.annotations.get_or_insert_with(BTreeMap::new);
    annotations.insert(
        NNODES_ANNOTATION.into(),
        format!("{}:{}", j.min_nodes, j.max_nodes),
    );
    let trainer = if j.command.is_some() {
        "program"
    } else {
        "built-in"
    };
    annotations.insert(TRAINER_ANNOTATION.into(), trainer.into());
    if j.spares > 0 {
        annotations.insert(SPARES_ANNOTATION.into(), j.spares.to_string());
    }
    if j.queue.is_some() && j.is_elastic() {
        annotations.insert(KUEUE_ELASTIC_ANNOTATION.into(), "true".into());
    }
}
