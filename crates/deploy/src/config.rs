//! The project configuration: `trainctl.toml`, `TRAINCTL_*` variables and flags, layered.
//!
//! Every setting has a dotted key (`cluster.nodes`), a flag (`--nodes`), a variable
//! (`TRAINCTL_CLUSTER_NODES`: the key upper-cased, dots as underscores) and a place in the file
//! (`[cluster] nodes = 2`). The first layer that has a value wins: flag, then variable, then
//! file, then the preset, then the built-in default. [`Resolved`] keeps where each value came
//! from, for `trainctl config show`, and [`Project`] is the same values checked and typed: bad
//! values are refused here, before anything is rendered.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::catalog::{self, InstanceType, Preset};

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

/// The values as given, layer by layer.
pub struct Layers<'a> {
    /// `(key, value)` from the command line.
    pub flags: Vec<(&'static str, String)>,
    /// Looks a variable up (the process environment, or a map in tests).
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// The project file's path and text, if there is one.
    pub file: Option<(PathBuf, String)>,
}

impl Layers<'_> {
    /// Reads `path` if given (it must exist), else `./trainctl.toml` when present.
    pub fn read_file(path: Option<&Path>) -> Result<Option<(PathBuf, String)>, ConfigError> {
        let (path, required) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from("trainctl.toml"), false),
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some((path, text))),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(ConfigError::Read {
                file: path.display().to_string(),
                error,
            }),
        }
    }
}

/// The effective value of every setting that has one, and where it came from.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub values: BTreeMap<&'static str, (String, Source)>,
}

