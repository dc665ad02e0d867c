//! The project configuration: `trainctl.toml`, `TRAINCTL_*` variables and flags, layered.
//!
//! Every setting has a dotted key (`cluster.nodes`), a flag (`--nodes`), a variable
//! (`TRAINCTL_CLUSTER_NODES`: the key upper-cased, dots as underscores) and a place in the file
//! (`[cluster] nodes = 2`). The first layer that has a value wins: flag, then variable, then
//! file, then the preset, then the built-in default. [`Resolved`] keeps where each value came
//! from, for `trainctl config show`, and [`Project`] is the same values checked and typed: bad
//! values are refused here, before anything is rendered.

mod layers;
mod project;
#[cfg(test)]
mod tests;
mod values;

use std::fmt;
use std::path::PathBuf;

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(&'static str),
    Env(String),
    File(PathBuf),
    Preset(&'static str),
    Default,
    /// Computed from other settings.
    Derived(&'static str),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "flag {flag}"),
            Source::Env(var) => write!(f, "environment {var}"),
            Source::File(path) => write!(f, "file {}", path.display()),
            Source::Preset(p) => write!(f, "preset {p}"),
            Source::Default => f.write_str("default"),
            Source::Derived(from) => write!(f, "derived from {from}"),
        }
    }
}

/// One setting: its key, its flag and what it means.
pub struct Setting {
    pub key: &'static str,
    pub flag: &'static str,
    pub help: &'static str,
}

impl Setting {
    /// `TRAINCTL_CLUSTER_NODES` for `cluster.nodes`.
    pub fn env_var(&self) -> String {
        format!(
            "TRAINCTL_{}",
            self.key.replace('.', "_").to_ascii_uppercase()
        )
    }
}

macro_rules! settings {
    ($($key:literal, $flag:literal, $help:literal;)*) => {
        /// Every setting, in the order `config show` prints them.
        pub const SETTINGS: &[Setting] = &[$(Setting { key: $key, flag: $flag, help: $help }),*];
    };
}

