//! The project configuration: `trainctl.toml`, `TRAINCTL_*` variables and flags, layered.
//!
//! Every setting has a dotted key (`cluster.nodes`), a flag (`--nodes`), a variable
//! (`TRAINCTL_CLUSTER_NODES`: the key upper-cased, dots as underscores) and a place in the file
//! (`[cluster] nodes = 2`). The first layer that has a value wins: flag, then variable, then
//! file, then the preset, then the built-in default. [`Resolved`] keeps where each value came
//! from, for `trainctl config show`, and [`Project`] is the same values checked and typed: bad
//! values are refused here, before anything is rendered.

mod fit;
mod launcher;
mod layers;
mod project;
mod read;
#[cfg(test)]
mod tests;
mod values;

use std::fmt;
use std::path::PathBuf;

use contract::choices::{HealthCheck, Model, Precision, Stragglers};

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

/// One setting: its key, its flag, its default, what it means and which commands read it.
pub struct Setting {
    pub key: &'static str,
    pub flag: &'static str,
    /// An older flag that sets it too, kept so that command lines written for it still work.
    pub alias: Option<&'static str>,
    /// The value when no layer gives one. `None`: no value, or one computed from other
    /// settings (the preset's, or derived: `Resolved::fill_defaults`).
    pub default: Option<&'static str>,
    /// What its value must be, checked for every value given before the project is built.
    pub parse: Parse,
    pub help: &'static str,
    /// The commands that read it (directly, or through a setting derived from it): their
    /// `--help` lists it. `config show` lists every setting.
    pub used_by: &'static [UsedBy],
}

impl Setting {
    /// `TRAINCTL_CLUSTER_NODES` for `cluster.nodes`.
    pub fn env_var(&self) -> String {
        format!(
            "TRAINCTL_{}",
            self.key.replace('.', "_").to_ascii_uppercase()
        )
    }

    /// Whether one of `commands` reads it.
    pub fn used_by_any(&self, commands: &[UsedBy]) -> bool {
        self.used_by.iter().any(|u| commands.contains(u))
    }
}

/// The commands that read project settings, so that each one's `--help` lists only the
/// settings it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsedBy {
    /// `cluster config|create|addons`: eksctl's ClusterConfig.
    Cluster,
    /// `cluster addons` beside the ClusterConfig: what it says about the training operator.
    Addons,
    /// `cluster delete`.
    ClusterDelete,
    /// `storage`: the StorageClass, PersistentVolume and claim.
    Storage,
    /// `data job`.
    DataJob,
    /// `test job`.
    TestJob,
    /// `doctor`: its pods take the training pods' nodes, GPUs and EFA adapters.
    Doctor,
    /// `job render|launch`: the training job.
    Training,
    /// `job status|wait|logs|top|delete`: a job found by its name.
    Lookup,
    /// `tensorboard`.
    Tensorboard,
}

/// One row per setting: `KEY, FLAG [(alias FLAG)], [COMMANDS...] [= DEFAULT] => PARSE, HELP
/// [-> FIELD [by READER]];`. A row that names its field writes the value there, read by the
/// field's type ([`read::FromSetting`]) or by READER; the few settings that make a field
/// together with others are read in [`Project::from_resolved`]'s own steps.
macro_rules! settings {
    ($($key:literal, $flag:literal $((alias $alias:literal))?, [$($used:ident),*] $(= $default:expr)? => $parse:expr, $help:literal $(-> $($field:ident).+ $(by $reader:path)?)?;)*) => {
        /// Every setting, in the order `config show` prints them.
        pub const SETTINGS: &[Setting] = &[$(Setting {
            key: $key,
            flag: $flag,
            alias: settings!(@option $($alias)?),
            default: settings!(@option $($default)?),
            parse: $parse,
            help: $help,
            used_by: &[$(UsedBy::$used),*],
        }),*];

        /// Each row that names its field: the value, typed, written there.
        fn write_fields(p: &mut Project, v: &values::Values) -> Result<(), ConfigError> {
            $($(p.$($field).+ = settings!(@read v, $key $(, $reader)?)?;)?)*
            Ok(())
        }

        /// Whether `key`'s row names the field it writes.
        #[cfg(test)]
        fn writes_a_field(key: &str) -> bool {
            match key {
                $($key => settings!(@some $($($field)+)?),)*
                _ => false,
            }
        }
    };
    (@some $($t:tt)+) => { true };
    (@some) => { false };
    (@option $value:expr) => { Some($value) };
    (@option) => { None };
    (@read $v:ident, $key:literal) => { read::FromSetting::read($v, $key) };
    (@read $v:ident, $key:literal, $reader:path) => { $reader($v, $key) };
}