impl Resolved {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(|(v, _)| v.as_str())
    }

    /// Layers the values, then fills in what the preset and the defaults give.
    pub fn resolve(layers: &Layers) -> Result<Resolved, ConfigError> {
        let file_values = match &layers.file {
            Some((path, text)) => parse_file(path, text)?,
            None => BTreeMap::new(),
        };
        let mut values = BTreeMap::new();
        for s in SETTINGS {
            let flag = layers.flags.iter().rev().find(|(k, _)| *k == s.key);
            let value = if let Some((_, v)) = flag {
                Some((v.clone(), Source::Flag(s.flag)))
            } else if let Some(v) = (layers.env)(&s.env_var()).filter(|v| !v.is_empty()) {
                Some((v, Source::Env(s.env_var())))
            } else {
                file_values.get(s.key).map(|v| {
                    let path = layers.file.as_ref().map(|(p, _)| p.clone());
                    (v.clone(), Source::File(path.unwrap_or_default()))
                })
            };
            if let Some(v) = value {
                values.insert(s.key, v);
            }
        }
        let mut resolved = Resolved { values };
        resolved.fill_defaults();
        Ok(resolved)
    }

    fn fill_defaults(&mut self) {
        let preset = self
            .get("cluster.preset")
            .and_then(Preset::parse)
            .unwrap_or(Preset::Cpu);
        let mut default = |key: &'static str, value: String, source: Source| {
            self.values.entry(key).or_insert((value, source));
        };
        default("cluster.name", "trainctl".into(), Source::Default);
        default("cluster.region", "us-west-2".into(), Source::Default);
        default("cluster.version", "1.33".into(), Source::Default);
        default("cluster.preset", "cpu".into(), Source::Default);
        default(
            "cluster.instance_type",
            preset.instance_type().into(),
            Source::Preset(preset.name()),
        );
        default("cluster.nodes", "2".into(), Source::Preset(preset.name()));
        default(
            "cluster.system_instance_type",
            "c5.2xlarge".into(),
            Source::Default,
        );
        default("image", "trainctl:latest".into(), Source::Default);
        default("job.rdzv_backend", "c10d".into(), Source::Default);
        default("job.etcd_image", ETCD_IMAGE.into(), Source::Default);
        default("job.etcd_storage", "emptydir".into(), Source::Default);
        default(
            "tensorboard.image",
            TENSORBOARD_IMAGE.into(),
            Source::Default,
        );
        default("namespace", "default".into(), Source::Default);
        default("storage.claim", "trainctl-data".into(), Source::Default);
        default("storage.size", "100Gi".into(), Source::Default);
        default("storage.mount_path", "/data".into(), Source::Default);
        default("data.dataset", "cifar10".into(), Source::Default);
        default("job.model", "seed-cnn".into(), Source::Default);
        default("job.name", "cifar10".into(), Source::Default);
        default("job.launcher", "indexed".into(), Source::Default);
        default("job.nproc_per_node", "1".into(), Source::Default);
        default("job.epochs", "10".into(), Source::Default);
        default("job.batch_size", "128".into(), Source::Default);
        default("job.learning_rate", "0.001".into(), Source::Default);
        default("job.max_restarts", "3".into(), Source::Default);
        default("job.rdzv_port", "29400".into(), Source::Default);
        default("job.metrics_port", "9464".into(), Source::Default);
        default("job.ttl_seconds", "86400".into(), Source::Default);

        // Settings computed from others.
        let mount = self
            .get("storage.mount_path")
            .unwrap_or("/data")
            .to_string();
        let mount = mount.trim_end_matches('/');
        let nodes = self.get("cluster.nodes").unwrap_or("2").to_string();
        let region = self
            .get("cluster.region")
            .unwrap_or("us-west-2")
            .to_string();
        let pick_zones = self.get("cluster.existing_vpc").is_none()
            && self.get("cluster.capacity_reservation_id").is_none();
        let instance = self
            .get("cluster.instance_type")
            .and_then(catalog::instance_type);
        let image = self.get("image").unwrap_or("trainctl:latest").to_string();
        let dataset = self.get("data.dataset").unwrap_or("cifar10").to_string();
        let bucket = self.get("cluster.s3_bucket").map(str::to_string);
        let job_name = self.get("job.name").unwrap_or("cifar10").to_string();
        let (url, md5) = match dataset.as_str() {
            "tiny-imagenet" => (TINY_IMAGENET_URL, TINY_IMAGENET_MD5),
            _ => (OFFICIAL_URL, OFFICIAL_MD5),
        };
        let mut derived = |key: &'static str, value: String, from: &'static str| {
            self.values
                .entry(key)
                .or_insert((value, Source::Derived(from)));
        };
        derived("trainctl_image", image, "image");
        derived("data.url", url.into(), "data.dataset");
        derived("data.md5", md5.into(), "data.dataset");
        derived(
            "data.dir",
            format!("{mount}/{dataset}"),
            "storage.mount_path",
        );
        derived(
            "job.runs_dir",
            format!("{mount}/runs"),
            "storage.mount_path",
        );
        derived("job.nnodes", nodes, "cluster.nodes");
        if let Some(bucket) = bucket {
            derived(
                "service_account",
                S3_SERVICE_ACCOUNT.into(),
                "cluster.s3_bucket",
            );
            derived(
                "job.upload",
                format!("s3://{bucket}/runs/{job_name}"),
                "cluster.s3_bucket",
            );
        }
        // A new VPC without a reservation can go anywhere in the region: its first zones. An
        // existing VPC's zones are its subnets', and a reservation's is its own: those are asked.
        if pick_zones {
            derived(
                "cluster.availability_zones",
                catalog::default_zones(&region).join(","),
                "cluster.region",
            );
        }
        if let Some(t) = instance {
            derived(
                "job.node_selector",
                format!("node.kubernetes.io/instance-type={}", t.name),
                "cluster.instance_type",
            );
            let (cpu, memory, shm) = pod_size(t);
            derived(
                "job.gpus_per_node",
                t.gpus.to_string(),
                "cluster.instance_type",
            );
            derived("job.cpu", cpu, "cluster.instance_type");
            derived("job.memory", memory, "cluster.instance_type");
            derived("job.shm_size", shm, "cluster.instance_type");
        }
    }
}

/// Requests that fit one pod per node: the node's allocatable share after the kubelet,
/// the system daemons and the DaemonSets (about 15 % of CPU, 20 % of memory).
fn pod_size(t: &InstanceType) -> (String, String, String) {
    let cpu = (t.vcpus * 85 / 100).max(1);
    let memory = (t.memory_gib * 80 / 100).max(1);
    let shm = if t.gpus > 0 {
        (memory / 4).clamp(1, 64)
    } else {
        (memory / 8).clamp(1, 8)
    };
    (cpu.to_string(), format!("{memory}Gi"), format!("{shm}Gi"))
}

/// etcd for `--rdzv-backend etcd` (the v3 API, which trainctl's etcd backend speaks).
pub const ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.17";
/// TensorBoard for `trainctl tensorboard`: TensorFlow's image has the `tensorboard` command.
pub const TENSORBOARD_IMAGE: &str = "tensorflow/tensorflow:2.18.0";