settings! {
    "cluster.name", "--cluster-name", "EKS cluster name";
    "cluster.region", "--region", "AWS region";
    "cluster.version", "--kubernetes-version", "Kubernetes version of the cluster";
    "cluster.preset", "--preset", "architecture: cpu, g4dn, p4de-odcr or p5";
    "cluster.instance_type", "--instance-type", "worker instance type";
    "cluster.nodes", "--nodes", "worker nodes";
    "cluster.system_instance_type", "--system-instance-type", "instance type of the system node group";
    "cluster.availability_zones", "--az", "availability zones, comma-separated (the first holds the workers)";
    "cluster.existing_vpc", "--existing-vpc", "id of an existing VPC to use";
    "cluster.private_subnets", "--private-subnets", "private subnet ids of the existing VPC, comma-separated, in --az order";
    "cluster.capacity_reservation_id", "--capacity-reservation-id", "on-demand capacity reservation (ODCR) of the workers";
    "cluster.s3_bucket", "--s3-bucket", "the project's S3 bucket: the cluster gets an IRSA service account allowed that bucket alone, the pods run under it, and training uploads its results there";
    "service_account", "--service-account", "Kubernetes service account of the training, data and test pods (with IRSA, its IAM role is theirs); none: the namespace's default";
    "image", "--image", "container image of the training pods: trainctl's, or your program's with -- PROGRAM";
    "trainctl_image", "--trainctl-image", "image with the trainctl binary: helper jobs run it, and an init container copies trainctl from it into training pods of another image";
    "namespace", "--namespace", "Kubernetes namespace";
    "storage.efs", "--efs", "EFS file system id (fs-...)";
    "storage.fsx", "--fsx", "FSx for Lustre: FS_ID,DNS_NAME,MOUNT_NAME";
    "storage.host_path", "--host-path", "a node directory as the volume (one-node development clusters: kind, k3d, minikube)";
    "storage.claim", "--claim", "name of the shared ReadWriteMany claim";
    "storage.size", "--storage-size", "capacity of the volume";
    "storage.mount_path", "--mount-path", "where pods mount the claim";
    "data.dataset", "--dataset", "the data set the data job fetches: cifar10 or tiny-imagenet";
    "data.dir", "--data-dir", "the data set's directory inside the pods";
    "data.url", "--download-url", "where the data job downloads the data set from";
    "data.md5", "--download-md5", "MD5 the download must have";
    "data.from", "--from", "s3://BUCKET/PREFIX the data job copies onto the claim (into data.dir) instead of downloading data.url";
    "job.name", "--name", "job name (DNS-1123 label)";
    "job.launcher", "--launcher", "indexed (a Job, no operator) or pytorchjob (Kubeflow)";
    "job.command", "--command", "your training program and its arguments (shell words; a list in trainctl.toml), run by trainctl run in every pod; or -- PROGRAM ARGS... after job render|launch; none: the built-in trainer";
    "job.nnodes", "--nnodes", "nodes of the job: N or MIN:MAX";
    "job.nproc_per_node", "--nproc-per-node", "workers per node";
    "job.gpus_per_node", "--gpus-per-node", "GPUs each pod requests";
    "job.node_selector", "--node-selector", "KEY=VALUE the training pods' nodes must have, or none";
    "job.cpu", "--cpu", "CPU each pod requests";
    "job.memory", "--memory", "memory each pod requests";
    "job.shm_size", "--shm-size", "size of /dev/shm";
    "job.model", "--model", "the built-in trainer's network: seed-cnn, resnet18, resnet34, resnet50 or resnet101";
    "job.epochs", "--epochs", "training epochs";
    "job.batch_size", "--batch-size", "images per step on each worker";
    "job.learning_rate", "--lr", "SGD learning rate";
    "job.max_restarts", "--max-restarts", "worker-group restarts before the job fails";
    "job.hang_timeout", "--hang-timeout", "seconds without a line of output after which a pod's workers are hung: their stacks are taken, then they restart as job.max_restarts says; none: never";
    "job.rdzv_backend", "--rdzv-backend", "c10d (the store in pod 0) or etcd (an etcd next to the job, so that pod 0 is not a single point of failure)";
    "job.rdzv_port", "--rdzv-port", "port of the rendezvous store on node 0";
    "job.etcd_image", "--etcd-image", "etcd's image for --rdzv-backend etcd";
    "job.etcd_storage", "--etcd-storage", "where etcd keeps its data: emptydir (lives with the etcd pod) or claim (a folder on the shared claim: survives the pod)";
    "job.metrics_port", "--metrics-port", "port of each training pod's Prometheus metrics (0: none)";
    "job.queue", "--queue", "Kueue LocalQueue the job is submitted to (all pods admitted together), or none";
    "job.runs_dir", "--runs-dir", "where runs write checkpoints and models";
    "job.upload", "--upload", "s3://BUCKET/PREFIX where rank 0 uploads the model, checkpoint and report when training ends; none: no upload";
    "job.fetch", "--fetch", "s3:// URIs of your program's code (objects or prefixes, space-separated), copied into each pod before job.command starts";
    "job.ttl_seconds", "--ttl-seconds", "seconds a finished job is kept";
    "tensorboard.image", "--tensorboard-image", "image with TensorBoard for trainctl tensorboard";
}

pub fn setting(key: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.key == key)
}

/// A value that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{key} = {value:?} (from {from}): {problem}")]
    Invalid {
        key: &'static str,
        value: String,
        from: Source,
        problem: String,
    },
    #[error("{file}: unknown setting `{key}`; known settings: {known}")]
    UnknownKey {
        file: String,
        key: String,
        known: String,
    },
    #[error("{file}: not valid TOML: {message}")]
    Parse { file: String, message: String },
    #[error("cannot read {file}: {error}")]
    Read { file: String, error: std::io::Error },
}

/// etcd for `--rdzv-backend etcd` (the v3 API, which trainctl's etcd backend speaks).
pub const ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.17";
/// TensorBoard for `trainctl tensorboard`: TensorFlow's image has the `tensorboard` command.
pub const TENSORBOARD_IMAGE: &str = "tensorflow/tensorflow:2.18.0";

/// The service account `cluster.s3_bucket` creates (eksctl, with an IAM role for the bucket)
/// and the pods run under.
pub const S3_SERVICE_ACCOUNT: &str = "trainctl-s3";

pub use layers::{Layers, Resolved, join_words, split_words};
pub use project::{
    Cluster, Data, EtcdStorage, Job, Launcher, MAX_JOB_NAME, Project, RdzvBackend, Storage,
    StorageBackend,
};
pub use values::{is_aws_id, is_dns_label, is_quantity};
