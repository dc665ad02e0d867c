//! The Kubernetes objects trainctl renders: storage, the data job, the training job (Indexed
//! Job or Kubeflow PyTorchJob), the test job, the doctor job and the NVIDIA device plugin.
//!
//! Core objects are built from `k8s-openapi` types, so their shape is the API's. Every object
//! carries the labels in [`labels`], which is how `job status|logs|top|delete` find them again.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Capabilities, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HostPathVolumeSource, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PersistentVolumeSpec,
    PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements, SeccompProfile, Secret,
    SecretKeySelector, SecurityContext, Service, ServicePort, ServiceSpec, Toleration, Volume,
    VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde_json::Value;

use crate::config::{Launcher, Project, StorageBackend};

/// `app.kubernetes.io/managed-by: trainctl` on everything trainctl creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "trainctl");
/// The job an object belongs to.
pub const JOB_LABEL: &str = "trainctl.dev/job";
/// The extended resource of EFA adapters (aws-efa-k8s-device-plugin).
pub const EFA_RESOURCE: &str = "vpc.amazonaws.com/efa";
/// The label by which Kueue admits a job through a LocalQueue (all its pods together or none).
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// What the object is in the job: `worker`, `data`, `test` or `doctor`.
pub const COMPONENT_LABEL: &str = "trainctl.dev/component";
/// The container that runs trainctl in every pod (the operator's default name for PyTorchJob).
pub const CONTAINER: &str = "pytorch";
/// Name of the rendezvous port; the training operator finds the port by this name.
pub const RDZV_PORT_NAME: &str = "pytorchjob-port";
/// The container port `trainctl run --metrics-port` serves on.
pub const METRICS_PORT_NAME: &str = "metrics";
/// Where the binary is in the image (see the Dockerfile).
pub const BINARY: &str = "trainctl";
/// The user the pods run as (the image's `trainctl` user).
pub const RUN_AS: i64 = 1000;
/// Exit codes of `trainctl` that no retry can fix: the job failed past its restarts (1) or the
/// command line is wrong (2).
pub const PERMANENT_EXIT_CODES: [i32; 2] = [1, 2];
/// `trainctl run`'s exit code when SIGTERM stopped it (an eviction, a spot interruption, a
/// deleted job) and its workers checkpointed the step they were in: 128 + SIGTERM, equal to
/// `collective::EXIT_PREEMPTED` (a test keeps them equal). Retried without counting.
pub const PREEMPTED_EXIT_CODE: i32 = 128 + 15;
/// How long a training pod has between SIGTERM and SIGKILL: the step in progress and a
/// checkpoint must fit in it.
pub const TERMINATION_GRACE_SECONDS: i64 = 30;

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
pub fn job_selector(job: &str) -> String {
    format!("{JOB_LABEL}={job},{}={}", MANAGED_BY.0, MANAGED_BY.1)
}

/// The selector of one component of job `job`.
pub fn component_selector(job: &str, component: &str) -> String {
    format!("{},{COMPONENT_LABEL}={component}", job_selector(job))
}

fn meta(project: &Project, name: &str, component: &str) -> ObjectMeta {
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

/// A Kubernetes object from k8s-openapi, with its apiVersion and kind.
fn object<K: k8s_openapi::Resource + Serialize>(k: &K) -> Value {
    let mut v = to_value(k);
    v["apiVersion"] = Value::String(K::API_VERSION.into());
    v["kind"] = Value::String(K::KIND.into());
    v
}

fn quantity(s: &str) -> Quantity {
    Quantity(s.to_string())
}

// ---------------------------------------------------------------------------------------------
// Storage

/// What `storage` renders: a StorageClass, a PersistentVolume and a ReadWriteMany claim.
#[derive(Debug, thiserror::Error)]
#[error(
    "no shared storage is configured; give --efs FS_ID, --fsx FS_ID,DNS,MOUNT or, on a one-node development cluster, --host-path DIR"
)]
pub struct NoStorage;

