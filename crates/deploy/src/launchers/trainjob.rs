//! `--launcher trainjob`: Kubeflow Trainer v2's `TrainJob` (`trainer.kubeflow.org/v1alpha1`),
//! elastic through trainctl's rendezvous, which Trainer itself no longer is (it removed
//! `ElasticPolicy` in v2.2; its torch runtime passes a static PET_NNODES).
//!
//! The job brings its own runtime: a namespaced `TrainingRuntime` named after it, whose JobSet
//! runs the same pods as `--launcher indexed` (one Indexed Job "node" of MAX pods running
//! `trainctl run`, its podFailurePolicy and per-index backoff, its TTL), and a `TrainJob` that
//! references it. Why not the cluster's `torch-distributed` runtime with the command
//! overridden: a TrainJob may patch only a few pod fields of a runtime (volumes, service
//! account, node selector, tolerations; no init container, no ports, no failure policy, no
//! TTL), so pods of an image without trainctl could not get it, evictions would count as
//! failures and finished jobs would stay forever. A namespaced runtime needs no cluster-wide
//! rights (a `ClusterTrainingRuntime` would), and goes with its job.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::JobTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ApiResource, DynamicObject};
use serde::{Deserialize, Serialize};

use crate::config::{Launcher, Project};
use crate::manifests::{Manifest, job, object_meta};
use crate::status::JobStatus;

use super::Kind;
use super::training::{Token, queue_label, rendezvous_objects, worker_template};

/// The replicated job, and its container, that Trainer treats as the trainer's.
const NODE: &str = "node";
/// The label by which Trainer finds the trainer's replicated job in a runtime.
const ANCESTOR_LABEL: (&str, &str) = ("trainer.kubeflow.org/trainjob-ancestor-step", "trainer");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct TrainJobSpec {
    pub runtime_ref: RuntimeRef,
    pub trainer: Trainer,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RuntimeRef {
    pub name: String,
    pub api_group: String,
    pub kind: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Trainer {
    pub num_nodes: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct TrainingRuntimeSpec {
    pub ml_policy: MlPolicy,
    pub template: JobSetTemplate,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct MlPolicy {
    pub num_nodes: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct JobSetTemplate {
    pub spec: JobSetSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct JobSetSpec {
    pub network: Network,
    pub replicated_jobs: Vec<ReplicatedJob>,
    pub ttl_seconds_after_finished: i32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Network {
    #[serde(rename = "enableDNSHostnames")]
    pub enable_dns_hostnames: bool,
    pub publish_not_ready_addresses: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ReplicatedJob {
    pub name: String,
    pub replicas: u32,
    pub template: JobTemplateSpec,
}

custom_resource!(
    TrainJobObject,
    TrainJobSpec,
    "trainer.kubeflow.org",
    "v1alpha1",
    "TrainJob",
    "trainjobs"
);

custom_resource!(
    TrainingRuntime,
    TrainingRuntimeSpec,
    "trainer.kubeflow.org",
    "v1alpha1",
    "TrainingRuntime",
    "trainingruntimes"
);

pub struct TrainJob;

impl Kind for TrainJob {
    fn launcher(&self) -> Launcher {
        Launcher::TrainJob
    }

    fn resources(&self) -> Vec<ApiResource> {
        vec![
            ApiResource::erase::<TrainJobObject>(&()),
            ApiResource::erase::<TrainingRuntime>(&()),
        ]
    }

    fn render(&self, project: &Project, token: Token) -> Vec<Manifest> {
        let j = &project.job;
        let template = worker_template(project, NODE, Some(j.name.clone()));
        let pods = j.max_nodes as i32;
        let backoff = (j.max_restarts as i32).saturating_mul(pods).max(1);
        // The same Job as --launcher indexed: a lost pod is replaced under its index.
        let node = job(project, &j.name, template, (pods, true), backoff);
        let mut node_spec = node.spec.unwrap_or_default();
        node_spec.backoff_limit_per_index = Some(j.max_restarts as i32);
        node_spec.max_failed_indexes = Some(0);
        // JobSet sets its own TTL; the pods' subdomain is the JobSet's headless Service.
        node_spec.ttl_seconds_after_finished = None;
        if let Some(pod) = node_spec.template.spec.as_mut() {
            pod.subdomain = None;
        }
        let runtime = TrainingRuntime {
            metadata: object_meta(project, &j.name, "worker"),
            spec: TrainingRuntimeSpec {
                ml_policy: MlPolicy {
                    num_nodes: j.max_nodes,
                },
                template: JobSetTemplate {
                    spec: JobSetSpec {
                        // Pods get DNS names before they are ready: the rendezvous host must
                        // resolve while the others wait for it.
                        network: Network {
                            enable_dns_hostnames: true,
                            publish_not_ready_addresses: true,
                        },
                        replicated_jobs: vec![ReplicatedJob {
                            name: NODE.into(),
                            replicas: 1,
                            template: JobTemplateSpec {
                                metadata: Some(ObjectMeta {
                                    labels: Some(BTreeMap::from([(
                                        ANCESTOR_LABEL.0.into(),
                                        ANCESTOR_LABEL.1.into(),
                                    )])),
                                    ..ObjectMeta::default()
                                }),
                                spec: Some(node_spec),
                            },
                        }],
                        ttl_seconds_after_finished: j.ttl_seconds,
                    },
                },
            },
        };
        let mut metadata = object_meta(project, &j.name, "worker");
        queue_label(project, &mut metadata);
        let train_job = TrainJobObject {
            metadata,
            spec: TrainJobSpec {
                runtime_ref: RuntimeRef {
                    name: j.name.clone(),
                    api_group: "trainer.kubeflow.org".into(),
                    kind: "TrainingRuntime".into(),
                },
                trainer: Trainer {
                    num_nodes: j.max_nodes,
                },
            },
        };
        let mut out = rendezvous_objects(project, token);
        out.push(Manifest::of(&runtime));
        out.push(Manifest::of(&train_job));
        out
    }

    fn rdzv_host(&self, project: &Project) -> String {
        // JobSet names pod 0 NAME-node-0-0, in its headless Service's subdomain NAME.
        let name = &project.job.name;
        format!("{name}-{NODE}-0-0.{name}")
    }

    fn runs_a_job(&self) -> bool {
        true
    }

    fn status(&self, object: &DynamicObject) -> JobStatus {
        JobStatus::from_conditions(
            object,
            "TrainJob",
            "Complete",
            Launcher::TrainJob.operator(),
        )
    }

    fn pod_job_label(&self) -> &'static str {
        "jobset.sigs.k8s.io/jobset-name"
    }

    fn scales(&self) -> Result<(), &'static str> {
        Err(
            "Trainer v2 applies a TrainJob's changes (numNodes too) to its JobSet only while \
             the TrainJob is suspended, and a suspended job's pods are deleted: a new size is a \
             restart of every pod from the checkpoint, not a regroup (Trainer v2.2 removed the \
             elastic policy); launch with --launcher indexed to scale in place",
        )
    }
}
