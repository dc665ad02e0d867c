//! The Kubernetes objects trainctl renders: storage, the data job, the training job (Indexed
//! Job or Kubeflow PyTorchJob, running the built-in trainer or the user's program, with an etcd
//! beside it for `--rdzv-backend etcd`), the test job, the doctor job, TensorBoard and the
//! NVIDIA device plugin.
//!
//! Core objects are built from `k8s-openapi` types, so their shape is the API's. Every object
//! carries the labels in [`labels`], which is how `job status|logs|top|delete` find them again.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, Deployment, DeploymentSpec, DeploymentStrategy,
};
use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Capabilities, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, HostPathVolumeSource, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource,
    PersistentVolumeSpec, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SeccompProfile, Secret, SecretKeySelector, SecurityContext, Service,
    ServicePort, ServiceSpec, Toleration, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde_json::Value;

use crate::config::{EtcdStorage, Launcher, Project, RdzvBackend, StorageBackend};

/// `app.kubernetes.io/managed-by: trainctl` on everything trainctl creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "trainctl");
/// The job an object belongs to.
pub const JOB_LABEL: &str = "trainctl.dev/job";
/// The extended resource of EFA adapters (aws-efa-k8s-device-plugin).
pub const EFA_RESOURCE: &str = "vpc.amazonaws.com/efa";
/// The label by which Kueue admits a job through a LocalQueue (all its pods together or none).
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// What the object is in the job: `worker`, `data`, `test`, `doctor`, `etcd` or `tensorboard`.
pub const COMPONENT_LABEL: &str = "trainctl.dev/component";
/// The container that runs trainctl in every pod (the operator's default name for PyTorchJob).
pub const CONTAINER: &str = "pytorch";
/// Name of the rendezvous port; the training operator finds the port by this name.
pub const RDZV_PORT_NAME: &str = "pytorchjob-port";
/// The container port `trainctl run --metrics-port` serves on.
pub const METRICS_PORT_NAME: &str = "metrics";
/// Where the binary is in the image (see the Dockerfile).
pub const BINARY: &str = "trainctl";
/// Where the init container of a training pod whose image lacks trainctl puts the binary (an
/// emptyDir shared with the training container).
pub const BINARY_DIR: &str = "/opt/trainctl";
/// Where training pods put the code `job.fetch` copies from S3 (under the /tmp emptyDir).
pub const FETCH_DIR: &str = "/tmp/code";
/// The init container that copies trainctl into [`BINARY_DIR`].
pub const INSTALL_CONTAINER: &str = "install-trainctl";
/// etcd's client port (`--rdzv-backend etcd`).
pub const ETCD_PORT: u16 = 2379;
/// TensorBoard's port.
pub const TENSORBOARD_PORT: u16 = 6006;
/// The user the pods run as (the image's `trainctl` user).
pub const RUN_AS: i64 = 1000;
/// Exit codes that no retry can fix: `trainctl`'s own (the job failed past its restarts (1),
/// the command line is wrong (2)) and the shell's for a program that cannot run at all (126: not
/// executable; 127: not found, or the binary's loader lacks a library). The job fails at once,
/// instead of retrying to its backoff limit.
pub const PERMANENT_EXIT_CODES: [i32; 4] = [1, 2, 126, 127];
/// `trainctl run`'s exit code when SIGTERM stopped it (an eviction, a spot interruption, a
/// deleted job) and its workers checkpointed the step they were in: 128 + SIGTERM, equal to
/// `collective::EXIT_PREEMPTED` (a test keeps them equal). Retried without counting.
pub const PREEMPTED_EXIT_CODE: i32 = 128 + 15;
/// What a helper pod (data, test, doctor) requests: CPU, memory.
pub const HELPER_SIZE: (&str, &str) = ("500m", "1Gi");
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
    /// The image the container runs.
    image: String,
    /// CPU and memory of a training pod, or a small request for helper jobs.
    training_size: bool,
    /// The node's GPUs and EFA adapters, the GPU taint's toleration and NCCL's variables
    /// (training pods, and the doctor's, which checks that they are seen).
    accelerators: bool,
    /// Runs the user's program: the image's own working directory and a writable root file
    /// system (a program may write beside itself), HOME in /tmp.
    user_program: bool,
    port: Option<u16>,
    /// Training pods: the port `trainctl run --metrics-port` serves, announced to Prometheus
    /// by the usual `prometheus.io/*` pod annotations.
    metrics_port: Option<u16>,
    token_secret: Option<String>,
    /// Indexed Job pods: the headless Service that gives them DNS names.
    subdomain: Option<String>,
    /// Runs under the project's service account (IRSA: the pods that reach S3).
    service_account: bool,
}