pub fn storage(project: &Project) -> Result<Vec<Value>, NoStorage> {
    let s = &project.storage;
    let backend = s.backend.as_ref().ok_or(NoStorage)?;
    let class = format!("{}-{}", s.claim, backend_name(backend));
    let (provisioner, source, mount_options, host_path) = match backend {
        StorageBackend::Efs { file_system_id } => (
            "efs.csi.aws.com",
            Some(CSIPersistentVolumeSource {
                driver: "efs.csi.aws.com".into(),
                volume_handle: file_system_id.clone(),
                ..CSIPersistentVolumeSource::default()
            }),
            None,
            None,
        ),
        StorageBackend::Fsx {
            file_system_id,
            dns_name,
            mount_name,
        } => (
            "fsx.csi.aws.com",
            Some(CSIPersistentVolumeSource {
                driver: "fsx.csi.aws.com".into(),
                volume_handle: file_system_id.clone(),
                volume_attributes: Some(BTreeMap::from([
                    ("dnsname".into(), dns_name.clone()),
                    ("mountname".into(), mount_name.clone()),
                ])),
                ..CSIPersistentVolumeSource::default()
            }),
            Some(vec!["flock".to_string()]),
            None,
        ),
        StorageBackend::HostPath { path } => (
            "kubernetes.io/no-provisioner",
            None,
            None,
            Some(HostPathVolumeSource {
                path: path.clone(),
                type_: Some("DirectoryOrCreate".into()),
            }),
        ),
    };
    let component = "storage";
    let class_object = StorageClass {
        metadata: ObjectMeta {
            namespace: None,
            ..meta(project, &class, component)
        },
        provisioner: provisioner.into(),
        reclaim_policy: Some("Retain".into()),
        volume_binding_mode: Some("Immediate".into()),
        mount_options: mount_options.clone(),
        ..StorageClass::default()
    };
    let volume = PersistentVolume {
        metadata: ObjectMeta {
            namespace: None,
            ..meta(project, &s.claim, component)
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".into(), quantity(&s.size))])),
            access_modes: Some(vec!["ReadWriteMany".into()]),
            volume_mode: Some("Filesystem".into()),
            persistent_volume_reclaim_policy: Some("Retain".into()),
            storage_class_name: Some(class.clone()),
            mount_options,
            csi: source,
            host_path,
            ..PersistentVolumeSpec::default()
        }),
        ..PersistentVolume::default()
    };
    let claim = PersistentVolumeClaim {
        metadata: meta(project, &s.claim, component),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteMany".into()]),
            storage_class_name: Some(class),
            volume_name: Some(s.claim.clone()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".into(), quantity(&s.size))])),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    };
    Ok(vec![object(&class_object), object(&volume), object(&claim)])
}

fn backend_name(b: &StorageBackend) -> &'static str {
    match b {
        StorageBackend::Efs { .. } => "efs",
        StorageBackend::Fsx { .. } => "fsx",
        StorageBackend::HostPath { .. } => "hostpath",
    }
}

// ---------------------------------------------------------------------------------------------
// Pods

/// What differs between the pods trainctl runs.
struct PodOptions {
    component: &'static str,
    args: Vec<String>,
    /// GPU, CPU and memory of a training pod, or a small request for helper jobs.
    training_size: bool,
    port: Option<u16>,
    /// Training pods: the port `trainctl run --metrics-port` serves, announced to Prometheus
    /// by the usual `prometheus.io/*` pod annotations.
    metrics_port: Option<u16>,
    token_secret: Option<String>,
    /// Indexed Job pods: the headless Service that gives them DNS names.
    subdomain: Option<String>,
}

