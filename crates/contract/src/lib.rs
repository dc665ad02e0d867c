//! What several of trainctl's crates must agree on, written once: the exit codes the launcher,
//! the workers and the Kubernetes failure policy read the same way, the worker environment's
//! names, the default ports, the names of the settings' choices ([`choices`]) and the data sets with their official
//! archives, and the `trainctl run ... train ...` command line that deploy renders into pods
//! and the CLI parses back ([`argv`]).
//!
//! Invariant: this crate depends on nothing, so that every crate can depend on it; a value two
//! crates must keep equal lives here, not in a copy kept equal by a test.

pub mod argv;
pub mod choices;

/// Exit codes with a meaning beyond "failed".
pub mod exit {
    /// A worker whose peer vanished (its connection closed): the failure is somebody else's,
    /// so the elastic agent restarts without counting it against `--max-restarts`
    /// (EX_TEMPFAIL: "try again").
    pub const PEER_LOST: i32 = 75;
    /// A worker (or `trainctl run`) that was asked to stop (SIGTERM: an eviction, a spot
    /// interruption, a deleted job) and saved a checkpoint at the step it finished first: not a
    /// failure, and nothing to redo, so the elastic agent does not count it and Kubernetes
    /// retries it without counting. It is 128 + SIGTERM, the code a process stopped by SIGTERM
    /// conventionally ends with, which Kubeflow's `ExitCode` restart policy retries; a worker
    /// *killed* by the signal reports the signal instead, and is counted.
    pub const PREEMPTED: i32 = 128 + 15;
    /// A worker that found the job cannot train right (trainctl.torch's `UsageError`: a loop
    /// it cannot make exact; `DivergedError`: the ranks' states parted): the same program
    /// would fail the same way again, so no launcher retries it and the job fails at once, on
    /// every node, with it as the root cause. One above [`PEER_LOST`], which is always retried.
    pub const UNRECOVERABLE: i32 = 76;
    /// Codes no retry can fix: `trainctl`'s own (the job failed past its restarts (1), the
    /// command line is wrong (2)) and the shell's for a program that cannot run at all (126:
    /// not executable; 127: not found, or the binary's loader lacks a library). A Kubernetes
    /// job fails at once on them instead of retrying to its backoff limit.
    pub const PERMANENT: [i32; 4] = [1, 2, 126, 127];
    /// What a node evicted as a straggler (`trainctl run --stragglers evict`, which then exits
    /// with [`PREEMPTED`]) writes in its termination message, by which `job status` tells it
    /// from a node that left on a SIGTERM (whose message is its last log lines).
    pub const EVICTED: &str = "evicted as a straggler";
}

/// Names of the environment variables a worker receives: torchrun's, and trainctl's own.
/// The launcher writes them; `collective::world` is the one module that reads them.
pub mod env {
    pub const RANK: &str = "RANK";
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    pub const GROUP_RANK: &str = "GROUP_RANK";
    pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
    pub const ROLE_RANK: &str = "ROLE_RANK";
    pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    pub const MASTER_PORT: &str = "MASTER_PORT";
    pub const RUN_ID: &str = "TORCHELASTIC_RUN_ID";
    pub const RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
    pub const MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
    /// Where a worker's `@record` (torch.distributed.elastic) writes the exception that ended
    /// it, as JSON; one file per worker and attempt.
    pub const ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
    /// Set to 1 for the launcher to serve torch.distributed.elastic's file-based timers.
    pub const ENABLE_FILE_TIMER: &str = "TORCHELASTIC_ENABLE_FILE_TIMER";
    /// The named pipe the workers' `FileTimerClient` writes its requests to.
    pub const TIMER_FILE: &str = "TORCHELASTIC_TIMER_FILE";
    pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
    /// trainctl's own: the secret every collective connection must present (from the job's
    /// Secret on Kubernetes).
    pub const JOB_TOKEN: &str = "TRAINCTL_JOB_TOKEN";
    /// trainctl's own: seconds after which a silent peer is an error.
    pub const COLLECTIVE_TIMEOUT: &str = "TRAINCTL_COLLECTIVE_TIMEOUT";
    /// trainctl's own: a file descriptor (a pipe to `trainctl run`) the worker writes its
    /// metrics records to, one JSON line each, for the agent's progress bar and `/metrics`.
    pub const TELEMETRY_FD: &str = "TRAINCTL_TELEMETRY_FD";
    /// Set by the kubelet in every pod: what to do after a stop is said the Kubernetes way.
    pub const KUBERNETES_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";
    /// trainctl's own: a file descriptor (a Unix socket to the elastic agent) over which a
    /// worker that can regroup in place hears of the next round instead of being restarted.
    pub const CONTROL_FD: &str = "TRAINCTL_CONTROL_FD";
    /// trainctl's own: what the node's health check measured before it joined,
    /// `GEMM_MFLOPS,LOOPBACK_MBPS`, for the worker's start record.
    pub const NODE_HEALTH: &str = "TRAINCTL_NODE_HEALTH";
    /// trainctl's own: set to 1 for a worker started before its node has a place in the job
    /// (a warm start): it has no RANK, WORLD_SIZE, GROUP_RANK or MASTER_* yet, runs its start
    /// (the built-in trainer: data and model; trainctl.torch: up to `Elastic(...)`), says it is
    /// ready over the control channel and waits there for its round's environment.
    pub const WARM_START: &str = "TRAINCTL_WARM_WORKER";
}