// Which commands read what: `Training` and `Doctor` read everything that shapes the training
// pods (the instance type sizes them and decides their GPUs); the helper jobs read the image,
// the claim and their own settings; `Lookup` needs only the job's name and namespace.
settings! {
    "cluster.name", "--cluster-name", [Cluster, ClusterDelete] = "trainctl" => Parse::Typed, "EKS cluster name" -> cluster.name;
    "cluster.region", "--region", [Cluster, ClusterDelete] = "us-west-2" => Parse::Matches(is_region, "an AWS region such as us-west-2"), "AWS region" -> cluster.region;
    "cluster.version", "--kubernetes-version", [Cluster] = "1.33" => Parse::Matches(is_kubernetes_version, "a Kubernetes version such as 1.33"), "Kubernetes version of the cluster (1.MINOR)" -> cluster.version;
    "cluster.preset", "--preset", [Cluster, Training, Doctor] = "cpu" => Parse::Typed, "architecture: cpu, g4dn, p4de-odcr or p5 (it picks the worker instance type)" -> cluster.preset;
    "cluster.instance_type", "--instance-type", [Cluster, Training, Doctor] => Parse::Instance, "worker instance type: it sizes the training pods (CPU, memory, GPUs, EFA) and their node selector" -> cluster.instance_type;
    "cluster.nodes", "--nodes", [Cluster, Training, Doctor] => Parse::Count, "worker nodes: the node group's size (its maximum too), and the job's nodes unless --nnodes says otherwise" -> cluster.nodes;
    "cluster.system_instance_type", "--system-instance-type", [Cluster] = "c5.2xlarge" => Parse::Instance, "instance type of the system node group" -> cluster.system_instance_type;
    "cluster.availability_zones", "--az", [Cluster] => Parse::Text, "availability zones, comma-separated (the first holds the workers)" -> cluster.availability_zones;
    "cluster.existing_vpc", "--existing-vpc", [Cluster] => Parse::Text, "id of an existing VPC to use" -> cluster.existing_vpc;
    "cluster.private_subnets", "--private-subnets", [Cluster] => Parse::Text, "private subnet ids of the existing VPC, comma-separated, in --az order" -> cluster.private_subnets;
    "cluster.capacity_reservation_id", "--capacity-reservation-id", [Cluster] => Parse::Text, "on-demand capacity reservation (ODCR) of the workers" -> cluster.capacity_reservation_id;
    "cluster.s3_bucket", "--s3-bucket", [Cluster, Training, DataJob, TestJob] => Parse::Typed, "the project's S3 bucket: the cluster gets an IRSA service account allowed that bucket alone, the pods run under it, and training uploads its results there" -> cluster.s3_bucket by read::s3_bucket;
    "service_account", "--service-account", [Cluster, Training, DataJob, TestJob] => Parse::OrNone(&Parse::DnsSubdomain), "Kubernetes service account of the training, data and test pods (with IRSA, its IAM role is theirs); none: the namespace's default" -> service_account;
    "image", "--image", [Training, DataJob, TestJob, Doctor] = DEFAULT_IMAGE => Parse::Image, "container image of the training pods: trainctl's (build it with the Dockerfile and push it where the nodes pull from), or your program's with -- PROGRAM" -> image;
    "trainctl_image", "--trainctl-image", [Training, DataJob, TestJob, Doctor] => Parse::Image, "image with the trainctl binary: helper jobs run it, and an init container copies trainctl from it into training pods of another image" -> trainctl_image;
    "namespace", "--namespace", [Cluster, Addons, Storage, DataJob, TestJob, Doctor, Training, Lookup, Tensorboard] = "default" => Parse::DnsLabel, "Kubernetes namespace" -> namespace;
    "storage.efs", "--efs", [Storage] => Parse::Typed, "EFS file system id (fs-...), or fs-...::fsap-... through an access point";
    "storage.fsx", "--fsx", [Storage] => Parse::Typed, "FSx for Lustre: FS_ID,DNS_NAME,MOUNT_NAME";
    "storage.host_path", "--host-path", [Storage] => Parse::Typed, "a node directory as the volume (one-node development clusters: kind, k3d, minikube)";
    "storage.claim", "--claim", [Storage, DataJob, TestJob, Doctor, Training, Tensorboard] = "trainctl-data" => Parse::DnsSubdomain, "name of the shared ReadWriteMany claim" -> storage.claim;
    "storage.size", "--storage-size", [Storage] = "100Gi" => Parse::Matches(is_quantity, "a quantity such as 100Gi"), "capacity the volume and the claim declare, a Kubernetes quantity in bytes (100Gi, 1Ti, 500G); EFS and FSx do not enforce it" -> storage.size;
    "storage.mount_path", "--mount-path", [DataJob, TestJob, Doctor, Training, Tensorboard] = "/data" => Parse::Matches(|s| s.starts_with('/') && s.len() > 1, "an absolute path such as /data"), "where pods mount the claim" -> storage.mount_path;
    "data.dataset", "--dataset", [DataJob, TestJob, Doctor, Training] = contract::CIFAR10.name => Parse::Typed, "the data set the data job fetches and the trainer reads: cifar10 or tiny-imagenet" -> data.dataset;
    "data.dir", "--data-dir", [DataJob, TestJob, Doctor, Training] => Parse::Matches(|s| s.starts_with('/'), "an absolute path in the pod"), "the data set's directory inside the pods" -> data.dir;
    "data.url", "--download-url", [DataJob] => Parse::Matches(|s| s.starts_with("http://") || s.starts_with("https://"), "an http(s) URL"), "where the data job downloads the data set from" -> data.url;
    "data.md5", "--download-md5", [DataJob] => Parse::Matches(|s| s.len() == 32 && s.chars().all(|c| c.is_ascii_hexdigit()), "32 hexadecimal digits"), "MD5 the download must have" -> data.md5;
    "data.from", "--from", [DataJob] => Parse::S3, "s3://BUCKET/PREFIX the data job copies onto the claim (into data.dir) instead of downloading data.url" -> data.from;
    "job.name", "--name", [DataJob, TestJob, Doctor, Training, Lookup, Tensorboard] = "cifar10" => Parse::Typed, "job name (DNS-1123 label); its helper jobs, etcd and TensorBoard are named after it" -> job.name;
    "job.launcher", "--launcher", [Addons, Training] = "indexed" => Parse::Typed, "how the pods are started: indexed (a Job, no operator), pytorchjob (Kubeflow Training Operator v1), trainjob (Kubeflow Trainer v2, elastic through trainctl) or mpijob (MPI Operator, for an MPI program, not elastic)" -> job.launcher;
    "job.mpi_implementation", "--mpi-implementation", [Training] = "openmpi" => Parse::Typed, "--launcher mpijob: the MPI of the image's mpirun: openmpi, intel or mpich" -> job.mpi_implementation;
    "job.command", "--command", [Training, Doctor] => Parse::Typed, "your training program and its arguments (shell words; a list in trainctl.toml), run by trainctl run in every pod; or -- PROGRAM ARGS... after job render|launch; none: the built-in trainer (CPU only: its pods take no GPUs)" -> job.command by read::command;
    "job.nnodes", "--nnodes", [Training, Doctor] => Parse::Typed, "nodes (pods) of the job: N, or MIN:MAX for an elastic job";
    "job.nproc_per_node", "--nproc-per-node", [Training] = "1" => Parse::Count, "workers per node" -> job.nproc_per_node;
    "job.gpus_per_node", "--gpus-per-node", [Training, Doctor] => Parse::Number, "GPUs each pod of -- PROGRAM requests (the built-in trainer's request none)" -> job.gpus_per_node;
    "job.node_selector", "--node-selector", [Training, Doctor] => Parse::Typed, "KEY=VALUE the training pods' nodes must have, or none" -> job.node_selector by read::node_selector;
    "job.cpu", "--cpu", [Training] => Parse::Matches(is_quantity, "a CPU quantity such as 14 or 500m"), "CPU each training pod requests, in cores (14, 0.5) or millicores (500m); by default what a node of the instance type has left for pods (85 % of its vCPUs)" -> job.cpu;
    "job.memory", "--memory", [Training] => Parse::Matches(is_quantity, "a quantity such as 24Gi"), "memory each training pod requests and is limited to, a Kubernetes quantity in bytes (24Gi, 512Mi); by default what a node of the instance type has left for pods (80 % of its memory)" -> job.memory;
    "job.shm_size", "--shm-size", [Training] => Parse::Matches(is_quantity, "a quantity such as 2Gi"), "size of each training pod's /dev/shm (memory, counted in --memory), a quantity in bytes (2Gi, 512Mi); by default an eighth of --memory (at most 8Gi), a quarter (at most 64Gi) on GPU nodes" -> job.shm_size;
    "job.model", "--model", [Training] = Model::SeedCnn.name() => Parse::Typed, "the built-in trainer's network: seed-cnn, resnet18, resnet34, resnet50 or resnet101" -> job.model;
    "job.epochs", "--epochs", [Training] = contract::train_defaults::EPOCHS => Parse::Count, "the built-in trainer's epochs" -> job.epochs;
    "job.batch_size", "--batch-size", [Training] = contract::train_defaults::BATCH_SIZE => Parse::Count, "the built-in trainer's images per step on each worker" -> job.batch_size;
    "job.learning_rate", "--learning-rate" (alias "--lr"), [Training] = contract::train_defaults::LEARNING_RATE => Parse::Matches(|s| s.parse::<f64>().is_ok_and(|lr| lr.is_finite() && lr > 0.0), "a positive number"), "the built-in trainer's SGD learning rate" -> job.learning_rate;
    "job.precision", "--precision", [Training] = Precision::F32.name() => Parse::Typed, "the built-in trainer's convolution arithmetic: fp32, or bf16 (inputs rounded to bf16 and summed in fp32, as PyTorch's CPU autocast; weights, checkpoints and the model stay fp32); bf16 needs nodes whose CPUs have AVX512_BF16 (Intel Sapphire Rapids, AMD Zen 4 and later: c7i, m7i, r7i, c7a, m7a, r7a)" -> job.precision;
    "job.spares", "--spares", [Training] = "0" => Parse::Number, "pods beyond --nnodes MAX that wait as spares, their workers started warm: a lost pod's place is taken at once, at full size (each an idle pod's resources; --launcher indexed)" -> job.spares;
    "job.max_restarts", "--max-restarts", [Training] = "3" => Parse::Number, "worker-group restarts before the job fails (and failures per pod before the Job gives up)" -> job.max_restarts;
    "job.stragglers", "--stragglers", [Training] = Stragglers::Warn.name() => Parse::Typed, "a node whose ranks take longer than the others' for a window of steps (the built-in trainer compares them): warn says so; evict also drops it by a regroup in place, never below the job's minimum nodes" -> job.stragglers;
    "job.health_check", "--health-check", [Training] = HealthCheck::Warn.name() => Parse::Typed, "a pod's health check before it joins (a CPU matrix multiply and a loopback stream against the pods in the job): warn when far below them, refuse to join, or off" -> job.health_check;
    "job.hang_timeout", "--hang-timeout", [Training] => Parse::OrNone(&Parse::Count), "seconds without progress (a line of output or CPU time) after which a pod's workers are hung: their stacks are taken, then they restart as job.max_restarts says; none: never" -> job.hang_timeout;
    "job.rdzv_backend", "--rdzv-backend", [Training] = "c10d" => Parse::Typed, "c10d (the store in pod 0) or etcd (an etcd next to the job, so that pod 0 is not a single point of failure)" -> job.rdzv_backend;
    "job.rdzv_port", "--rdzv-port", [Training, Doctor] = "29400" => Parse::Port, "port of the rendezvous store on node 0" -> job.rdzv_port;
    "job.etcd_image", "--etcd-image", [Training] = ETCD_IMAGE => Parse::Image, "etcd's image for --rdzv-backend etcd" -> job.etcd_image;
    "job.etcd_storage", "--etcd-storage", [Training] = "emptydir" => Parse::Typed, "where etcd keeps its data: emptydir (lives with the etcd pod) or claim (a folder on the shared claim: survives the pod)" -> job.etcd_storage;
    "job.metrics_port", "--metrics-port", [Training] = "9464" => Parse::PortOrOff, "port of each training pod's Prometheus metrics (0: none)" -> job.metrics_port by read::port_or_off;
    "job.queue", "--queue", [Training] => Parse::OrNone(&Parse::DnsSubdomain), "Kueue LocalQueue the job is submitted to (all pods admitted together), or none" -> job.queue;
    "job.runs_dir", "--runs-dir", [Training, TestJob, Tensorboard] => Parse::Matches(|s| s.starts_with('/'), "an absolute path in the pod"), "where runs write checkpoints and models (the test job reads the model there, TensorBoard the events)" -> job.runs_dir;
    "job.upload", "--upload", [Training] => Parse::S3, "s3://BUCKET/PREFIX where rank 0 uploads the model, checkpoint and report when training ends; none: no upload" -> job.upload;
    "job.fetch", "--fetch", [Training] => Parse::Typed, "s3:// URIs of your program's code (objects or prefixes, space-separated), copied into each pod before job.command starts" -> job.fetch by read::s3_uris;
    "job.ttl_seconds", "--ttl-seconds", [Training, DataJob, TestJob, Doctor] = "86400" => Parse::Number, "seconds a finished job (and what it owns) is kept" -> job.ttl_seconds;
    "tensorboard.image", "--tensorboard-image", [Tensorboard] = TENSORBOARD_IMAGE => Parse::Image, "image with TensorBoard for trainctl tensorboard" -> tensorboard_image;
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

/// The image of the training pods when none is given: what `docker build -t trainctl .` tags,
/// which no registry serves (a render or launch says so).
pub(crate) const DEFAULT_IMAGE: &str = "trainctl:latest";
/// etcd for `--rdzv-backend etcd` (the v3 API, which trainctl's etcd backend speaks).
pub(crate) const ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.17";
/// TensorBoard for `trainctl tensorboard`: TensorFlow's image has the `tensorboard` command.
pub(crate) const TENSORBOARD_IMAGE: &str = "tensorflow/tensorflow:2.18.0";

/// The service account `cluster.s3_bucket` creates (eksctl, with an IAM role for the bucket)
/// and the pods run under.
pub(crate) const S3_SERVICE_ACCOUNT: &str = "trainctl-s3";

pub use crate::catalog::INSTANCE_TYPE_LABEL;
pub use fit::Renders;
pub use launcher::{Launcher, Operator};
pub use layers::{Layers, Resolved, join_words, split_words};
pub use project::{
    Cluster, Data, EtcdStorage, Job, MAX_JOB_NAME, MpiImplementation, Project, RdzvBackend,
    Storage, StorageBackend,
};
pub use values::{Parse, bytes, is_aws_id, is_dns_label, is_quantity, millicores};
use values::{is_kubernetes_version, is_region};