fn pod_template(project: &Project, o: PodOptions) -> PodTemplateSpec {
    let job = &project.job;
    let gpus = if o.training_size {
        job.gpus_per_node
    } else {
        0
    };
    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if o.training_size {
        requests.insert("cpu".into(), quantity(&job.cpu));
        requests.insert("memory".into(), quantity(&job.memory));
        // Memory is limited (the node's memory is not shared well past its size); CPU is not
        // (a limit throttles the all-reduce and the data loader for no gain).
        limits.insert("memory".into(), quantity(&job.memory));
    } else {
        requests.insert("cpu".into(), quantity("500m"));
        requests.insert("memory".into(), quantity("1Gi"));
        limits.insert("memory".into(), quantity("2Gi"));
    }
    if gpus > 0 {
        requests.insert("nvidia.com/gpu".into(), quantity(&gpus.to_string()));
        limits.insert("nvidia.com/gpu".into(), quantity(&gpus.to_string()));
    }
    let plain = |name: &str, value: &str| EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    };
    let mut env = vec![plain("RUST_LOG", "warn")];
    // GPU training pods on EFA nodes take all of the node's adapters (the EFA device plugin,
    // which eksctl installs with an EFA node group, schedules them) and point NCCL at them.
    let instance = project.cluster.instance_type;
    if gpus > 0 && instance.supports_efa() {
        let adapters = quantity(&instance.efa_interfaces.to_string());
        requests.insert(EFA_RESOURCE.into(), adapters.clone());
        limits.insert(EFA_RESOURCE.into(), adapters);
        env.push(plain("FI_PROVIDER", "efa"));
        if instance.gpudirect_rdma() {
            env.push(plain("FI_EFA_USE_DEVICE_RDMA", "1"));
        }
    }
    if let Some(secret) = &o.token_secret {
        env.push(EnvVar {
            name: "TRAINCTL_JOB_TOKEN".into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: secret.clone(),
                    key: "token".into(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        });
    }
    let mut volumes = vec![
        Volume {
            name: "data".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: project.storage.claim.clone(),
                read_only: Some(false),
            }),
            ..Volume::default()
        },
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
    ];
    let mut mounts = vec![
        VolumeMount {
            name: "data".into(),
            mount_path: project.storage.mount_path.clone(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..VolumeMount::default()
        },
    ];
    if o.training_size {
        volumes.push(Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(quantity(&job.shm_size)),
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev/shm".into(),
            ..VolumeMount::default()
        });
    }
    let container = Container {
        name: CONTAINER.into(),
        image: Some(project.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![BINARY.into()]),
        args: Some(o.args),
        env: Some(env),
        ports: o.port.map(|p| {
            let mut ports = vec![ContainerPort {
                name: Some(RDZV_PORT_NAME.into()),
                container_port: p.into(),
                protocol: Some("TCP".into()),
                ..ContainerPort::default()
            }];
            ports.extend(o.metrics_port.map(|m| ContainerPort {
                name: Some(METRICS_PORT_NAME.into()),
                container_port: m.into(),
                protocol: Some("TCP".into()),
                ..ContainerPort::default()
            }));
            ports
        }),
        resources: Some(ResourceRequirements {
            requests: Some(requests),
            limits: Some(limits),
            ..ResourceRequirements::default()
        }),
        volume_mounts: Some(mounts),
        working_dir: Some("/tmp".into()),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    let node_selector = project
        .job
        .node_selector
        .as_ref()
        .map(|(k, v)| BTreeMap::from([(k.clone(), v.clone())]));
    let tolerations = (gpus > 0).then(|| vec![gpu_toleration()]);
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels(&job.name, o.component)),
            annotations: o.metrics_port.map(|p| {
                BTreeMap::from([
                    ("prometheus.io/scrape".to_string(), "true".to_string()),
                    ("prometheus.io/port".to_string(), p.to_string()),
                    ("prometheus.io/path".to_string(), "/metrics".to_string()),
                ])
            }),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".into()),
            subdomain: o.subdomain,
            node_selector: if o.training_size { node_selector } else { None },
            tolerations,
            volumes: Some(volumes),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            enable_service_links: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(RUN_AS),
                run_as_group: Some(RUN_AS),
                fs_group: Some(RUN_AS),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            ..PodSpec::default()
        }),
    }
}