/// The official binary CIFAR-10 archive (kept in step with `trainer::cifar`, which this crate
/// does not depend on: it would pull burn into every Kubernetes command's build).
pub const OFFICIAL_URL: &str = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz";
pub const OFFICIAL_MD5: &str = "c32a1d4ab5d03f1284b67883e8d87530";
/// tiny-imagenet-200's official archive (in step with `trainer::data::tiny`).
pub const TINY_IMAGENET_URL: &str = "http://cs231n.stanford.edu/tiny-imagenet-200.zip";
pub const TINY_IMAGENET_MD5: &str = "90528d7ca1a48142e341f4ef8d21d0de";
/// The service account `cluster.s3_bucket` creates (eksctl, with an IAM role for the bucket)
/// and the pods run under.
pub const S3_SERVICE_ACCOUNT: &str = "trainctl-s3";

/// The networks of the built-in trainer (`trainctl train --model`).
pub const MODELS: [&str; 5] = ["seed-cnn", "resnet18", "resnet34", "resnet50", "resnet101"];

/// Flattens `[section] key = value` into `section.key`, refusing keys no setting has.
fn parse_file(path: &Path, text: &str) -> Result<BTreeMap<String, String>, ConfigError> {
    let file = path.display().to_string();
    let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.clone(),
        message: e.to_string().trim_end().to_string(),
    })?;
    let mut out = BTreeMap::new();
    let unknown = |key: String| ConfigError::UnknownKey {
        file: file.clone(),
        key,
        known: SETTINGS
            .iter()
            .map(|s| s.key)
            .collect::<Vec<_>>()
            .join(", "),
    };
    for (name, value) in table {
        match value {
            toml::Value::Table(section) => {
                for (k, v) in section {
                    let key = format!("{name}.{k}");
                    if setting(&key).is_none() {
                        return Err(unknown(key));
                    }
                    let value = if key == "job.command" {
                        command_words(&file, &key, v)?
                    } else {
                        scalar(&file, &key, v)?
                    };
                    out.insert(key, value);
                }
            }
            v => {
                if setting(&name).is_none() {
                    return Err(unknown(name));
                }
                let value = scalar(&file, &name, v)?;
                out.insert(name, value);
            }
        }
    }
    Ok(out)
}

/// A command in the file: a list of words (`["python", "main.py"]`), kept as one string of
/// shell words so that it layers like every other setting; or a string of shell words as is.
fn command_words(file: &str, key: &str, v: toml::Value) -> Result<String, ConfigError> {
    let toml::Value::Array(items) = v else {
        return scalar(file, key, v);
    };
    let words = items
        .into_iter()
        .map(|i| match i {
            toml::Value::String(s) => Ok(s),
            other => Err(ConfigError::Parse {
                file: file.to_string(),
                message: format!("{key}: expected a list of strings, got {other}"),
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    join_words(&words).map_err(|message| ConfigError::Parse {
        file: file.to_string(),
        message: format!("{key}: {message}"),
    })
}

/// Words as one string that [`split_words`] gives back exactly (POSIX shell quoting).
pub fn join_words<S: AsRef<str>>(words: &[S]) -> Result<String, String> {
    shlex::try_join(words.iter().map(AsRef::as_ref))
        .map_err(|_| "a word holds a NUL byte, which no program argument can".into())
}

/// A string of shell words as the words (quotes and backslashes as a POSIX shell reads them;
/// no expansion).
pub fn split_words(s: &str) -> Option<Vec<String>> {
    shlex::split(s)
}

fn scalar(file: &str, key: &str, v: toml::Value) -> Result<String, ConfigError> {
    Ok(match v {
        toml::Value::String(s) => s,
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Array(items) => items
            .into_iter()
            .map(|i| scalar(file, key, i))
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        other => {
            return Err(ConfigError::Parse {
                file: file.to_string(),
                message: format!("{key}: expected a string, number or list, got {other}"),
            });
        }
    })
}

/// Where the job's rendezvous state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdzvBackend {
    /// trainctl's store, hosted by pod 0's agent.
    C10d,
    /// An etcd Deployment and Service next to the job.
    Etcd,
}

/// Where the job's etcd keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtcdStorage {
    /// An emptyDir: a restarted etcd pod starts empty (the agents then form a new round).
    EmptyDir,
    /// A folder of the shared claim: a restarted etcd pod has the job's state back.
    Claim,
}

/// How the workers of a job are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// An Indexed Job and a headless Service: needs no operator.
    Indexed,
    /// A Kubeflow `PyTorchJob` (kubeflow.org/v1): needs the training operator.
    PyTorchJob,
}

/// Shared storage behind the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StorageBackend {
    Efs {
        file_system_id: String,
    },
    Fsx {
        file_system_id: String,
        dns_name: String,
        mount_name: String,
    },
    /// A directory on the node: only for clusters of one node.
    HostPath {
        path: String,
    },
}

