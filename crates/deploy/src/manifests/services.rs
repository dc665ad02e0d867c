//! What runs beside a job: its etcd and TensorBoard (Deployments and Services) and the NVIDIA
//! device plugin.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, Deployment, DeploymentSpec, DeploymentStrategy,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, HTTPGetAction, HostPathVolumeSource, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::config::{EtcdStorage, Project};

use super::pod::{claim_volume, cluster_ip_service, empty_dir, pod_security, restricted};
use super::{ETCD_PORT, MANAGED_BY, Manifest, TENSORBOARD_PORT, labels, meta, quantity};

pub fn etcd_name(project: &Project) -> String {
    format!("{}-etcd", project.job.name)
}

/// The job's etcd for `--rdzv-backend etcd`, as the torchelastic examples deploy one: a single
/// member behind a ClusterIP Service, on whatever node has room (not a training node's GPUs).
/// Its data is in an emptyDir, or in `.etcd/NAME` on the claim (`job.etcd_storage = claim`),
/// where a replacement pod finds the job's state again.
pub fn etcd(project: &Project) -> Vec<Manifest> {
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
        Manifest::of(&cluster_ip_service(
            project, &name, component, "client", ETCD_PORT,
        )),
        Manifest::of(&deployment(project, &name, component, spec)),
    ]
}

pub fn tensorboard_name(project: &Project) -> String {
    format!("{}-tensorboard", project.job.name)
}

/// `trainctl tensorboard`: TensorBoard over the claim's runs folder (mounted read-only), and a
/// ClusterIP Service in front of it (`kubectl port-forward service/NAME 6006`).
pub fn tensorboard(project: &Project) -> Vec<Manifest> {
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
        Manifest::of(&cluster_ip_service(
            project,
            &name,
            component,
            "http",
            TENSORBOARD_PORT,
        )),
        Manifest::of(&deployment(project, &name, component, spec)),
    ]
}

pub(super) fn http_probe(path: &str, port: u16) -> Probe {
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

pub(super) fn small_resources(cpu: &str, memory: &str, memory_limit: &str) -> ResourceRequirements {
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
pub(super) fn deployment(
    project: &Project,
    name: &str,
    component: &str,
    spec: PodSpec,
) -> Deployment {
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

/// NVIDIA's device plugin DaemonSet (its static manifest, nvidia-device-plugin.yml): makes
/// `nvidia.com/gpu` schedulable on GPU nodes.
pub fn nvidia_device_plugin() -> Manifest {
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
    Manifest::of(&ds)
}