/// The rendezvous backends, named once: `trainctl run --rdzv-backend`, a project's
/// `job.rdzv_backend`, a pod's command line and a PyTorchJob's `rdzvBackend` all parse and
/// print them through this enum.
pub mod rdzv {
    /// A rendezvous backend.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Backend {
        /// Fixed nodes (`--node-rank`, `--master-addr`): no rendezvous.
        Static,
        /// trainctl's store, hosted by the agent whose host is the endpoint.
        C10d,
        /// etcd's v3 API.
        Etcd,
        /// torchrun's name for etcd's v2 API, which trainctl refuses with what to use instead.
        EtcdV2,
    }

    impl Backend {
        pub const ALL: [Backend; 4] = [
            Backend::Static,
            Backend::C10d,
            Backend::Etcd,
            Backend::EtcdV2,
        ];
        /// Every name, in [`Backend::ALL`]'s order.
        pub const NAMES: [&'static str; 4] = ["static", "c10d", "etcd", "etcd-v2"];

        pub fn name(self) -> &'static str {
            match self {
                Backend::Static => Self::NAMES[0],
                Backend::C10d => Self::NAMES[1],
                Backend::Etcd => Self::NAMES[2],
                Backend::EtcdV2 => Self::NAMES[3],
            }
        }
    }

    impl std::fmt::Display for Backend {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.name())
        }
    }

    /// A name that is no backend.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Unknown(pub String);

    impl std::fmt::Display for Unknown {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "{:?} is not a rendezvous backend (known: {})",
                self.0,
                Backend::NAMES.join(", ")
            )
        }
    }

    impl std::error::Error for Unknown {}

    impl std::str::FromStr for Backend {
        type Err = Unknown;
        fn from_str(s: &str) -> Result<Self, Unknown> {
            Backend::ALL
                .into_iter()
                .find(|b| b.name() == s)
                .ok_or_else(|| Unknown(s.to_string()))
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_backend_parses_back_from_its_name() {
            for b in Backend::ALL {
                assert_eq!(b.name().parse::<Backend>(), Ok(b));
                assert_eq!(b.to_string(), b.name());
            }
            let err = "etc".parse::<Backend>().unwrap_err().to_string();
            assert!(
                err.contains("\"etc\"") && err.contains("c10d, etcd"),
                "{err}"
            );
        }
    }
}

/// Default ports.
pub mod ports {
    /// The workers' store on rank 0 (torchrun's `--master-port`).
    pub const MASTER: u16 = 29500;
    /// The c10d rendezvous store (`--rdzv-endpoint HOST` without a port; a job's `rdzv_port`).
    pub const C10D: u16 = 29400;
    /// etcd's client port (`--rdzv-backend etcd`).
    pub const ETCD: u16 = 2379;
    /// `trainctl run --metrics-port` in a job's pods (Prometheus' scrape port).
    pub const METRICS: u16 = 9464;
}