#[derive(Debug, Clone)]
pub struct Cluster {
    pub name: String,
    pub region: String,
    pub version: String,
    pub preset: Preset,
    pub instance_type: &'static InstanceType,
    pub nodes: u32,
    pub system_instance_type: &'static InstanceType,
    pub availability_zones: Vec<String>,
    /// The zones were not given: trainctl picked the region's first (`catalog::default_zones`).
    pub zones_picked: bool,
    pub existing_vpc: Option<String>,
    pub private_subnets: Vec<String>,
    pub capacity_reservation_id: Option<String>,
    /// The bucket the IRSA service account may use.
    pub s3_bucket: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Storage {
    pub backend: Option<StorageBackend>,
    pub claim: String,
    pub size: String,
    pub mount_path: String,
}

#[derive(Debug, Clone)]
pub struct Data {
    /// `cifar10` or `tiny-imagenet`.
    pub dataset: String,
    pub dir: String,
    pub url: String,
    pub md5: String,
    /// Stage from S3 instead of downloading `url`.
    pub from: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Job {
    pub name: String,
    pub launcher: Launcher,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub nproc_per_node: u32,
    pub gpus_per_node: u32,
    /// `(label, value)` the training pods' nodes must carry.
    pub node_selector: Option<(String, String)>,
    pub cpu: String,
    pub memory: String,
    pub shm_size: String,
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
    pub max_restarts: u32,
    pub rdzv_port: u16,
    /// `None` when set to 0: no metrics endpoint, no annotations.
    pub metrics_port: Option<u16>,
    /// Kueue's LocalQueue: the job carries `kueue.x-k8s.io/queue-name`.
    pub queue: Option<String>,
    /// The user's program and its arguments; `None`: the built-in trainer.
    pub command: Option<Vec<String>>,
    /// The built-in trainer's network (`--model`).
    pub model: String,
    pub rdzv_backend: RdzvBackend,
    pub etcd_image: String,
    pub etcd_storage: EtcdStorage,
    pub runs_dir: String,
    pub ttl_seconds: i32,
    /// Where rank 0 uploads the results (`trainctl train --upload`).
    pub upload: Option<String>,
    /// The program's code copied from S3 into each pod (`trainctl run --fetch`).
    pub fetch: Vec<String>,
}

impl Job {
    pub fn is_elastic(&self) -> bool {
        self.min_nodes < self.max_nodes
    }

    /// `N` or `MIN:MAX`, as `trainctl run --nnodes` takes it.
    pub fn nnodes(&self) -> String {
        if self.is_elastic() {
            format!("{}:{}", self.min_nodes, self.max_nodes)
        } else {
            self.max_nodes.to_string()
        }
    }

    /// Where the job's run writes its checkpoint and model (`trainctl train --out`/RUN_ID).
    pub fn run_dir(&self) -> String {
        format!("{}/{}", self.runs_dir.trim_end_matches('/'), self.name)
    }

