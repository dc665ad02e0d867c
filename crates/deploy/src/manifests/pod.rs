//! What every pod and Job trainctl renders shares: the pod template (image, command, volumes,
//! security, accelerators), the Job around it and its failure policy, and the Services in front
//! of pods.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext, Service, ServicePort,
    ServiceSpec, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::config::Project;

use super::{
    BINARY, BINARY_DIR, COMPONENT_LABEL, CONTAINER, EFA_RESOURCE, HELPER_SIZE, INSTALL_CONTAINER,
    METRICS_PORT_NAME, RDZV_PORT_NAME, RUN_AS, TERMINATION_GRACE_SECONDS, labels, meta, quantity,
};

/// What differs between the pods trainctl runs.
pub(crate) struct PodOptions {
    pub(crate) component: &'static str,
    /// The container's name: [`CONTAINER`] for the training pods (the PyTorchJob operator and
    /// the podFailurePolicy look for it), what the container does for the others.
    pub(crate) container: &'static str,
    /// trainctl's arguments, or with `runs_trainctl` false the command line itself.
    pub(crate) args: Vec<String>,
    /// The container runs trainctl (copied in by an init container when the image lacks it),
    /// or `args` as they are (an MPIJob's mpirun and sshd).
    pub(crate) runs_trainctl: bool,
    /// The image the container runs.
    pub(crate) image: String,
    /// CPU and memory of a training pod, or a small request for helper jobs.
    pub(crate) training_size: bool,
    /// Runs on the training nodes: the GPU taint's toleration on GPU instances, and the GPUs
    /// and EFA adapters a training pod takes ([`Project::accelerators`]) with NCCL's variables
    /// (training pods, and the doctor's, which checks that they are seen).
    pub(crate) accelerators: bool,
    /// Runs the user's program: the image's own working directory and a writable root file
    /// system (a program may write beside itself), HOME in /tmp.
    pub(crate) user_program: bool,
    pub(crate) port: Option<u16>,
    /// Training pods: the port `trainctl run --metrics-port` serves, announced to Prometheus
    /// by the usual `prometheus.io/*` pod annotations.
    pub(crate) metrics_port: Option<u16>,
    pub(crate) token_secret: Option<String>,
    /// Indexed Job pods: the headless Service that gives them DNS names.
    pub(crate) subdomain: Option<String>,
    /// Runs under the project's service account (IRSA: the pods that reach S3).
    pub(crate) service_account: bool,
}

pub(crate) fn pod_template(project: &Project, o: PodOptions) -> PodTemplateSpec {
    let job = &project.job;
    let (gpus, adapters) = if o.accelerators {
        project.accelerators()
    } else {
        (0, 0)
    };
    let resources = container_resources(project, &o, gpus, adapters);
    let env = container_env(project, &o, adapters);
    let (mut volumes, mut mounts) = volumes_and_mounts(project, &o);
    // An image without trainctl gets it from an init container, through an emptyDir.
    let copy_binary = o.runs_trainctl && o.image != project.trainctl_image;
    let (init_containers, binary) = if copy_binary {
        let (install, binary) = install_binary(project, &mut volumes, &mut mounts);
        (Some(vec![install]), binary)
    } else {
        (None, BINARY.into())
    };
    let (command, args) = command_line(o.runs_trainctl, binary, o.args);
    let container = Container {
        name: o.container.into(),
        image: Some(o.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(command),
        args: Some(args),
        env: Some(env),
        ports: container_ports(o.port, o.metrics_port),
        resources: Some(resources),
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
    // GPU nodes are tainted: pods sent there tolerate it, GPUs requested or not (the built-in
    // trainer's pods request none).
    let tolerations =
        (o.accelerators && project.cluster.instance_type.gpus > 0).then(|| vec![gpu_toleration()]);
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels(&job.name, o.component)),
            annotations: o.metrics_port.map(prometheus_annotations),
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

/// The container's requests and limits: a training pod's CPU and memory (or a helper's small
/// share), and the `gpus` GPUs and `adapters` EFA adapters it takes.
fn container_resources(
    project: &Project,
    o: &PodOptions,
    gpus: u32,
    adapters: u32,
) -> ResourceRequirements {
    let job = &project.job;
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
    // GPU training pods on EFA nodes take all of the node's adapters (the EFA device plugin,
    // which eksctl installs with an EFA node group, schedules them).
    if adapters > 0 {
        let adapters = quantity(&adapters.to_string());
        requests.insert(EFA_RESOURCE.into(), adapters.clone());
        limits.insert(EFA_RESOURCE.into(), adapters);
    }
    ResourceRequirements {
        requests: Some(requests),
        limits: Some(limits),
        ..ResourceRequirements::default()
    }
}

/// The container's environment: the log level, HOME for a user's program, NCCL pointed at
/// the EFA adapters when it has some, and the job's token from its secret.
fn container_env(project: &Project, o: &PodOptions, adapters: u32) -> Vec<EnvVar> {
    let plain = |name: &str, value: &str| EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    };
    let mut env = vec![plain("RUST_LOG", "warn")];
    if o.user_program && o.runs_trainctl {
        // The pods run as uid 1000, which the user's image may not know: its home is /. (An
        // MPIJob's image knows it: ssh finds its keys in that user's home.)
        env.push(plain("HOME", "/tmp"));
    }
    if adapters > 0 {
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
    env
}

/// The pod's volumes and the container's mounts of them: the shared claim, /tmp, and a
/// training pod's /dev/shm in memory.
fn volumes_and_mounts(project: &Project, o: &PodOptions) -> (Vec<Volume>, Vec<VolumeMount>) {
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
                size_limit: Some(quantity(&project.job.shm_size)),
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev/shm".into(),
            ..VolumeMount::default()
        });
    }
    (volumes, mounts)
}

