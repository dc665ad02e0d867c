//! [`Launcher`]: how a job's pods are started, by name, with what the project's checks must
//! know of each (whether it runs `trainctl run`, keeps spares, ends with pods Pending, needs an
//! operator, refuses a job). What each renders and how its status is read live in
//! [`crate::launchers`], which reads the project; the project reads no launcher.

use super::Job;

/// How the workers of a job are started (`--launcher`, `job.launcher`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Launcher {
    /// A Kubernetes Indexed Job, no operator.
    #[default]
    Indexed,
    /// Kubeflow Training Operator v1's PyTorchJob.
    PyTorchJob,
    /// Kubeflow Trainer v2's TrainJob.
    TrainJob,
    /// MPI Operator's MPIJob, for an MPI program.
    MpiJob,
}

/// An operator a launcher needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operator {
    /// Who it is: "the Kubeflow training operator".
    pub name: &'static str,
    /// How to install it.
    pub install: &'static str,
    /// How to see whether its controller runs.
    pub check: &'static str,
}

impl Launcher {
    /// Every launcher, in the order `--help` lists them; the first is the default.
    pub const ALL: [Launcher; 4] = [
        Launcher::Indexed,
        Launcher::PyTorchJob,
        Launcher::TrainJob,
        Launcher::MpiJob,
    ];

    /// Its name for `--launcher` and `job.launcher`.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Indexed => "indexed",
            Launcher::PyTorchJob => "pytorchjob",
            Launcher::TrainJob => "trainjob",
            Launcher::MpiJob => "mpijob",
        }
    }

    /// What it is and what it needs, for the setting's help and errors.
    pub fn summary(self) -> &'static str {
        match self {
            Launcher::Indexed => "a Job, no operator",
            Launcher::PyTorchJob => "Kubeflow Training Operator v1's PyTorchJob",
            Launcher::TrainJob => "Kubeflow Trainer v2's TrainJob, elastic through trainctl",
            Launcher::MpiJob => "MPI Operator's MPIJob for an MPI program, not elastic",
        }
    }

    /// The launcher called `name`.
    pub fn parse(name: &str) -> Option<Launcher> {
        Launcher::ALL.into_iter().find(|l| l.name() == name)
    }

    /// `indexed (...), pytorchjob (...), ...`: the choices, for help and errors.
    pub fn choices() -> String {
        Launcher::ALL
            .map(|l| format!("{} ({})", l.name(), l.summary()))
            .join(", ")
    }

    /// Its training pods run `trainctl run` (an MPIJob's run mpirun and sshd).
    pub fn runs_trainctl(self) -> bool {
        self != Launcher::MpiJob
    }

    /// Whether its job can keep pods beyond `--nnodes` MAX as spares (`job.spares`): pods it
    /// renders itself, which no operator reconciles to a count of its own.
    pub fn keeps_spares(self) -> bool {
        self == Launcher::Indexed
    }

    /// Whether the job still ends when it trains with some of its pods never scheduled: then
    /// a MAX the cluster cannot hold yet is no reason to refuse the launch (the job starts at
    /// what fits and grows as room appears).
    pub fn ends_with_pods_pending(self) -> bool {
        self == Launcher::Indexed
    }

    /// The operator that serves its custom resources, if it needs one: what is missing when
    /// the cluster does not serve them, and how to install it (`cluster addons`).
    pub fn operator(self) -> Option<Operator> {
        match self {
            Launcher::Indexed => None,
            Launcher::PyTorchJob => Some(Operator {
                name: "the Kubeflow training operator",
                // The release whose CRD the PyTorchJobs are validated against (schemas/).
                install: concat!(
                    "The Kubeflow training operator is installed from its release manifests ",
                    "(kustomize), which trainctl does not vendor:\n  kubectl apply --server-side -k ",
                    "\"github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.0\""
                ),
                check: "kubectl get pods -A | grep training-operator",
            }),
            Launcher::TrainJob => Some(Operator {
                name: "Kubeflow Trainer v2",
                install: concat!(
                    "Kubeflow Trainer v2 (and JobSet, which it runs jobs with) is installed from its ",
                    "release manifests, which trainctl does not vendor:\n  kubectl apply --server-side ",
                    "-k \"github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0\"\n",
                    "trainctl's TrainJobs bring their own TrainingRuntime: the cluster's runtimes are ",
                    "not needed."
                ),
                check: "kubectl get pods -A | grep trainer-controller-manager",
            }),
            Launcher::MpiJob => Some(Operator {
                name: "the MPI Operator",
                install: concat!(
                    "The MPI Operator is installed from its release manifest, which trainctl does not ",
                    "vendor:\n  kubectl apply --server-side -f ",
                    "https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.6.0/deploy/v2beta1/mpi-operator.yaml"
                ),
                check: "kubectl get pods -A | grep mpi-operator",
            }),
        }
    }

    /// Why it cannot run this job, if it cannot (checked when the project is reviewed, so
    /// that the error names the setting).
    pub fn refuses(self, job: &Job) -> Option<String> {
        if self != Launcher::MpiJob {
            return None;
        }
        if job.command.is_none() {
            return Some(
                "an MPIJob runs an MPI program with mpirun, and the built-in trainer is not one \
                 (it forms its own group with trainctl run): pass your program with -- PROGRAM \
                 (or --command), or use --launcher indexed, pytorchjob or trainjob"
                    .into(),
            );
        }
        if job.is_elastic() {
            return Some(format!(
                "an MPIJob is not elastic (mpirun starts a fixed set of ranks) and --nnodes is \
                 {}: pass --nnodes {} for a fixed size, or use --launcher indexed or trainjob, \
                 which regroup in place",
                job.nnodes(),
                job.max_nodes
            ));
        }
        None
    }
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