/// GPU nodes are tainted `nvidia.com/gpu` (see `eksctl`): only pods that tolerate it land there.
fn gpu_toleration() -> Toleration {
    Toleration {
        key: Some("nvidia.com/gpu".into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Toleration::default()
    }
}

/// A Job of `completions` pods (Indexed when more than one).
fn job(
    project: &Project,
    name: &str,
    template: PodTemplateSpec,
    completions: i32,
    backoff_limit: i32,
) -> Job {
    let component = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref())
        .and_then(|l| l.get(COMPONENT_LABEL))
        .cloned()
        .unwrap_or_default();
    Job {
        metadata: meta(project, name, &component),
        spec: Some(JobSpec {
            completion_mode: (completions > 1).then(|| "Indexed".to_string()),
            completions: Some(completions),
            parallelism: Some(completions),
            backoff_limit: Some(backoff_limit),
            ttl_seconds_after_finished: Some(project.job.ttl_seconds),
            pod_failure_policy: Some(failure_policy()),
            template,
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// Evictions and preemptions (the DisruptionTarget condition, or trainctl's own exit after a
/// SIGTERM and a checkpoint) are retried without counting; trainctl's permanent exit codes end
/// the job at once; anything else (a crash, OOM, a lost node) counts against backoffLimit.
fn failure_policy() -> PodFailurePolicy {
    PodFailurePolicy {
        rules: vec![
            PodFailurePolicyRule {
                action: "Ignore".into(),
                on_pod_conditions: Some(vec![PodFailurePolicyOnPodConditionsPattern {
                    type_: "DisruptionTarget".into(),
                    status: "True".into(),
                }]),
                ..PodFailurePolicyRule::default()
            },
            PodFailurePolicyRule {
                action: "Ignore".into(),
                on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                    container_name: Some(CONTAINER.into()),
                    operator: "In".into(),
                    values: vec![PREEMPTED_EXIT_CODE],
                }),
                ..PodFailurePolicyRule::default()
            },
            PodFailurePolicyRule {
                action: "FailJob".into(),
                on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                    container_name: Some(CONTAINER.into()),
                    operator: "In".into(),
                    values: PERMANENT_EXIT_CODES.to_vec(),
                }),
                ..PodFailurePolicyRule::default()
            },
        ],
    }
}