fn pod_template(project: &Project, o: PodOptions) -> PodTemplateSpec {
    let job = &project.job;
    let gpus = if o.accelerators { job.gpus_per_node } else { 0 };
    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if o.training_size {
        requests.insert("cpu".into(), quantity(&job.cpu));
        requests.insert("memory".into(), quantity(&job.memory));
        // Memory is limited (the node's memory is not shared well past its size); CPU is not
        // (a limit throttles the all-reduce and the data loader for no gain).
        limits.insert("memory".into(), quantity(&job.memory));
    } else {
        requests.insert("cpu".into(), quantity(HELPER_SIZE.0));
        requests.insert("memory".into(), quantity(HELPER_SIZE.1));
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
    if o.user_program {
        // The pods run as uid 1000, which the user's image may not know: its home is /.
        env.push(plain("HOME", "/tmp"));
    }
    // GPU training pods on EFA nodes take all of the node's adapters (the EFA device plugin,
    // which eksctl installs with an EFA node group, schedules them) and point NCCL at them.
    let adapters = if o.accelerators {
        accelerators(project).1
    } else {
        0
    };
    if adapters > 0 {
        let adapters = quantity(&adapters.to_string());
        requests.insert(EFA_RESOURCE.into(), adapters.clone());
        limits.insert(EFA_RESOURCE.into(), adapters);
        env.push(plain("FI_PROVIDER", "efa"));
        if project.cluster.instance_type.gpudirect_rdma() {
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
    let mut volumes = vec![claim_volume(project, "data", false), empty_dir("tmp")];
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
    // An image without trainctl gets it from an init container, through an emptyDir.
    let copy_binary = o.image != project.trainctl_image;
    let mut init_containers = None;
    let binary = if copy_binary {
        volumes.push(empty_dir("trainctl"));
        let mount = VolumeMount {
            name: "trainctl".into(),
            mount_path: BINARY_DIR.into(),
            ..VolumeMount::default()
        };
        mounts.push(VolumeMount {
            read_only: Some(true),
            ..mount.clone()
        });
        init_containers = Some(vec![Container {
            name: INSTALL_CONTAINER.into(),
            image: Some(project.trainctl_image.clone()),
            image_pull_policy: Some("IfNotPresent".into()),
            command: Some(vec![BINARY.into()]),
            args: Some(vec!["install".into(), BINARY_DIR.into()]),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".into(), quantity("100m")),
                    ("memory".into(), quantity("64Mi")),
                ])),
                limits: Some(BTreeMap::from([("memory".into(), quantity("256Mi"))])),
                ..ResourceRequirements::default()
            }),
            volume_mounts: Some(vec![mount]),
            security_context: Some(restricted(true)),
            ..Container::default()
        }]);
        format!("{BINARY_DIR}/{BINARY}")
    } else {
        BINARY.into()
    };
    let container = Container {
        name: CONTAINER.into(),
        image: Some(o.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![binary]),
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
        // A container that fails without writing its termination message leaves its last log
        // lines there instead: `job status` and `job wait` show why without `kubectl logs`.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        working_dir: (!o.user_program).then(|| "/tmp".into()),
        security_context: Some(restricted(!o.user_program)),
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
            init_containers,
            containers: vec![container],
            restart_policy: Some("Never".into()),
            subdomain: o.subdomain,
            node_selector: if o.training_size { node_selector } else { None },
            tolerations,
            volumes: Some(volumes),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            enable_service_links: Some(false),
            security_context: Some(pod_security()),
            service_account_name: if o.service_account {
                project.service_account.clone()
            } else {
                None
            },
            ..PodSpec::default()
        }),
    }
}

/// The shared claim as volume `name`.
fn claim_volume(project: &Project, name: &str, read_only: bool) -> Volume {
    Volume {
        name: name.into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: project.storage.claim.clone(),
            read_only: Some(read_only),
        }),
        ..Volume::default()
    }
}

/// A node-disk emptyDir as volume `name`.
fn empty_dir(name: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// Every trainctl pod runs as the image's `trainctl` user (1000), never root.
fn pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS),
        run_as_group: Some(RUN_AS),
        fs_group: Some(RUN_AS),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// No privileges, no capabilities; the root file system read-only unless the container runs
/// a program trainctl does not know.
fn restricted(read_only_root: bool) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(read_only_root),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

