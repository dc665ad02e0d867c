//! `--launcher pytorchjob`: Kubeflow's `PyTorchJob` (`kubeflow.org/v1`, Training Operator v1,
//! maintenance-only upstream). Worker replicas only, every one running `trainctl run`. With
//! MIN < MAX the operator's elasticPolicy injects the `PET_*` variables that `trainctl run`
//! reads (PET_NNODES=MIN:MAX, PET_RDZV_ENDPOINT=NAME-worker-0:PORT, PET_RDZV_BACKEND,
//! PET_MAX_RESTARTS, PET_NPROC_PER_NODE); otherwise the flags say it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::api::{ApiResource, DynamicObject};
use serde::{Deserialize, Serialize};

use contract::argv::RunFlag;

use crate::config::{Launcher, Project, RdzvBackend};
use crate::manifests::{CONTAINER, ETCD_PORT, Manifest, etcd_name, object_meta};
use crate::status::JobStatus;

use super::Kind;
use super::training::{
    Token, launch_flags, queue_label, rdzv_flags, rendezvous_objects, sizing_annotations,
    worker_template,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PyTorchJobSpec {
    pub nproc_per_node: String,
    pub run_policy: RunPolicy,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub elastic_policy: Option<ElasticPolicy>,
    pub pytorch_replica_specs: BTreeMap<String, ReplicaSpec>,
}

/// Kubeflow's common run policy (PyTorchJob v1 and MPIJob v2beta1 share it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RunPolicy {
    pub clean_pod_policy: String,
    pub ttl_seconds_after_finished: i32,
    pub backoff_limit: i32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ElasticPolicy {
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub rdzv_backend: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdzv_host: Option<String>,
    pub rdzv_port: u16,
    pub max_restarts: u32,
}

/// A Kubeflow replica type's pods (PyTorchJob v1 and MPIJob v2beta1 share it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ReplicaSpec {
    pub replicas: u32,
    pub restart_policy: String,
    pub template: PodTemplateSpec,
}

custom_resource!(
    PyTorchJobObject,
    PyTorchJobSpec,
    "kubeflow.org",
    "v1",
    "PyTorchJob",
    "pytorchjobs"
);

/// The replica type of the job's pods.
const WORKER: &str = "Worker";

pub struct PyTorchJob;

impl Kind for PyTorchJob {
    fn launcher(&self) -> Launcher {
        Launcher::PyTorchJob
    }

    fn resources(&self) -> Vec<ApiResource> {
        vec![ApiResource::erase::<PyTorchJobObject>(&())]
    }

    fn render(&self, project: &Project, token: Token) -> Vec<Manifest> {
        let j = &project.job;
        let template = worker_template(project, CONTAINER, None);
        let elastic_policy = j.is_elastic().then(|| {
            let etcd = j.rdzv_backend == RdzvBackend::Etcd;
            ElasticPolicy {
                min_replicas: j.min_nodes,
                max_replicas: j.max_nodes,
                rdzv_backend: j.rdzv_backend.backend().name().into(),
                rdzv_host: etcd.then(|| etcd_name(project)),
                rdzv_port: if etcd { ETCD_PORT } else { j.rdzv_port },
                max_restarts: j.max_restarts,
            }
        });
        let mut metadata = object_meta(project, &j.name, "worker");
        queue_label(project, &mut metadata);
        sizing_annotations(project, &mut metadata);
        let job = PyTorchJobObject {
            metadata,
            spec: PyTorchJobSpec {
                nproc_per_node: j.nproc_per_node.to_string(),
                run_policy: RunPolicy {
                    clean_pod_policy: "None".into(),
                    ttl_seconds_after_finished: j.ttl_seconds,
                    backoff_limit: (j.max_restarts as i32).saturating_mul(j.max_nodes as i32),
                },
                elastic_policy,
                pytorch_replica_specs: BTreeMap::from([(
                    WORKER.into(),
                    ReplicaSpec {
                        replicas: j.max_nodes,
                        // Signals (128+) are retried; trainctl's own failures (1, 2) are final.
                        restart_policy: "ExitCode".into(),
                        template,
                    },
                )]),
            },
        };
        let mut out = rendezvous_objects(project, token);
        out.push(Manifest::of(&job));
        out
    }

    fn rdzv_host(&self, project: &Project) -> String {
        // The operator gives each replica a Service named NAME-worker-INDEX.
        format!("{}-worker-0", project.job.name)
    }

    fn node_flags(&self, project: &Project) -> Vec<RunFlag> {
        let j = &project.job;
        if !j.is_elastic() {
            let mut flags = vec![RunFlag::RdzvId(j.name.clone())];
            flags.extend(launch_flags(project));
            flags.push(RunFlag::MaxRestarts(j.max_restarts));
            return flags;
        }
        // The elasticPolicy's PET_* variables say the nodes and the c10d endpoint.
        let mut flags = vec![RunFlag::RdzvId(j.name.clone())];
        if j.rdzv_backend == RdzvBackend::Etcd {
            // The operator's PET_RDZV_ENDPOINT names the same etcd; the flags say it
            // whatever the operator's version does with rdzvHost.
            flags.extend(rdzv_flags(project));
        }
        flags
    }

    fn status(&self, object: &DynamicObject) -> JobStatus {
        JobStatus::from_conditions(
            object,
            "PyTorchJob",
            "Succeeded",
            Launcher::PyTorchJob.operator(),
        )
    }

    fn pod_job_label(&self) -> &'static str {
        "training.kubeflow.org/job-name"
    }

    fn scales(&self) -> Result<(), &'static str> {
        // The operator reconciles the Worker replicas to the spec (what its elasticPolicy's
        // HPA patches): it deletes the pods past the count and creates the missing ones.
        Ok(())
    }

    fn size(&self, object: &DynamicObject) -> Option<u32> {
        let job: PyTorchJobObject = object.clone().try_parse().ok()?;
        Some(job.spec.pytorch_replica_specs.get(WORKER)?.replicas)
    }

    /// A JSON merge patch of the replicas alone (the unit test in `launchers` reads it back
    /// through [`Kind::size`], typed).
    fn size_patch(&self, nodes: u32) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "spec": { "pytorchReplicaSpecs": { (WORKER): { "replicas": nodes } } }
        }))
    }
}
