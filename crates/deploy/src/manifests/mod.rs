//! The Kubernetes objects trainctl renders: storage, the data job, the test job, the doctor job,
//! TensorBoard, the job's etcd and the NVIDIA device plugin, and the pod pieces
//! ([`pod_template`], [`job`]) that [`crate::launchers`] builds the training job from.
//!
//! Core objects are built from `k8s-openapi` types, so their shape is the API's. Every object
//! carries the labels in [`labels`], which is how `job status|logs|top|delete` find them again.

mod helpers;
mod pod;
mod services;
mod storage;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};
use kube::api::ApiResource;
use serde::Serialize;
use serde_json::Value;

use crate::config::Project;

pub use helpers::{data_job, doctor_job, doctor_job_name, test_job};
pub use services::{etcd, etcd_name, nvidia_device_plugin, tensorboard, tensorboard_name};
pub use storage::{NoStorage, storage};
// What the launchers (crate::launchers) build their jobs from.
pub(crate) use pod::{PodOptions, headless_service, job, pod_template};

/// `app.kubernetes.io/managed-by: trainctl` on everything trainctl creates.
pub(crate) const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "trainctl");
/// The job an object belongs to.
pub(crate) const JOB_LABEL: &str = "trainctl.dev/job";
/// The extended resource of EFA adapters (aws-efa-k8s-device-plugin).
pub const EFA_RESOURCE: &str = "vpc.amazonaws.com/efa";
/// The label by which Kueue admits a job through a LocalQueue (all its pods together or none).
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// On a training job's object: its node bounds `MIN:MAX` (`--nnodes`), which `job scale`
/// keeps to.
pub(crate) const NNODES_ANNOTATION: &str = "trainctl.dev/nnodes";
/// The pods a training job keeps beyond its `--nnodes` MAX as spares (`job.spares`), when any.
pub(crate) const SPARES_ANNOTATION: &str = "trainctl.dev/spares";
/// On a training job's object: `program` when its pods run the user's program, `built-in`
/// for trainctl's trainer (`job scale` says which regroups in place).
pub(crate) const TRAINER_ANNOTATION: &str = "trainctl.dev/trainer";
/// Kueue's opt-in to elastic jobs (workload slices): a queued job may change its size.
pub(crate) const KUEUE_ELASTIC_ANNOTATION: &str = "kueue.x-k8s.io/elastic-job";
/// What the object is in the job: `worker`, `data`, `test`, `doctor`, `etcd` or `tensorboard`.
pub(crate) const COMPONENT_LABEL: &str = "trainctl.dev/component";
/// The container that runs `trainctl run` in the training pods of an Indexed Job or a
/// PyTorchJob: the name the PyTorchJob operator looks for, which the podFailurePolicy names
/// too (a TrainJob's is `node`, Trainer's name). The helper jobs' containers are named after
/// what they do (`data`, `test`, `doctor`).
pub(crate) const CONTAINER: &str = "pytorch";
/// Name of the rendezvous port; the training operator finds the port by this name.
pub(crate) const RDZV_PORT_NAME: &str = "pytorchjob-port";
/// The container port `trainctl run --metrics-port` serves on.
pub(crate) const METRICS_PORT_NAME: &str = "metrics";
/// Where the binary is in the image (see the Dockerfile).
pub const BINARY: &str = "trainctl";
/// Where the init container of a training pod whose image lacks trainctl puts the binary (an
/// emptyDir shared with the training container).
pub const BINARY_DIR: &str = "/opt/trainctl";
/// Where training pods put the code `job.fetch` copies from S3 (under the /tmp emptyDir).
pub(crate) const FETCH_DIR: &str = "/tmp/code";
/// The init container that copies trainctl into [`BINARY_DIR`].
pub const INSTALL_CONTAINER: &str = "install-trainctl";
/// etcd's client port (`--rdzv-backend etcd`).
pub const ETCD_PORT: u16 = contract::ports::ETCD;
/// TensorBoard's port.
pub const TENSORBOARD_PORT: u16 = 6006;
/// The user the pods run as (the image's `trainctl` user).
pub(crate) const RUN_AS: i64 = 1000;
/// What a helper pod (data, test, doctor) requests: CPU, memory.
pub const HELPER_SIZE: (&str, &str) = ("500m", "1Gi");
/// How long a training pod has between SIGTERM and SIGKILL: the step in progress and a
/// checkpoint must fit in it.
pub(crate) const TERMINATION_GRACE_SECONDS: i64 = 30;
/// Where a container's termination message is read from (Kubernetes' default
/// `terminationMessagePath`): `trainctl run` writes a failure's root cause there.
pub(crate) const TERMINATION_LOG: &str = "/dev/termination-log";