    pub fn model_path(&self) -> String {
        format!("{}/model.safetensors", self.run_dir())
    }
}

/// The whole project, checked.
#[derive(Debug, Clone)]
pub struct Project {
    pub cluster: Cluster,
    /// What the training pods run.
    pub image: String,
    /// The image with the trainctl binary (helper jobs; the init container of training pods
    /// when `image` differs).
    pub trainctl_image: String,
    /// What `trainctl tensorboard` runs.
    pub tensorboard_image: String,
    pub namespace: String,
    /// The pods' service account (IRSA).
    pub service_account: Option<String>,
    pub storage: Storage,
    pub data: Data,
    pub job: Job,
}

/// Longest job name: pods are named `NAME-worker-INDEX` and must stay DNS labels (63).
pub const MAX_JOB_NAME: usize = 45;

impl Project {
    /// Checks and types every value; the first bad one is the error.
    pub fn from_resolved(r: &Resolved) -> Result<Project, ConfigError> {
        let v = Values(r);
        let preset_name = v.str("cluster.preset")?;
        let preset = Preset::parse(&preset_name).ok_or_else(|| {
            v.invalid(
                "cluster.preset",
                format!(
                    "unknown preset; choose one of {}",
                    Preset::ALL.map(Preset::name).join(", ")
                ),
            )
        })?;
        let instance_type = v.instance("cluster.instance_type")?;
        let system_instance_type = v.instance("cluster.system_instance_type")?;
        let nodes = v.positive("cluster.nodes")?;
        let name = v.str("cluster.name")?;
        if !is_dns_label(&name, 100) || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
            return Err(v.invalid(
                "cluster.name",
                "not a valid cluster name: use lowercase letters, digits and '-', starting \
                 with a letter and ending with a letter or digit"
                    .into(),
            ));
        }
        let cluster = Cluster {
            name,
            region: v.matching(
                "cluster.region",
                is_region,
                "an AWS region such as us-west-2",
            )?,
            version: v.matching(
                "cluster.version",
                |s| {
                    s.split_once('.').is_some_and(|(a, b)| {
                        a == "1" && !b.is_empty() && b.chars().all(|c| c.is_ascii_digit())
                    })
                },
                "a Kubernetes version such as 1.33",
            )?,
            preset,
            instance_type,
            nodes,
            system_instance_type,
            availability_zones: v.list("cluster.availability_zones"),
            zones_picked: matches!(
                v.raw("cluster.availability_zones"),
                Some((_, Source::Derived(_)))
            ),
            existing_vpc: v.optional("cluster.existing_vpc"),
            private_subnets: v.list("cluster.private_subnets"),
            capacity_reservation_id: v.optional("cluster.capacity_reservation_id"),
            s3_bucket: match v.optional("cluster.s3_bucket") {
                Some(bucket) => {
                    v.s3_uri("cluster.s3_bucket", &format!("s3://{bucket}/"))?;
                    Some(bucket)
                }
                None => None,
            },
        };
        let storage = Storage {
            backend: v.storage_backend()?,
            claim: v.dns_subdomain("storage.claim")?,
            size: v.matching("storage.size", is_quantity, "a quantity such as 100Gi")?,
            mount_path: v.matching(
                "storage.mount_path",
                |s| s.starts_with('/') && s.len() > 1,
                "an absolute path such as /data",
            )?,
        };
        let data = Data {
            dataset: v.matching(
                "data.dataset",
                |s| ["cifar10", "tiny-imagenet"].contains(&s),
                "cifar10 or tiny-imagenet",
            )?,
            dir: v.matching(
                "data.dir",
                |s| s.starts_with('/'),
                "an absolute path in the pod",
            )?,
            url: v.matching(
                "data.url",
                |s| s.starts_with("http://") || s.starts_with("https://"),
                "an http(s) URL",
            )?,
            md5: v.matching(
                "data.md5",
                |s| s.len() == 32 && s.chars().all(|c| c.is_ascii_hexdigit()),
                "32 hexadecimal digits",
            )?,
            from: v.optional_s3("data.from")?,
        };
        let job_name = v.str("job.name")?;
        if !is_dns_label(&job_name, MAX_JOB_NAME)
            || !job_name.starts_with(|c: char| c.is_ascii_lowercase())
        {
            return Err(v.invalid(
                "job.name",
                format!(
                    "not a valid job name: a DNS-1123 label of at most {MAX_JOB_NAME} \
                     characters (lowercase letters, digits, '-'; starting with a letter), so \
                     that its pods' names stay valid"
                ),
            ));
        }
        let launcher = match v.str("job.launcher")?.as_str() {
            "indexed" => Launcher::Indexed,
            "pytorchjob" => Launcher::PyTorchJob,
            _ => {
                return Err(v.invalid(
                    "job.launcher",
                    "choose indexed (no operator needed) or pytorchjob (Kubeflow)".into(),
                ));
            }
        };
        let (min_nodes, max_nodes) = v.nnodes()?;
        let gpus_per_node = v.number::<u32>("job.gpus_per_node")?;
        if gpus_per_node > instance_type.gpus {
            return Err(v.invalid(
                "job.gpus_per_node",
                format!(
                    "{} has {} GPUs per node",
                    instance_type.name, instance_type.gpus
                ),
            ));
        }
        let job = Job {
            name: job_name,
            launcher,
            min_nodes,
            max_nodes,
            nproc_per_node: v.positive("job.nproc_per_node")?,
            gpus_per_node,
            node_selector: v.node_selector()?,
            cpu: v.matching("job.cpu", is_quantity, "a CPU quantity such as 14 or 500m")?,
            memory: v.matching("job.memory", is_quantity, "a quantity such as 24Gi")?,
            shm_size: v.matching("job.shm_size", is_quantity, "a quantity such as 2Gi")?,
            epochs: v.positive("job.epochs")?,
            batch_size: v.positive("job.batch_size")?,
            learning_rate: v.number::<f64>("job.learning_rate").and_then(|lr| {
                if lr.is_finite() && lr > 0.0 {
                    Ok(lr)
                } else {
                    Err(v.invalid("job.learning_rate", "must be a positive number".into()))
                }
            })?,
            max_restarts: v.number("job.max_restarts")?,
            rdzv_port: v.number::<u16>("job.rdzv_port").and_then(|p| {
                if p == 0 {
                    Err(v.invalid("job.rdzv_port", "must be a port from 1 to 65535".into()))
                } else {
                    Ok(p)
                }
            })?,
            metrics_port: match v.number::<u16>("job.metrics_port")? {
                0 => None,
                p if v.number::<u16>("job.rdzv_port").ok() == Some(p) => {
                    return Err(v.invalid(
                        "job.metrics_port",
                        format!("is the rendezvous port ({p}); pick another, or 0 for none"),
                    ));
                }
                p => Some(p),
            },
            queue: match v.optional("job.queue").as_deref() {
                None | Some("none") => None,
                Some(_) => Some(v.dns_subdomain("job.queue")?),
            },
            command: v.command()?,
            model: v.matching(
                "job.model",
                |s| MODELS.contains(&s),
                "seed-cnn, resnet18, resnet34, resnet50 or resnet101",
            )?,
            rdzv_backend: match v.str("job.rdzv_backend")?.as_str() {
                "c10d" => RdzvBackend::C10d,
                "etcd" => RdzvBackend::Etcd,
                _ => {
                    return Err(v.invalid(
                        "job.rdzv_backend",
                        "choose c10d (the store in pod 0) or etcd (an etcd next to the job)".into(),
                    ));
                }
            },
            etcd_image: v.image("job.etcd_image")?,
            etcd_storage: match v.str("job.etcd_storage")?.as_str() {
                "emptydir" => EtcdStorage::EmptyDir,
                "claim" => EtcdStorage::Claim,
                _ => {
                    return Err(v.invalid(
                        "job.etcd_storage",
                        "choose emptydir (the data lives with the etcd pod) or claim (a folder \
                         on the shared claim)"
                            .into(),
                    ));
                }
            },
            runs_dir: v.matching(
                "job.runs_dir",
                |s| s.starts_with('/'),
                "an absolute path in the pod",
            )?,
            ttl_seconds: v.number("job.ttl_seconds")?,
            upload: v.optional_s3("job.upload")?,
            fetch: match v.optional("job.fetch") {
                Some(list) => list
                    .split_whitespace()
                    .map(|uri| v.s3_uri("job.fetch", uri))
                    .collect::<Result<_, _>>()?,
                None => Vec::new(),
            },
        };
        if !job.fetch.is_empty() && job.command.is_none() {
            return Err(v.invalid(
                "job.fetch",
                "fetches your program's code, but no program is set: give it with --command \
                 (or -- PROGRAM ARGS...)"
                    .into(),
            ));
        }
        let image = v.image("image")?;
        let trainctl_image = v.image("trainctl_image")?;
        if job.command.is_some()
            && trainctl_image == image
            && matches!(v.raw("trainctl_image"), Some((_, Source::Derived(_))))
            && v.raw("image")
                .is_some_and(|(_, from)| *from != Source::Default)
        {
            return Err(v.invalid(
                "image",
                format!(
                    "runs your program ({}), and nothing says where trainctl comes from: give \
                     --trainctl-image with trainctl's image (an init container copies the binary \
                     into the pods), or --trainctl-image {image} if this image has trainctl \
                     in it (docs/KUBERNETES.md, \"Your own image\")",
                    v.str("job.command")?
                ),
            ));
        }
        Ok(Project {
            cluster,
            image,
            trainctl_image,
            tensorboard_image: v.image("tensorboard.image")?,
            namespace: v.dns_label("namespace")?,
            service_account: match v.optional("service_account").as_deref() {
                None | Some("none") => None,
                Some(_) => Some(v.dns_subdomain("service_account")?),
            },
            storage,
            data,
            job,
        })
    }
}

impl Project {
    /// The project from these `(key, value)` settings alone, as if given as flags, with no
    /// variables and no file (tests, and tools that build a project themselves).
    pub fn from_settings(settings: &[(&'static str, &str)]) -> Result<Project, ConfigError> {
        let no_env = |_: &str| None;
        let layers = Layers {
            flags: settings.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            env: &no_env,
            file: None,
        };
        Project::from_resolved(&Resolved::resolve(&layers)?)
    }
}

/// Reads typed values out of a [`Resolved`], naming the setting and its source on error.
struct Values<'a>(&'a Resolved);

impl Values<'_> {
    fn raw(&self, key: &'static str) -> Option<&(String, Source)> {
        self.0.values.get(key)
    }