/// The init container that copies trainctl into an emptyDir the main container mounts
/// read-only (added to `volumes` and `mounts`), and the path the binary has there.
fn install_binary(
    project: &Project,
    volumes: &mut Vec<Volume>,
    mounts: &mut Vec<VolumeMount>,
) -> (Container, String) {
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
    let install = Container {
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
    };
    (install, format!("{BINARY_DIR}/{BINARY}"))
}

/// The container's command and arguments: trainctl (at `binary`) with `args`, or, when it does
/// not run trainctl, `args`' first word as the command and the rest as its arguments.
fn command_line(
    runs_trainctl: bool,
    binary: String,
    mut args: Vec<String>,
) -> (Vec<String>, Vec<String>) {
    if runs_trainctl {
        (vec![binary], args)
    } else {
        let command = if args.is_empty() {
            Vec::new()
        } else {
            vec![args.remove(0)]
        };
        (command, args)
    }
}

/// The rendezvous port (when the pod serves one) and the metrics port beside it.
fn container_ports(port: Option<u16>, metrics_port: Option<u16>) -> Option<Vec<ContainerPort>> {
    port.map(|p| {
        let mut ports = vec![ContainerPort {
            name: Some(RDZV_PORT_NAME.into()),
            container_port: p.into(),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }];
        ports.extend(metrics_port.map(|m| ContainerPort {
            name: Some(METRICS_PORT_NAME.into()),
            container_port: m.into(),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }));
        ports
    })
}

/// The usual `prometheus.io/*` annotations that announce the metrics served on `port`.
fn prometheus_annotations(port: u16) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("prometheus.io/scrape".to_string(), "true".to_string()),
        ("prometheus.io/port".to_string(), port.to_string()),
        ("prometheus.io/path".to_string(), "/metrics".to_string()),
    ])
}

/// The shared claim as volume `name`.
pub(super) fn claim_volume(project: &Project, name: &str, read_only: bool) -> Volume {
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
pub(super) fn empty_dir(name: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// Every trainctl pod runs as the image's `trainctl` user (1000), never root.
pub(super) fn pod_security() -> PodSecurityContext {
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
pub(super) fn restricted(read_only_root: bool) -> SecurityContext {
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

/// GPU nodes are tainted `nvidia.com/gpu` (see `eksctl`): only pods that tolerate it land there.
pub(super) fn gpu_toleration() -> Toleration {
    Toleration {
        key: Some("nvidia.com/gpu".into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Toleration::default()
    }
}

/// A Job of `completions` pods; `indexed` gives each pod a stable name `NAME-INDEX` (the
/// training job's, even of one pod: the rendezvous endpoint names pod 0).
pub(crate) fn job(
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
    let container = template
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map_or(CONTAINER, |c| c.name.as_str())
        .to_string();
    Job {
        metadata: meta(project, name, &component),
        spec: Some(JobSpec {
            completion_mode: indexed.then(|| "Indexed".to_string()),
            completions: Some(completions),
            parallelism: Some(completions),
            backoff_limit: Some(backoff_limit),
            ttl_seconds_after_finished: Some(project.job.ttl_seconds),
            pod_failure_policy: Some(failure_policy(&container)),
            template,
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// Evictions, preemptions and pods of lost nodes (the DisruptionTarget condition, which the
/// eviction API, the scheduler, the taint manager and the pod garbage collector set), and
/// trainctl's own exit after a SIGTERM (143: a deleted pod's node left the job, or the job
/// checkpointed) are replaced without counting; trainctl's permanent exit codes end the job at
/// once; anything else (a crash, an OOM kill, a pod killed at the end of its grace) counts
/// against backoffLimit (and the training job's backoffLimitPerIndex). The first rule that
/// matches decides, so a disruption is ignored whatever its exit code. The exit codes are
/// those of `container`, the pod's trainctl.
pub(super) fn failure_policy(container: &str) -> PodFailurePolicy {
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
                    container_name: Some(container.into()),
                    operator: "In".into(),
                    values: vec![contract::exit::PREEMPTED],
                }),
                ..PodFailurePolicyRule::default()
            },
            PodFailurePolicyRule {
                action: "FailJob".into(),
                on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                    container_name: Some(container.into()),
                    operator: "In".into(),
                    values: contract::exit::PERMANENT.to_vec(),
                }),
                ..PodFailurePolicyRule::default()
            },
        ],
    }
}

pub(crate) fn headless_service(
    project: &Project,
    name: &str,
    component: &str,
    port: u16,
) -> Service {
    let mut service = cluster_ip_service(project, name, component, RDZV_PORT_NAME, port);
    if let Some(spec) = service.spec.as_mut() {
        spec.cluster_ip = Some("None".into());
        // Pods get DNS names as soon as they have addresses, before they are ready:
        // the rendezvous host must be resolvable while the others wait for it.
        spec.publish_not_ready_addresses = Some(true);
    }
    service
}

/// A Service in front of the job's pods of `component` (or a helper's), on one TCP port.
pub(super) fn cluster_ip_service(
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