/// Labels of one component of job `job`.
pub fn labels(job: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY.0.into(), MANAGED_BY.1.into()),
        ("app.kubernetes.io/name".into(), "trainctl".into()),
        (JOB_LABEL.into(), job.into()),
        (COMPONENT_LABEL.into(), component.into()),
    ])
}

/// The label selector of everything of job `job` (all components).
pub(crate) fn job_selector(job: &str) -> String {
    format!("{JOB_LABEL}={job},{}={}", MANAGED_BY.0, MANAGED_BY.1)
}

/// The selector of one component of job `job`.
pub fn component_selector(job: &str, component: &str) -> String {
    format!("{},{COMPONENT_LABEL}={component}", job_selector(job))
}

/// The metadata of object `name` of the project's job: its namespace and labels.
pub(crate) fn object_meta(project: &Project, name: &str, component: &str) -> ObjectMeta {
    meta(project, name, component)
}

pub(crate) fn meta(project: &Project, name: &str, component: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(project.namespace.clone()),
        labels: Some(labels(&project.job.name, component)),
        ..ObjectMeta::default()
    }
}

fn to_value(object: &impl Serialize) -> Value {
    // k8s-openapi types serialise infallibly (strings, numbers, maps).
    serde_json::to_value(object).expect("k8s-openapi objects serialise")
}

/// One rendered object and the API resource it is served at: the kind travels with the object
/// (kube-rs's `ApiResource`), so applying or deleting it needs no table of kinds. It reads as
/// its JSON document (`Deref<Target = Value>`) and serialises as exactly that document.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    resource: ApiResource,
    namespaced: bool,
    doc: Value,
}

/// Whether a k8s-openapi scope is a namespace's (the scope types are markers without a value).
pub trait Scope {
    const NAMESPACED: bool;
}

impl Scope for NamespaceResourceScope {
    const NAMESPACED: bool = true;
}

impl Scope for ClusterResourceScope {
    const NAMESPACED: bool = false;
}

impl Manifest {
    /// A typed object from k8s-openapi, with its apiVersion and kind written into the document.
    pub fn of<K>(k: &K) -> Manifest
    where
        K: kube::Resource<DynamicType = ()> + Serialize,
        <K as kube::Resource>::Scope: Scope,
    {
        let resource = ApiResource::erase::<K>(&());
        let mut doc = to_value(k);
        doc["apiVersion"] = Value::String(resource.api_version.clone());
        doc["kind"] = Value::String(resource.kind.clone());
        Manifest {
            resource,
            namespaced: <K as kube::Resource>::Scope::NAMESPACED,
            doc,
        }
    }

    pub fn resource(&self) -> &ApiResource {
        &self.resource
    }

    pub fn namespaced(&self) -> bool {
        self.namespaced
    }

    pub fn kind(&self) -> &str {
        &self.resource.kind
    }

    pub fn name(&self) -> &str {
        self.doc["metadata"]["name"].as_str().unwrap_or_default()
    }
}

impl std::ops::Deref for Manifest {
    type Target = Value;
    fn deref(&self) -> &Value {
        &self.doc
    }
}

impl std::ops::DerefMut for Manifest {
    fn deref_mut(&mut self) -> &mut Value {
        &mut self.doc
    }
}

impl std::fmt::Display for Manifest {
    /// The document as JSON.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.doc.fmt(f)
    }
}

impl From<Manifest> for Value {
    fn from(m: Manifest) -> Value {
        m.doc
    }
}

impl Serialize for Manifest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.doc.serialize(s)
    }
}

fn quantity(s: &str) -> Quantity {
    Quantity(s.to_string())
}

/// Documents as one YAML stream (`---` between them).
pub fn to_yaml<D: Serialize>(docs: &[D]) -> String {
    docs.iter()
        .map(|d| serde_saphyr::to_string(d).expect("JSON values serialise to YAML"))
        .collect::<Vec<_>>()
        .join("---\n")
}