    fn invalid(&self, key: &'static str, problem: String) -> ConfigError {
        let (value, from) = self
            .raw(key)
            .cloned()
            .unwrap_or((String::new(), Source::Default));
        ConfigError::Invalid {
            key,
            value,
            from,
            problem,
        }
    }

    fn str(&self, key: &'static str) -> Result<String, ConfigError> {
        match self.raw(key) {
            Some((v, _)) => Ok(v.trim().to_string()),
            None => Err(self.invalid(key, format!("missing; set {}", flag_of(key)))),
        }
    }

    fn optional(&self, key: &'static str) -> Option<String> {
        self.raw(key)
            .map(|(v, _)| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    fn list(&self, key: &'static str) -> Vec<String> {
        self.optional(key)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn number<T: std::str::FromStr>(&self, key: &'static str) -> Result<T, ConfigError> {
        self.str(key)?
            .parse::<T>()
            .map_err(|_| self.invalid(key, "not a number in range".into()))
    }

    fn positive(&self, key: &'static str) -> Result<u32, ConfigError> {
        match self.number::<u32>(key)? {
            0 => Err(self.invalid(key, "must be at least 1".into())),
            n => Ok(n),
        }
    }

    fn matching(
        &self,
        key: &'static str,
        ok: impl Fn(&str) -> bool,
        expected: &str,
    ) -> Result<String, ConfigError> {
        let v = self.str(key)?;
        if ok(&v) {
            Ok(v)
        } else {
            Err(self.invalid(key, format!("expected {expected}")))
        }
    }

    fn image(&self, key: &'static str) -> Result<String, ConfigError> {
        self.matching(
            key,
            |s| !s.is_empty() && !s.contains(char::is_whitespace),
            "an image reference such as 123456789012.dkr.ecr.us-west-2.amazonaws.com/trainctl:0.1",
        )
    }

    fn command(&self) -> Result<Option<Vec<String>>, ConfigError> {
        let Some(v) = self.optional("job.command") else {
            return Ok(None);
        };
        if v == "none" {
            return Ok(None);
        }
        match split_words(&v) {
            Some(words) if !words.is_empty() => Ok(Some(words)),
            Some(_) => Ok(None),
            None => Err(self.invalid(
                "job.command",
                "not shell words: a quote is not closed or the text ends in a backslash; \
                 write it as a list in trainctl.toml (command = [\"python\", \"main.py\"]) \
                 or after -- on the command line"
                    .into(),
            )),
        }
    }

    /// `text` as an S3 URI (checked as trainctl's S3 client will read it).
    fn s3_uri(&self, key: &'static str, text: &str) -> Result<String, ConfigError> {
        match text.parse::<objects::S3Uri>() {
            Ok(_) => Ok(text.to_string()),
            Err(e) => Err(self.invalid(key, format!("{e}"))),
        }
    }

    /// An optional S3 URI; `none` is none.
    fn optional_s3(&self, key: &'static str) -> Result<Option<String>, ConfigError> {
        match self.optional(key).as_deref() {
            None | Some("none") => Ok(None),
            Some(text) => self.s3_uri(key, text).map(Some),
        }
    }

    fn dns_label(&self, key: &'static str) -> Result<String, ConfigError> {
        self.matching(
            key,
            |s| is_dns_label(s, 63),
            "a DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and \
             ending with a letter or digit",
        )
    }

    fn dns_subdomain(&self, key: &'static str) -> Result<String, ConfigError> {
        self.matching(
            key,
            |s| s.len() <= 253 && s.split('.').all(|l| is_dns_label(l, 63)),
            "a DNS-1123 subdomain: lowercase letters, digits, '-' and '.'",
        )
    }

    fn instance(&self, key: &'static str) -> Result<&'static InstanceType, ConfigError> {
        let name = self.str(key)?;
        catalog::instance_type(&name).ok_or_else(|| {
            let known: Vec<_> = catalog::INSTANCE_TYPES.iter().map(|t| t.name).collect();
            self.invalid(
                key,
                format!("unknown instance type; known: {}", known.join(", ")),
            )
        })
    }

    fn nnodes(&self) -> Result<(u32, u32), ConfigError> {
        let v = self.str("job.nnodes")?;
        let (min, max) = v.split_once(':').unwrap_or((&v, &v));
        let parse = |s: &str| s.trim().parse::<u32>().ok().filter(|&n| n > 0);
        match (parse(min), parse(max)) {
            (Some(min), Some(max)) if min <= max => Ok((min, max)),
            (Some(_), Some(_)) => {
                Err(self.invalid("job.nnodes", "MIN is larger than MAX; write MIN:MAX".into()))
            }
            _ => Err(self.invalid(
                "job.nnodes",
                "expected a positive number N or MIN:MAX".into(),
            )),
        }
    }

    fn storage_backend(&self) -> Result<Option<StorageBackend>, ConfigError> {
        let efs = self.optional("storage.efs");
        let fsx = self.optional("storage.fsx");
        let host_path = self.optional("storage.host_path");
        let given = [efs.is_some(), fsx.is_some(), host_path.is_some()];
        if given.iter().filter(|g| **g).count() > 1 {
            let key = if host_path.is_some() {
                "storage.host_path"
            } else {
                "storage.fsx"
            };
            return Err(self.invalid(
                key,
                "more than one of storage.efs, storage.fsx and storage.host_path is set; choose one"
                    .into(),
            ));
        }
        if let Some(path) = host_path {
            return if path.starts_with('/') {
                Ok(Some(StorageBackend::HostPath { path }))
            } else {
                Err(self.invalid("storage.host_path", "expected an absolute path".into()))
            };
        }
        match (efs, fsx) {
            (Some(id), _) => {
                // fs-ID, or fs-ID::fsap-ID to mount through an access point (which can own the
                // files as the pods' user, 1000).
                let ok = match id.split_once("::") {
                    Some((fs, ap)) => is_aws_id(fs, "fs-") && is_aws_id(ap, "fsap-"),
                    None => is_aws_id(&id, "fs-"),
                };
                if ok {
                    Ok(Some(StorageBackend::Efs { file_system_id: id }))
                } else {
                    Err(self.invalid(
                        "storage.efs",
                        "expected an EFS id such as fs-0123abcd, or fs-0123abcd::fsap-0123abcd \
                         for an access point"
                            .into(),
                    ))
                }
            }
            (None, Some(fsx)) => {
                let parts: Vec<&str> = fsx.split(',').map(str::trim).collect();
                match parts.as_slice() {
                    [id, dns, mount]
                        if is_aws_id(id, "fs-") && dns.contains('.') && !mount.is_empty() =>
                    {
                        Ok(Some(StorageBackend::Fsx {
                            file_system_id: id.to_string(),
                            dns_name: dns.to_string(),
                            mount_name: mount.to_string(),
                        }))
                    }
                    _ => Err(self.invalid(
                        "storage.fsx",
                        "expected FS_ID,DNS_NAME,MOUNT_NAME, e.g. \
                         fs-0123abcd,fs-0123abcd.fsx.us-west-2.amazonaws.com,abcdefgh"
                            .into(),
                    )),
                }
            }
            (None, None) => Ok(None),
        }
    }
}

impl Values<'_> {
    fn node_selector(&self) -> Result<Option<(String, String)>, ConfigError> {
        let Some(v) = self.optional("job.node_selector") else {
            return Ok(None);
        };
        if v == "none" {
            return Ok(None);
        }
        match v.split_once('=') {
            Some((k, val)) if !k.trim().is_empty() => {
                Ok(Some((k.trim().to_string(), val.trim().to_string())))
            }
            _ => Err(self.invalid(
                "job.node_selector",
                "expected KEY=VALUE (a node label), or none".into(),
            )),
        }
    }
}

fn flag_of(key: &str) -> String {
    setting(key).map_or_else(|| key.to_string(), |s| s.flag.to_string())
}

/// A DNS-1123 label of at most `max` characters.
pub fn is_dns_label(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_region(s: &str) -> bool {
    // us-west-2, eu-central-1, us-gov-west-1, ap-southeast-4 ...
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() >= 3
        && parts[..parts.len() - 1]
            .iter()
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_lowercase()))
        && parts[parts.len() - 1].parse::<u8>().is_ok()
}

pub fn is_aws_id(s: &str, prefix: &str) -> bool {
    s.strip_prefix(prefix)
        .is_some_and(|rest| !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric()))
}

/// A Kubernetes quantity: a decimal number with an optional SI or binary suffix.
pub fn is_quantity(s: &str) -> bool {
    const SUFFIXES: [&str; 14] = [
        "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "m", "k", "M", "G", "T", "P", "E", "",
    ];
    SUFFIXES.iter().any(|suffix| {
        s.strip_suffix(suffix).is_some_and(|n| {
            !n.is_empty()
                && n.parse::<f64>().is_ok_and(|x| x > 0.0 && x.is_finite())
                && n.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
    })
}

#[cfg(test)]
mod tests;
