//! [`Project`]: the resolved values checked and typed, what everything else reads.

use crate::catalog::{InstanceType, Preset};

use super::values::Values;
use super::{ConfigError, Layers, Resolved, SETTINGS, Source, is_dns_label};

/// Where the job's rendezvous state lives: the backends of [`contract::rdzv::Backend`] a job
/// across pods can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdzvBackend {
    /// trainctl's store, hosted by pod 0's agent.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtcdStorage {
    /// An emptyDir: a restarted etcd pod starts empty (the agents then form a new round).
    EmptyDir,
    /// A folder of the shared claim: a restarted etcd pod has the job's state back.
    Claim,
}

/// How the workers of a job are started: one of [`crate::launchers::KINDS`].
pub use crate::launchers::Launcher;

/// The MPI an MPIJob's image runs (`--launcher mpijob`), as the MPI Operator names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiImplementation {
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

    fn parse(value: &str) -> Option<MpiImplementation> {
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
    pub model: String,
    /// The built-in trainer's `--precision`: `fp32` or `bf16`.
    pub precision: String,
    /// The built-in trainer's `--train-again` (`job launch --train-again`, not a setting: it
    /// is about one launch, not the project).
    pub train_again: bool,
    pub rdzv_backend: RdzvBackend,
    pub etcd_image: String,
    pub etcd_storage: EtcdStorage,
    /// `--launcher mpijob`: the image's MPI.
    pub mpi_implementation: MpiImplementation,
    /// `trainctl run --stragglers`: `warn` or `evict`.
    pub stragglers: String,
    /// `trainctl run --health-check`: `warn`, `refuse` or `off`.
    pub health_check: String,
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
        format!("{}/{}", self.run_dir(), contract::run_files::MODEL)
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
    /// The values as resolved, each with its source: what a later check names when it refuses
    /// one ([`Project::review`]).
    pub(super) settings: Resolved,
}

/// Longest job name: pods are named `NAME-worker-INDEX` and must stay DNS labels (63).
pub const MAX_JOB_NAME: usize = 45;

impl Project {
    /// Checks and types every value; the first bad one is the error.
    pub fn from_resolved(r: &Resolved) -> Result<Project, ConfigError> {
        let v = Values(r);
        // Each value as its row says (`SETTINGS`); the reads below rely on it.
        for s in SETTINGS {
            if v.raw(s.key).is_some() {
                s.parse.check(&v, s.key)?;
            }
        }
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
        let nodes = v.number("cluster.nodes")?;
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
            region: v.str("cluster.region")?,
            version: v.str("cluster.version")?,
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
            claim: v.str("storage.claim")?,
            size: v.str("storage.size")?,
            mount_path: v.str("storage.mount_path")?,
        };
        let data = Data {
            dataset: v.str("data.dataset")?,
            dir: v.str("data.dir")?,
            url: v.str("data.url")?,
            md5: v.str("data.md5")?,
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
        let launcher = match crate::launchers::find(&v.str("job.launcher")?) {
            Some(kind) => Launcher::of(kind),
            None => {
                return Err(v.invalid(
                    "job.launcher",
                    format!("choose {}", crate::launchers::choices()),
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
            nproc_per_node: v.number("job.nproc_per_node")?,
            gpus_per_node,
            node_selector: v.node_selector()?,
            cpu: v.str("job.cpu")?,
            memory: v.str("job.memory")?,
            shm_size: v.str("job.shm_size")?,
            epochs: v.number("job.epochs")?,
            batch_size: v.number("job.batch_size")?,
            learning_rate: v.number::<f64>("job.learning_rate")?,
            max_restarts: v.number("job.max_restarts")?,
            hang_timeout: match v.optional("job.hang_timeout").as_deref() {
                None | Some("none") => None,
                Some(_) => Some(v.number("job.hang_timeout")?),
            },
            rdzv_port: v.number::<u16>("job.rdzv_port")?,
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
                Some(_) => Some(v.str("job.queue")?),
            },
            command: v.command()?,
            model: v.str("job.model")?,
            rdzv_backend: match v.str("job.rdzv_backend")?.parse() {
                Ok(contract::rdzv::Backend::C10d) => RdzvBackend::C10d,
                Ok(contract::rdzv::Backend::Etcd) => RdzvBackend::Etcd,
                _ => {
                    return Err(v.invalid(
                        "job.rdzv_backend",
                        "choose c10d (the store in pod 0) or etcd (an etcd next to the job)".into(),
                    ));
                }
            },
            etcd_image: v.str("job.etcd_image")?,
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
            mpi_implementation: match MpiImplementation::parse(&v.str("job.mpi_implementation")?) {
                Some(m) => m,
                None => {
                    return Err(v.invalid(
                        "job.mpi_implementation",
                        "choose openmpi, intel or mpich (what the image's mpirun is)".into(),
                    ));
                }
            },
            stragglers: v.str("job.stragglers")?,
            precision: v.str("job.precision")?,
            train_again: false,
            health_check: v.str("job.health_check")?,
            runs_dir: v.str("job.runs_dir")?,
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
        let image = v.str("image")?;
        let trainctl_image = v.str("trainctl_image")?;
        if job.command.is_some()
            && job.launcher.runs_trainctl()
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
            tensorboard_image: v.str("tensorboard.image")?,
            namespace: v.str("namespace")?,
            service_account: match v.optional("service_account").as_deref() {
                None | Some("none") => None,
                Some(_) => Some(v.str("service_account")?),
            },
            storage,
            data,
            job,
            settings: r.clone(),
        })
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