/// The built-in trainer's defaults (the reference job), written once: `trainctl train`'s flags
/// and a project's `job.*` settings both read them, as text, the form both parse.
pub mod train_defaults {
    /// Passes over the training set.
    pub const EPOCHS: &str = "10";
    /// Images per step on each worker.
    pub const BATCH_SIZE: &str = "128";
    /// SGD's learning rate.
    pub const LEARNING_RATE: &str = "0.001";
}

/// A data set the trainer downloads when the data folder holds none (`--dataset`), and its
/// official archive.
/// The files of a run's folder (`OUT/RUN_ID/`) that the trainer writes and the other commands
/// (eval, predict, the Kubernetes side, uploads) look for.
pub mod run_files {
    /// The trained model (safetensors).
    pub const MODEL: &str = "model.safetensors";
    /// What a run resumes from.
    pub const CHECKPOINT: &str = "checkpoint.ckpt";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dataset {
    /// `--dataset` / `data.dataset`.
    pub name: &'static str,
    /// Other spellings `--dataset` takes.
    pub aliases: &'static [&'static str],
    /// What it is, for messages.
    pub what: &'static str,
    /// The archive's file name (also under which a staged copy is found).
    pub file: &'static str,
    pub url: &'static str,
    /// Lower-case hex.
    pub md5: &'static str,
    pub size: u64,
}

pub const CIFAR10: Dataset = Dataset {
    name: "cifar10",
    aliases: &["cifar-10"],
    what: "CIFAR-10",
    file: "cifar-10-binary.tar.gz",
    url: "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    md5: "c32a1d4ab5d03f1284b67883e8d87530",
    size: 170_052_171,
};

pub const TINY_IMAGENET: Dataset = Dataset {
    name: "tiny-imagenet",
    aliases: &["tiny-imagenet-200"],
    what: "tiny-imagenet-200",
    file: "tiny-imagenet-200.zip",
    url: "http://cs231n.stanford.edu/tiny-imagenet-200.zip",
    md5: "90528d7ca1a48142e341f4ef8d21d0de",
    // As torchvision's download progress reports it (`248100043/248100043`).
    size: 248_100_043,
};

/// Where CIFAR-10 is found in a data folder: in the folder itself or in the folder either
/// official archive extracts to, in the binary layout (`data_batch_1.bin` ...) or the python
/// one (pickled `data_batch_1` ...). The trainer loads what it finds there; `trainctl doctor`
/// looks for the same.
pub mod cifar10 {
    /// The folder the binary archive extracts to.
    pub const BIN_DIR: &str = "cifar-10-batches-bin";
    /// The folder the python archive extracts to.
    pub const PY_DIR: &str = "cifar-10-batches-py";
    /// Where to look, in order: the data folder itself, then each archive's folder in it.
    pub fn folders(data: &std::path::Path) -> [std::path::PathBuf; 3] {
        [data.to_path_buf(), data.join(BIN_DIR), data.join(PY_DIR)]
    }
    /// The file that says a folder holds the binary layout.
    pub const BINARY_MARK: &str = "data_batch_1.bin";
    /// The file that says a folder holds the python layout.
    pub const PYTHON_MARK: &str = "data_batch_1";
}

/// Every data set `--dataset` knows, the default first.
pub const DATASETS: [Dataset; 2] = [CIFAR10, TINY_IMAGENET];

/// For messages.
pub const DATASET_CHOICES: &str = "cifar10 or tiny-imagenet";

/// CIFAR-10: the reference job's, every command's default.
impl Default for Dataset {
    fn default() -> Dataset {
        CIFAR10
    }
}

impl Dataset {
    /// By name or alias.
    pub fn parse(name: &str) -> Option<Dataset> {
        DATASETS
            .into_iter()
            .find(|d| d.name == name || d.aliases.contains(&name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_data_set_parses_by_name_and_alias_and_the_choices_name_them_all() {
        for d in DATASETS {
            assert_eq!(Dataset::parse(d.name), Some(d));
            for alias in d.aliases {
                assert_eq!(Dataset::parse(alias), Some(d));
            }
            assert!(DATASET_CHOICES.contains(d.name));
        }
        assert_eq!(Dataset::parse("imagenet"), None);
    }
}
