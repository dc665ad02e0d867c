//! [`Project`]: the resolved values checked and typed, what everything else reads.

use contract::choices::{HealthCheck, Model, Precision, Stragglers};

use crate::catalog::{InstanceType, Preset};

use super::values::Values;
use super::{
    ConfigError, Launcher, Layers, Resolved, SETTINGS, Source, is_dns_label, write_fields,
};

/// Where the job's rendezvous state lives: the backends of [`contract::rdzv::Backend`] a job
/// across pods can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RdzvBackend {
    /// trainctl's store, hosted by pod 0's agent.
    #[default]
    C10d,
    /// An etcd Deployment and Service next to the job.
    Etcd,
}

impl RdzvBackend {
    /// The backend as `trainctl run --rdzv-backend` names it.
    pub fn backend(self) -> contract::rdzv::Backend {
        match self {
            RdzvBackend::C10d => contract::rdzv::Backend::C10d,
            RdzvBackend::Etcd => contract::rdzv::Backend::Etcd,
        }
    }
}

/// Where the job's etcd keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EtcdStorage {
    /// An emptyDir: a restarted etcd pod starts empty (the agents then form a new round).
    #[default]
    EmptyDir,
    /// A folder of the shared claim: a restarted etcd pod has the job's state back.
    Claim,
}

/// The MPI an MPIJob's image runs (`--launcher mpijob`), as the MPI Operator names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MpiImplementation {
    #[default]
    OpenMpi,
    Intel,
    Mpich,
}

impl MpiImplementation {
    /// Its `job.mpi_implementation` value and the MPIJob's `mpiImplementation`.
    const ALL: [(MpiImplementation, &'static str, &'static str); 3] = [
        (MpiImplementation::OpenMpi, "openmpi", "OpenMPI"),
        (MpiImplementation::Intel, "intel", "Intel"),
        (MpiImplementation::Mpich, "mpich", "MPICH"),
    ];

    /// The MPIJob's `mpiImplementation`.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(m, ..)| *m == self)
            .map_or("OpenMPI", |(_, _, name)| name)
    }

    pub(super) fn parse(value: &str) -> Option<MpiImplementation> {
        Self::ALL
            .iter()
            .find(|(_, key, _)| *key == value)
            .map(|(m, ..)| *m)
    }
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

#[derive(Debug, Clone, Default)]
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

#[derive(Debug, Clone, Default)]
pub struct Storage {
    pub backend: Option<StorageBackend>,
    pub claim: String,
    pub size: String,
    pub mount_path: String,
}

#[derive(Debug, Clone, Default)]
pub struct Data {
    /// `cifar10` or `tiny-imagenet`.
    pub dataset: contract::Dataset,
    pub dir: String,
    pub url: String,
    pub md5: String,
    /// Stage from S3 instead of downloading `url`.
    pub from: Option<String>,
}

#[derive(Debug, Clone, Default)]
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
    /// Pods beyond `max_nodes` that wait warm as spares (`--launcher indexed`).
    pub spares: u32,
    /// Seconds without output after which a pod's workers are hung (`trainctl run
    /// --hang-timeout`); `None`: never.
    pub hang_timeout: Option<u32>,
    pub rdzv_port: u16,
    /// `None` when set to 0: no metrics endpoint, no annotations.
    pub metrics_port: Option<u16>,
    /// Kueue's LocalQueue: the job carries `kueue.x-k8s.io/queue-name`.
    pub queue: Option<String>,
    /// The user's program and its arguments; `None`: the built-in trainer.
    pub command: Option<Vec<String>>,
    /// The built-in trainer's network (`--model`).
    pub model: Model,
    /// The built-in trainer's `--precision`.
    pub precision: Precision,
    /// The built-in trainer's `--train-again` (`job launch --train-again`, not a setting: it
    /// is about one launch, not the project).
    pub train_again: bool,
    pub rdzv_backend: RdzvBackend,
    pub etcd_image: String,
    pub etcd_storage: EtcdStorage,
    /// `--launcher mpijob`: the image's MPI.
    pub mpi_implementation: MpiImplementation,
    /// `trainctl run --stragglers`.
    pub stragglers: Stragglers,
    /// `trainctl run --health-check`.
    pub health_check: HealthCheck,
    pub runs_dir: String,
    pub ttl_seconds: i32,
    /// Where rank 0 uploads the results (`trainctl train --upload`).
    pub upload: Option<String>,
    /// The program's code copied from S3 into each pod (`trainctl run --fetch`).
    pub fetch: Vec<String>,
}

