//! The training job: its token Secret, the pods' typed command line ([`worker_run_args`]), and
//! the Indexed Job or the Kubeflow PyTorchJob that runs them.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PodTemplateSpec, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use contract::argv::{RunArgs, RunFlag, Target, TrainArgs};

use crate::config::{Launcher, Project, RdzvBackend};

use super::pod::{PodOptions, headless_service, job, pod_template};
use super::services::{etcd, etcd_name};
use super::{
    CONTAINER, ETCD_PORT, FETCH_DIR, Manifest, QUEUE_LABEL, TERMINATION_GRACE_SECONDS,
    TERMINATION_LOG, meta, to_value,
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
pub(super) fn train_args(project: &Project) -> TrainArgs {
    let j = &project.job;
    TrainArgs {
        model: j.model.clone(),
        data: project.data.dir.clone(),
        out: j.runs_dir.clone(),
        epochs: j.epochs,
        batch_size: j.batch_size,
        learning_rate: j.learning_rate,
        // The data job puts the data set on the volume first.
        no_download: true,
        upload: j.upload.clone(),
    }
}

/// The training job: a Secret for the job token, the job's etcd (its Service and Deployment)
/// with `--rdzv-backend etcd`, then an Indexed Job and its headless Service, or a PyTorchJob.
pub fn training_job(project: &Project, token: Token) -> Vec<Manifest> {
    let mut out = vec![token_secret(project, token)];
    if project.job.rdzv_backend == RdzvBackend::Etcd {
        out.extend(etcd(project));
    }
    match project.job.launcher {
        Launcher::Indexed => {
            let (service, job) = indexed_job(project);
            out.push(Manifest::of(&service));
            out.push(Manifest::of(&job));
        }
        Launcher::PyTorchJob => out.push(pytorch_job(project)),
    }
    out
}

/// The host of the rendezvous store: pod 0's stable DNS name.
pub fn rdzv_host(project: &Project) -> String {
    let name = &project.job.name;
    match project.job.launcher {
        // Indexed Job pods are NAME-INDEX, in the headless Service's subdomain NAME.
        Launcher::Indexed => format!("{name}-0.{name}"),
        // The operator gives each replica a Service named NAME-worker-INDEX.
        Launcher::PyTorchJob => format!("{name}-worker-0"),
    }
}

/// The rendezvous backend's endpoint: the store on pod 0 (c10d), or the job's etcd.
pub(super) fn rdzv_endpoint(project: &Project) -> String {
    match project.job.rdzv_backend {
        RdzvBackend::C10d => format!("{}:{}", rdzv_host(project), project.job.rdzv_port),
        RdzvBackend::Etcd => format!("{}:{ETCD_PORT}", etcd_name(project)),
    }
}

pub(super) fn rdzv_flags(project: &Project) -> [RunFlag; 2] {
    [
        RunFlag::RdzvBackend(project.job.rdzv_backend.backend()),
        RunFlag::RdzvEndpoint(rdzv_endpoint(project)),
    ]
}

/// `trainctl run`'s flags for the job's nodes and rendezvous.
pub(super) fn launch_flags(project: &Project) -> Vec<RunFlag> {
    let j = &project.job;
    let mut flags = vec![
        RunFlag::Nnodes(j.nnodes()),
        RunFlag::NprocPerNode(j.nproc_per_node),
    ];
    flags.extend(rdzv_flags(project));
    flags
}

pub(super) fn metrics_flag(project: &Project) -> Option<RunFlag> {
    project.job.metrics_port.map(RunFlag::MetricsPort)
}

/// The training pods' command line, for either launcher: `trainctl run FLAGS... train ...`
/// (or `-- PROGRAM ARGS...`: the user's program, with torchrun's environment).
pub fn worker_run_args(project: &Project) -> RunArgs {
    let j = &project.job;
    let mut flags = match j.launcher {
        Launcher::Indexed => {
            let mut flags = launch_flags(project);
            flags.push(RunFlag::RdzvId(j.name.clone()));
            flags.push(RunFlag::MaxRestarts(j.max_restarts));
            flags
        }
        // With MIN < MAX the operator's elasticPolicy injects the PET_* variables that
        // `trainctl run` reads (see `pytorch_job`); otherwise the flags say it.
        Launcher::PyTorchJob => {
            let mut flags = vec![RunFlag::RdzvId(j.name.clone())];
            if !j.is_elastic() {
                flags.extend(launch_flags(project));
                flags.push(RunFlag::MaxRestarts(j.max_restarts));
            } else if j.rdzv_backend == RdzvBackend::Etcd {
                // The operator's PET_RDZV_ENDPOINT names the same etcd; the flags say it
                // whatever the operator's version does with rdzvHost.
                flags.extend(rdzv_flags(project));
            }
            flags
        }
    };
    flags.extend(metrics_flag(project));
    // The workers' share of the pod's grace: finish the step, write the checkpoint; the
    // launcher keeps a few seconds to report and exit.
    flags.push(RunFlag::GracePeriod((TERMINATION_GRACE_SECONDS - 5) as u64));
    // The root cause of a failure, where `kubectl describe` and `trainctl job status` read it.
    flags.push(RunFlag::TerminationLog(TERMINATION_LOG.into()));
    flags.extend(j.hang_timeout.map(RunFlag::HangTimeout));
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

/// A training pod of either launcher, running [`worker_run_args`], sized for training, with
/// the rendezvous and metrics ports and the job token.
pub(super) fn worker_template(project: &Project, subdomain: Option<String>) -> PodTemplateSpec {
    let j = &project.job;
    let args = worker_run_args(project).to_argv();
    pod_template(
        project,
        PodOptions {
            component: "worker",
            container: CONTAINER,
            image: project.image.clone(),
            args,
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

pub(super) fn indexed_job(project: &Project) -> (Service, Job) {
    let j = &project.job;
    let template = worker_template(project, Some(j.name.clone()));
    let service = headless_service(project, &j.name, "worker", j.rdzv_port);
    let pods = j.max_nodes as i32;
    // A lost pod is replaced under the same index and rejoins; each node may fail
    // max_restarts times (failures the podFailurePolicy ignores do not count) before
    // Kubernetes gives up on the job.
    let backoff = (j.max_restarts as i32).saturating_mul(pods).max(1);
    let mut job = job(project, &j.name, template, (pods, true), backoff);
    if let Some(spec) = job.spec.as_mut() {
        // Per index, the Job controller also delays a replacement by the failures of that
        // index alone (10 s doubling, counting the ignored ones), not of the whole job: a
        // node lost after others were waits 10 s, not 10 s × 2^(losses so far). One index past
        // its limit fails the job at once, as the job's limit did. Servers before 1.29 drop
        // both fields and keep backoffLimit, the whole job's limit.
        spec.backoff_limit_per_index = Some(j.max_restarts as i32);
        spec.max_failed_indexes = Some(0);
    }
    queue_label(project, &mut job.metadata);
    (service, job)
}

/// The training job's Kueue label, when a queue is set (on the Job or PyTorchJob itself, where
/// Kueue looks for it).
pub(super) fn queue_label(project: &Project, meta: &mut ObjectMeta) {
    if let Some(queue) = &project.job.queue {
        meta.labels
            .get_or_insert_with(BTreeMap::new)
            .insert(QUEUE_LABEL.into(), queue.clone());
    }
}

/// Kubeflow's `PyTorchJob` (kubeflow.org/v1): Worker replicas only, every one running
/// `trainctl run`. With MIN < MAX the operator's elasticPolicy injects the PET_* variables that
/// `trainctl run` reads (PET_NNODES=MIN:MAX, PET_RDZV_ENDPOINT=NAME-worker-0:PORT,
/// PET_RDZV_BACKEND=c10d, PET_MAX_RESTARTS, PET_NPROC_PER_NODE); otherwise the flags say it.
pub(super) fn pytorch_job(project: &Project) -> Manifest {
    let j = &project.job;
    let template = worker_template(project, None);
    let mut spec = serde_json::json!({
        "nprocPerNode": j.nproc_per_node.to_string(),
        "runPolicy": {
            "cleanPodPolicy": "None",
            "ttlSecondsAfterFinished": j.ttl_seconds,
            "backoffLimit": (j.max_restarts as i64) * (j.max_nodes as i64),
        },
        "pytorchReplicaSpecs": {
            "Worker": {
                "replicas": j.max_nodes,
                // Signals (128+) are retried; trainctl's own failures (1, 2) are final.
                "restartPolicy": "ExitCode",
                "template": to_value(&template),
            },
        },
    });
    if j.is_elastic() {
        spec["elasticPolicy"] = serde_json::json!({
            "minReplicas": j.min_nodes,
            "maxReplicas": j.max_nodes,
            "rdzvBackend": j.rdzv_backend.backend().name(),
            "rdzvPort": j.rdzv_port,
            "maxRestarts": j.max_restarts,
        });
        if j.rdzv_backend == RdzvBackend::Etcd {
            spec["elasticPolicy"]["rdzvHost"] = etcd_name(project).into();
            spec["elasticPolicy"]["rdzvPort"] = ETCD_PORT.into();
        }
    }
    let mut metadata = meta(project, &j.name, "worker");
    queue_label(project, &mut metadata);
    let resource = super::pytorchjob_resource();
    Manifest::pytorch_job(serde_json::json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": to_value(&metadata),
        "spec": spec,
    }))
}