/// The GPUs and EFA adapters a training pod takes: the job's GPUs per node and, on GPU nodes
/// with EFA, every adapter of the instance.
fn accelerators(project: &Project) -> (u32, u32) {
    let gpus = project.job.gpus_per_node;
    let instance = project.cluster.instance_type;
    let adapters = if gpus > 0 && instance.supports_efa() {
        instance.efa_interfaces
    } else {
        0
    };
    (gpus, adapters)
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

/// A Job of `completions` pods; `indexed` gives each pod a stable name `NAME-INDEX` (the
/// training job's, even of one pod: the rendezvous endpoint names pod 0).
fn job(
    project: &Project,
    name: &str,
    template: PodTemplateSpec,
    (completions, indexed): (i32, bool),
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
            completion_mode: indexed.then(|| "Indexed".to_string()),
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
    let mut service = cluster_ip_service(project, name, component, RDZV_PORT_NAME, port);
    if let Some(spec) = service.spec.as_mut() {
        spec.cluster_ip = Some("None".into());
        // Pods get DNS names as soon as they have addresses, before they are ready:
        // the rendezvous host must be resolvable while the others wait for it.
        spec.publish_not_ready_addresses = Some(true);
    }
    service
}

// ---------------------------------------------------------------------------------------------
// Jobs

/// `data job`: downloads and verifies the data set onto the claim (a no-op when it is there),
/// copies it from S3 (`data.from`: files already there are skipped), or, with
/// `synthetic: Some(n)`, writes a small generated set of `n` training images in the same
/// layout (to try a cluster out without the download).
pub fn data_job(project: &Project, synthetic: Option<u32>) -> Value {
    let args = match (synthetic, &project.data.from) {
        (None, Some(from)) => vec![
            "data".into(),
            "stage".into(),
            from.clone(),
            project.data.dir.clone(),
        ],
        (None, None) => {
            let mut args = vec!["data".into(), "fetch".into()];
            if project.data.dataset != "cifar10" {
                args.extend(["--dataset".into(), project.data.dataset.clone()]);
            }
            args.extend([
                "--data".into(),
                project.data.dir.clone(),
                "--download-url".into(),
                project.data.url.clone(),
                "--download-md5".into(),
                project.data.md5.clone(),
            ]);
            args
        }
        (Some(n), _) => vec![
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
            image: project.trainctl_image.clone(),
            args,
            training_size: false,
            accelerators: false,
            user_program: false,
            port: None,
            metrics_port: None,
            token_secret: None,
            subdomain: None,
            service_account: true,
        },
    );
    object(&job(
        project,
        &format!("{}-data", project.job.name),
        template,
        (1, false),
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
            image: project.trainctl_image.clone(),
            args,
            training_size: false,
            accelerators: false,
            user_program: false,
            port: None,
            metrics_port: None,
            token_secret: None,
            subdomain: None,
            service_account: true,
        },
    );
    object(&job(
        project,
        &format!("{}-test", project.job.name),
        template,
        (1, false),
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
    let mut args = vec!["train".to_string()];
    if j.model != "seed-cnn" {
        args.extend(["--model".into(), j.model.clone()]);
    }
    args.extend([
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
    ]);
    if let Some(upload) = &j.upload {
        args.extend(["--upload".into(), upload.clone()]);
    }
    args
}

/// The training job: a Secret with the job token, the job's etcd (its Service and Deployment)
/// with `--rdzv-backend etcd`, then an Indexed Job and its headless Service, or a PyTorchJob.
pub fn training_job(project: &Project, token: &str) -> Vec<Value> {
    let mut out = vec![token_secret(project, token)];
    if project.job.rdzv_backend == RdzvBackend::Etcd {
        out.extend(etcd(project));
    }
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

/// The rendezvous backend's name and endpoint: the store on pod 0 (c10d), or the job's etcd.
fn rdzv_endpoint(project: &Project) -> (&'static str, String) {
    match project.job.rdzv_backend {
        RdzvBackend::C10d => (
            "c10d",
            format!("{}:{}", rdzv_host(project), project.job.rdzv_port),
        ),
        RdzvBackend::Etcd => ("etcd", format!("{}:{ETCD_PORT}", etcd_name(project))),
    }
}

fn rdzv_flags(project: &Project) -> [String; 4] {
    let (backend, endpoint) = rdzv_endpoint(project);
    [
        "--rdzv-backend".into(),
        backend.into(),
        "--rdzv-endpoint".into(),
        endpoint,
    ]
}

/// `trainctl run`'s flags for the job's nodes and rendezvous.
fn launch_flags(project: &Project) -> Vec<String> {
    let j = &project.job;
    let mut flags = vec![
        "--nnodes".into(),
        j.nnodes(),
        "--nproc-per-node".into(),
        j.nproc_per_node.to_string(),
    ];
    flags.extend(rdzv_flags(project));
    flags
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

/// A training pod of either launcher: `trainctl run LAUNCH_ARGS train ...` (or `-- PROGRAM
/// ARGS...`: the user's program, with torchrun's environment), sized for training, with the
/// rendezvous and metrics ports and the job token.
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
    for uri in &j.fetch {
        args.extend(["--fetch".into(), uri.clone()]);
    }
    if !j.fetch.is_empty() {
        // Writable for the pod's user whatever the image (an emptyDir); the workers start there.
        args.extend(["--fetch-dir".into(), FETCH_DIR.into()]);
    }
    match &j.command {
        Some(program) => {
            args.push("--".into());
            args.extend(program.iter().cloned());
        }
        None => args.extend(train_args(project)),
    }
    pod_template(
        project,
        PodOptions {
            component: "worker",
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

fn indexed_job(project: &Project) -> (Service, Job) {
    let j = &project.job;
    let mut args = vec!["run".to_string()];
    args.extend(launch_flags(project));
    args.extend(["--rdzv-id".into(), j.name.clone()]);
    args.extend(max_restarts_flag(project));
    args.extend(metrics_flag(project));
    let template = worker_template(project, args, Some(j.name.clone()));
    let service = headless_service(project, &j.name, "worker", j.rdzv_port);
    let pods = j.max_nodes as i32;
    // A lost pod is replaced under the same index and rejoins; each node may be lost
    // max_restarts times before Kubernetes gives up on the job.
    let backoff = (j.max_restarts as i32).saturating_mul(pods).max(1);
    let mut job = job(project, &j.name, template, (pods, true), backoff);
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
        args.extend(launch_flags(project));
        args.extend(max_restarts_flag(project));
    } else if j.rdzv_backend == RdzvBackend::Etcd {
        // The operator's PET_RDZV_ENDPOINT names the same etcd; the flags say it whatever the
        // operator's version does with rdzvHost.
        args.extend(rdzv_flags(project));
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
        if j.rdzv_backend == RdzvBackend::Etcd {
            spec["elasticPolicy"]["rdzvBackend"] = "etcd".into();
            spec["elasticPolicy"]["rdzvHost"] = etcd_name(project).into();
            spec["elasticPolicy"]["rdzvPort"] = ETCD_PORT.into();
        }
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

// ---------------------------------------------------------------------------------------------
// Deployments: the job's etcd, TensorBoard

pub fn etcd_name(project: &Project) -> String {
    format!("{}-etcd", project.job.name)
}

/// The job's etcd for `--rdzv-backend etcd`, as the torchelastic examples deploy one: a single
/// member behind a ClusterIP Service, on whatever node has room (not a training node's GPUs).
/// Its data is in an emptyDir, or in `.etcd/NAME` on the claim (`job.etcd_storage = claim`),
/// where a replacement pod finds the job's state again.
pub fn etcd(project: &Project) -> Vec<Value> {
    let name = etcd_name(project);
    let component = "etcd";
    let mount = "/var/lib/etcd";
    let (volume, data_dir) = match project.job.etcd_storage {
        EtcdStorage::EmptyDir => (empty_dir("etcd"), format!("{mount}/data")),
        EtcdStorage::Claim => (
            claim_volume(project, "etcd", false),
            format!("{mount}/.etcd/{name}"),
        ),
    };
    let args = vec![
        "--name".into(),
        name.clone(),
        "--data-dir".into(),
        data_dir,
        "--listen-client-urls".into(),
        format!("http://0.0.0.0:{ETCD_PORT}"),
        "--advertise-client-urls".into(),
        format!("http://{name}:{ETCD_PORT}"),
        "--listen-peer-urls".into(),
        "http://127.0.0.1:2380".into(),
        "--initial-advertise-peer-urls".into(),
        "http://127.0.0.1:2380".into(),
        "--initial-cluster".into(),
        format!("{name}=http://127.0.0.1:2380"),
        "--initial-cluster-state".into(),
        "new".into(),
    ];
    let container = Container {
        name: "etcd".into(),
        image: Some(project.job.etcd_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["etcd".into()]),
        args: Some(args),
        ports: Some(vec![ContainerPort {
            name: Some("client".into()),
            container_port: ETCD_PORT.into(),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(http_probe("/health", ETCD_PORT)),
        resources: Some(small_resources("100m", "256Mi", "512Mi")),
        volume_mounts: Some(vec![VolumeMount {
            name: "etcd".into(),
            mount_path: mount.into(),
            ..VolumeMount::default()
        }]),
        security_context: Some(restricted(true)),
        ..Container::default()
    };
    let spec = PodSpec {
        containers: vec![container],
        volumes: Some(vec![volume]),
        enable_service_links: Some(false),
        security_context: Some(pod_security()),
        ..PodSpec::default()
    };
    vec![
        object(&cluster_ip_service(
            project, &name, component, "client", ETCD_PORT,
        )),
        object(&deployment(project, &name, component, spec)),
    ]
}

pub fn tensorboard_name(project: &Project) -> String {
    format!("{}-tensorboard", project.job.name)
}

/// `trainctl tensorboard`: TensorBoard over the claim's runs folder (mounted read-only), and a
/// ClusterIP Service in front of it (`kubectl port-forward service/NAME 6006`).
pub fn tensorboard(project: &Project) -> Vec<Value> {
    let name = tensorboard_name(project);
    let component = "tensorboard";
    let container = Container {
        name: "tensorboard".into(),
        image: Some(project.tensorboard_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["tensorboard".into()]),
        args: Some(vec![
            "--logdir".into(),
            project.job.runs_dir.clone(),
            "--bind_all".into(),
            "--port".into(),
            TENSORBOARD_PORT.to_string(),
        ]),
        env: Some(vec![EnvVar {
            name: "HOME".into(),
            value: Some("/tmp".into()),
            ..EnvVar::default()
        }]),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: TENSORBOARD_PORT.into(),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(http_probe("/", TENSORBOARD_PORT)),
        resources: Some(small_resources("250m", "1Gi", "4Gi")),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "data".into(),
                mount_path: project.storage.mount_path.clone(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "tmp".into(),
                mount_path: "/tmp".into(),
                ..VolumeMount::default()
            },
        ]),
        working_dir: Some("/tmp".into()),
        security_context: Some(restricted(true)),
        ..Container::default()
    };
    let spec = PodSpec {
        containers: vec![container],
        volumes: Some(vec![claim_volume(project, "data", true), empty_dir("tmp")]),
        enable_service_links: Some(false),
        security_context: Some(pod_security()),
        ..PodSpec::default()
    };
    vec![
        object(&cluster_ip_service(
            project,
            &name,
            component,
            "http",
            TENSORBOARD_PORT,
        )),
        object(&deployment(project, &name, component, spec)),
    ]
}

fn http_probe(path: &str, port: u16) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(port.into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(5),
        ..Probe::default()
    }
}

fn small_resources(cpu: &str, memory: &str, memory_limit: &str) -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".into(), quantity(cpu)),
            ("memory".into(), quantity(memory)),
        ])),
        limits: Some(BTreeMap::from([("memory".into(), quantity(memory_limit))])),
        ..ResourceRequirements::default()
    }
}

/// One replica of `spec`, replaced (never two at once: etcd's data, one port-forward target).
fn deployment(project: &Project, name: &str, component: &str, spec: PodSpec) -> Deployment {
    let labels = labels(&project.job.name, component);
    Deployment {
        metadata: meta(project, name, component),
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".into()),
                ..DeploymentStrategy::default()
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(spec),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

fn cluster_ip_service(
    project: &Project,
    name: &str,
    component: &str,
    port_name: &str,
    port: u16,
) -> Service {
    Service {
        metadata: meta(project, name, component),
        spec: Some(ServiceSpec {
            selector: Some(labels(&project.job.name, component)),
            ports: Some(vec![ServicePort {
                name: Some(port_name.into()),
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
    let mut args = vec![
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
    let (gpus, adapters) = accelerators(project);
    if gpus > 0 {
        args.extend(["--expect-gpus".into(), gpus.to_string()]);
    }
    if adapters > 0 {
        args.extend(["--expect-efa".into(), adapters.to_string()]);
    }
    let template = pod_template(
        project,
        PodOptions {
            component: "doctor",
            image: project.trainctl_image.clone(),
            args,
            training_size: false,
            accelerators: true,
            user_program: false,
            port: Some(j.rdzv_port),
            metrics_port: None,
            token_secret: None,
            subdomain: Some(name.clone()),
            service_account: false,
        },
    );
    let mut template = template;
    // The doctor checks the nodes the training will use (its pods take their GPUs and EFA
    // adapters, so it sees what a training pod sees), GPU nodes' taint included.
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
        // Indexed whatever the count: the peers are named NAME-INDEX.NAME.
        object(&job(project, &name, template, (pods as i32, true), 0)),
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