impl Job {
    pub(crate) fn is_elastic(&self) -> bool {
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

    pub(crate) fn model_path(&self) -> String {
        format!("{}/{}", self.run_dir(), contract::run_files::MODEL)
    }
}

/// The whole project, checked.
#[derive(Debug, Clone, Default)]
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
    /// The values as resolved, each with its source: what a later check names when it refuses
    /// one ([`Project::review`]).
    pub(super) settings: Resolved,
}

/// Longest job name: pods are named `NAME-worker-INDEX` and must stay DNS labels (63).
pub const MAX_JOB_NAME: usize = 45;

impl Project {
    /// Checks and types every value; the first bad one is the error. Each value is checked
    /// by its row's parser, written into its field by its row ([`super::SETTINGS`]), then
    /// the fields several settings make are read, and what depends on several is reviewed.
    pub fn from_resolved(r: &Resolved) -> Result<Project, ConfigError> {
        let v = Values(r);
        for s in SETTINGS {
            if v.raw(s.key).is_some() {
                s.parse.check(&v, s.key)?;
            }
        }
        let mut p = Project {
            settings: r.clone(),
            ..Project::default()
        };
        write_fields(&mut p, &v)?;
        p.storage.backend = v.storage_backend()?;
        (p.job.min_nodes, p.job.max_nodes) = v.nnodes()?;
        p.cluster.zones_picked = matches!(
            v.raw("cluster.availability_zones"),
            Some((_, Source::Derived(_)))
        );
        p.check_across(&v)?;
        Ok(p)
    }

    /// What depends on more than one setting, or on what is named after a value.
    fn check_across(&self, v: &Values) -> Result<(), ConfigError> {
        let name = &self.cluster.name;
        if !is_dns_label(name, 100) || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
            return Err(v.invalid(
                "cluster.name",
                "not a valid cluster name: use lowercase letters, digits and '-', starting \
                 with a letter and ending with a letter or digit"
                    .into(),
            ));
        }
        let job = &self.job;
        if !is_dns_label(&job.name, MAX_JOB_NAME)
            || !job.name.starts_with(|c: char| c.is_ascii_lowercase())
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
        let instance = self.cluster.instance_type;
        if job.gpus_per_node > instance.gpus {
            return Err(v.invalid(
                "job.gpus_per_node",
                format!("{} has {} GPUs per node", instance.name, instance.gpus),
            ));
        }
        if job.metrics_port == Some(job.rdzv_port) {
            return Err(v.invalid(
                "job.metrics_port",
                format!(
                    "is the rendezvous port ({}); pick another, or 0 for none",
                    job.rdzv_port
                ),
            ));
        }
        if job.spares > 0 && !job.launcher.keeps_spares() {
            return Err(v.invalid(
                "job.spares",
                format!(
                    "spares wait as pods of an Indexed Job beyond its --nnodes maximum; --launcher {} \
                     has its operator keep the replicas it is given: use --launcher indexed, or \
                     --spares 0",
                    job.launcher
                ),
            ));
        }
        if !job.fetch.is_empty() && job.command.is_none() {
            return Err(v.invalid(
                "job.fetch",
                "fetches your program's code, but no program is set: give it with --command \
                 (or -- PROGRAM ARGS...)"
                    .into(),
            ));
        }
        if job.command.is_some()
            && job.launcher.runs_trainctl()
            && self.trainctl_image == self.image
            && matches!(v.raw("trainctl_image"), Some((_, Source::Derived(_))))
            && v.raw("image")
                .is_some_and(|(_, from)| *from != Source::Default)
        {
            return Err(v.invalid(
                "image",
                format!(
                    "runs your program ({}), and nothing says where trainctl comes from: give \
                     --trainctl-image with trainctl's image (an init container copies the binary \
                     into the pods), or --trainctl-image {} if this image has trainctl \
                     in it (docs/KUBERNETES.md, \"Your own image\")",
                    v.str("job.command")?,
                    self.image
                ),
            ));
        }
        Ok(())
    }

    /// Where the value of setting `key` came from.
    pub fn source(&self, key: &str) -> Option<&Source> {
        self.settings.values.get(key).map(|(_, source)| source)
    }

    /// The GPUs and EFA adapters each training pod takes: the job's GPUs per node and, on
    /// instances with EFA, every adapter of the node. None for the built-in trainer, which
    /// trains on CPUs only: a GPU it held would sit idle, kept from every other pod.
    pub fn accelerators(&self) -> (u32, u32) {
        if self.job.command.is_none() {
            return (0, 0);
        }
        let gpus = self.job.gpus_per_node;
        let instance = self.cluster.instance_type;
        let adapters = if gpus > 0 && instance.supports_efa() {
            instance.efa_interfaces
        } else {
            0
        };
        (gpus, adapters)
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