fn headless_service(project: &Project, name: &str, component: &str, port: u16) -> Service {
    Service {
        metadata: meta(project, name, component),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // Pods get DNS names as soon as they have addresses, before they are ready:
            // the rendezvous host must be resolvable while the others wait for it.
            publish_not_ready_addresses: Some(true),
            selector: Some(labels(&project.job.name, component)),
            ports: Some(vec![ServicePort {
                name: Some(RDZV_PORT_NAME.into()),
                port: port.into(),
                target_port: Some(IntOrString::Int(port.into())),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Jobs

/// `data job`: downloads and verifies CIFAR-10 onto the claim (a no-op when it is there), or,
/// with `synthetic: Some(n)`, writes a small generated set of `n` training images in the same
/// layout (to try a cluster out without the download).
pub fn data_job(project: &Project, synthetic: Option<u32>) -> Value {
    let args = match synthetic {
        None => vec![
            "data".into(),
            "fetch".into(),
            "--data".into(),
            project.data.dir.clone(),
            "--download-url".into(),
            project.data.url.clone(),
            "--download-md5".into(),
            project.data.md5.clone(),
        ],
        Some(n) => vec![
            "data".into(),
            "synth".into(),
            "--out".into(),
            project.data.dir.clone(),
            "--train".into(),
            n.to_string(),
            "--test".into(),
            (n / 4).max(10).to_string(),
        ],
    };
    let template = pod_template(
        project,
        PodOptions {
            component: "data",
            args,
            training_size: false,
            port: None,
            metrics_port: None,
            token_secret: None,
            subdomain: None,
        },
    );
    object(&job(
        project,
        &format!("{}-data", project.job.name),
        template,
        1,
        3,
    ))
}

/// `test job`: the seed's test job, `trainctl eval` on the saved model.
pub fn test_job(project: &Project) -> Value {
    let args = vec![
        "eval".into(),
        "--model".into(),
        project.job.model_path(),
        "--data".into(),
        project.data.dir.clone(),
    ];
    let template = pod_template(
        project,
        PodOptions {
            component: "test",
            args,
            training_size: false,
            port: None,
            metrics_port: None,
            token_secret: None,
            subdomain: None,
        },
    );
    object(&job(
        project,
        &format!("{}-test", project.job.name),
        template,
        1,
        1,
    ))
}

/// The Secret holding the job's connection token.
pub fn token_secret(project: &Project, token: &str) -> Value {
    let secret = Secret {
        metadata: meta(project, &token_secret_name(project), "worker"),
        string_data: Some(BTreeMap::from([("token".into(), token.into())])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    object(&secret)
}

pub fn token_secret_name(project: &Project) -> String {
    format!("{}-token", project.job.name)
}

/// The `trainctl train` arguments of the job.
fn train_args(project: &Project) -> Vec<String> {
    let j = &project.job;
    vec![
        "train".into(),
        "--data".into(),
        project.data.dir.clone(),
        "--out".into(),
        j.runs_dir.clone(),
        "--epochs".into(),
        j.epochs.to_string(),
        "--batch-size".into(),
        j.batch_size.to_string(),
        "--lr".into(),
        j.learning_rate.to_string(),
        "--no-download".into(),
    ]
}

/// The training job: a Secret with the job token, then an Indexed Job and its headless Service,
/// or a PyTorchJob.
pub fn training_job(project: &Project, token: &str) -> Vec<Value> {
    let mut out = vec![token_secret(project, token)];
    match project.job.launcher {
        Launcher::Indexed => {
            let (service, job) = indexed_job(project);
            out.push(object(&service));
            out.push(object(&job));
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

/// `trainctl run`'s flags for a c10d rendezvous on pod 0.
fn c10d_flags(project: &Project) -> [String; 8] {
    let j = &project.job;
    [
        "--nnodes".into(),
        j.nnodes(),
        "--nproc-per-node".into(),
        j.nproc_per_node.to_string(),
        "--rdzv-backend".into(),
        "c10d".into(),
        "--rdzv-endpoint".into(),
        format!("{}:{}", rdzv_host(project), j.rdzv_port),
    ]
}

fn metrics_flag(project: &Project) -> Vec<String> {
    match project.job.metrics_port {
        Some(p) => vec!["--metrics-port".into(), p.to_string()],
        None => vec![],
    }
}

fn max_restarts_flag(project: &Project) -> [String; 2] {
    [
        "--max-restarts".into(),
        project.job.max_restarts.to_string(),
    ]
}

/// A training pod of either launcher: `trainctl run LAUNCH_ARGS train ...`, sized for training,
/// with the rendezvous and metrics ports and the job token.
fn worker_template(
    project: &Project,
    launch_args: Vec<String>,
    subdomain: Option<String>,
) -> PodTemplateSpec {
    let j = &project.job;
    let mut args = launch_args;
    // The workers' share of the pod's grace: finish the step, write the checkpoint; the
    // launcher keeps a few seconds to report and exit.
    args.extend([
        "--grace-period".into(),
        (TERMINATION_GRACE_SECONDS - 5).to_string(),
    ]);
    args.extend(train_args(project));
    pod_template(
        project,
        PodOptions {
            component: "worker",
            args,
            training_size: true,
            port: Some(j.rdzv_port),
            metrics_port: j.metrics_port,
            token_secret: Some(token_secret_name(project)),
            subdomain,
        },
    )
}

fn indexed_job(project: &Project) -> (Service, Job) {
    let j = &project.job;
    let mut args = vec!["run".to_string()];
    args.extend(c10d_flags(project));
    args.extend(["--rdzv-id".into(), j.name.clone()]);
    args.extend(max_restarts_flag(project));
    args.extend(metrics_flag(project));
    let template = worker_template(project, args, Some(j.name.clone()));
    let service = headless_service(project, &j.name, "worker", j.rdzv_port);
    let pods = j.max_nodes as i32;
    // A lost pod is replaced under the same index and rejoins; each node may be lost
    // max_restarts times before Kubernetes gives up on the job.
    let backoff = (j.max_restarts as i32).saturating_mul(pods).max(1);
    let mut job = job(project, &j.name, template, pods, backoff);
    queue_label(project, &mut job.metadata);
    (service, job)
}

/// The training job's Kueue label, when a queue is set (on the Job or PyTorchJob itself, where
/// Kueue looks for it).
fn queue_label(project: &Project, meta: &mut ObjectMeta) {
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
fn pytorch_job(project: &Project) -> Value {
    let j = &project.job;
    let mut args = vec!["run".into(), "--rdzv-id".into(), j.name.clone()];
    if !j.is_elastic() {
        args.extend(c10d_flags(project));
        args.extend(max_restarts_flag(project));
    }
    args.extend(metrics_flag(project));
    let template = worker_template(project, args, None);
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
            "rdzvBackend": "c10d",
            "rdzvPort": j.rdzv_port,
            "maxRestarts": j.max_restarts,
        });
    }
    let mut metadata = meta(project, &j.name, "worker");
    queue_label(project, &mut metadata);
    serde_json::json!({
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": to_value(&metadata),
        "spec": spec,
    })
}

pub fn doctor_job_name(project: &Project) -> String {
    format!("{}-doctor", project.job.name)
}

/// `doctor`: one pod per node, each checking DNS, the rendezvous port, every peer and the
/// claim, from inside the cluster (`trainctl doctor check`).
pub fn doctor_job(project: &Project) -> Vec<Value> {
    let j = &project.job;
    let name = doctor_job_name(project);
    let pods = j.max_nodes;
    let peers: Vec<String> = (0..pods).map(|i| format!("{name}-{i}.{name}")).collect();
    let args = vec![
        "doctor".into(),
        "check".into(),
        "--peers".into(),
        peers.join(","),
        "--port".into(),
        j.rdzv_port.to_string(),
        "--claim".into(),
        project.storage.mount_path.clone(),
        "--data".into(),
        project.data.dir.clone(),
    ];
    let template = pod_template(
        project,
        PodOptions {
            component: "doctor",
            args,
            training_size: false,
            port: Some(j.rdzv_port),
            metrics_port: None,
            token_secret: None,
            subdomain: Some(name.clone()),
        },
    );
    let mut template = template;
    // The doctor checks the nodes the training will use, GPU nodes' taint included.
    if let Some(spec) = template.spec.as_mut() {
        if let Some((k, v)) = j.node_selector.as_ref() {
            spec.node_selector = Some(BTreeMap::from([(k.clone(), v.clone())]));
        }
        if project.cluster.instance_type.gpus > 0 {
            spec.tolerations = Some(vec![gpu_toleration()]);
        }
    }
    let service = headless_service(project, &name, "doctor", j.rdzv_port);
    vec![
        object(&service),
        object(&job(project, &name, template, pods as i32, 0)),
    ]
}

/// NVIDIA's device plugin DaemonSet (its static manifest, nvidia-device-plugin.yml): makes
/// `nvidia.com/gpu` schedulable on GPU nodes.
pub fn nvidia_device_plugin() -> Value {
    let name = "nvidia-device-plugin-daemonset";
    let selector = BTreeMap::from([("name".to_string(), "nvidia-device-plugin-ds".to_string())]);
    let ds = DaemonSet {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("kube-system".into()),
            labels: Some(BTreeMap::from([(MANAGED_BY.0.into(), MANAGED_BY.1.into())])),
            ..ObjectMeta::default()
        },
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(selector),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    priority_class_name: Some("system-node-critical".into()),
                    tolerations: Some(vec![Toleration {
                        key: Some("nvidia.com/gpu".into()),
                        operator: Some("Exists".into()),
                        effect: Some("NoSchedule".into()),
                        ..Toleration::default()
                    }]),
                    containers: vec![Container {
                        name: "nvidia-device-plugin-ctr".into(),
                        image: Some("nvcr.io/nvidia/k8s-device-plugin:v0.17.1".into()),
                        env: Some(vec![EnvVar {
                            name: "FAIL_ON_INIT_ERROR".into(),
                            value: Some("false".into()),
                            ..EnvVar::default()
                        }]),
                        security_context: Some(SecurityContext {
                            allow_privilege_escalation: Some(false),
                            capabilities: Some(Capabilities {
                                drop: Some(vec!["ALL".into()]),
                                ..Capabilities::default()
                            }),
                            ..SecurityContext::default()
                        }),
                        volume_mounts: Some(vec![VolumeMount {
                            name: "device-plugin".into(),
                            mount_path: "/var/lib/kubelet/device-plugins".into(),
                            ..VolumeMount::default()
                        }]),
                        ..Container::default()
                    }],
                    volumes: Some(vec![Volume {
                        name: "device-plugin".into(),
                        host_path: Some(HostPathVolumeSource {
                            path: "/var/lib/kubelet/device-plugins".into(),
                            type_: None,
                        }),
                        ..Volume::default()
                    }]),
                    ..PodSpec::default()
                }),
            },
            ..DaemonSetSpec::default()
        }),
        ..DaemonSet::default()
    };
    object(&ds)
}

/// Documents as one YAML stream (`---` between them).
pub fn to_yaml(docs: &[Value]) -> String {
    docs.iter()
        .map(|d| serde_saphyr::to_string(d).expect("JSON values serialise to YAML"))
        .collect::<Vec<_>>()
        .join("---\n")
}
