//! `--launcher mpijob`: MPI Operator's `MPIJob` (`kubeflow.org/v2beta1`) for `-- PROGRAM` run by
//! mpirun: a launcher pod runs `mpirun -np NODES×SLOTS PROGRAM...` once every worker is ready
//! (`launcherCreationPolicy: WaitForWorkersReady`, so mpirun never starts before the workers
//! resolve), the workers run sshd. The pods run as uid 1000, as the MPI Operator's own images'
//! `mpiuser`, whose home the SSH keys are mounted in.
//!
//! Not elastic: mpirun starts a fixed set of ranks, and a lost one ends the run (the operator
//! restarts the launcher up to the backoff limit). Neither `trainctl run` nor its rendezvous is
//! in these pods, so the built-in trainer cannot run here.

use std::collections::BTreeMap;

use kube::api::{ApiResource, DynamicObject};
use serde::{Deserialize, Serialize};

use crate::config::{Launcher, Project};
use crate::manifests::{Manifest, object_meta};
use crate::status::JobStatus;

use super::Kind;
use super::pytorchjob::{ReplicaSpec, RunPolicy};
use super::training::{Token, mpi_template, queue_label};

/// Where the operator mounts the SSH keys: the MPI Operator images' non-root user's home.
pub(super) const SSH_AUTH_MOUNT_PATH: &str = "/home/mpiuser/.ssh";
/// The workers' command: sshd in the foreground, with the non-root configuration the MPI
/// Operator's images carry (a port and host keys a non-root user can use).
pub(super) const WORKER_COMMAND: &[&str] =
    &["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct MpiJobSpec {
    pub slots_per_worker: u32,
    pub run_policy: RunPolicy,
    pub mpi_implementation: String,
    pub launcher_creation_policy: String,
    pub ssh_auth_mount_path: String,
    pub mpi_replica_specs: BTreeMap<String, ReplicaSpec>,
}

custom_resource!(
    MpiJobObject,
    MpiJobSpec,
    "kubeflow.org",
    "v2beta1",
    "MPIJob",
    "mpijobs"
);

pub struct MpiJob;

impl Kind for MpiJob {
    fn launcher(&self) -> Launcher {
        Launcher::MpiJob
    }

    fn resources(&self) -> Vec<ApiResource> {
        vec![ApiResource::erase::<MpiJobObject>(&())]
    }

    fn render(&self, project: &Project, _token: Token) -> Vec<Manifest> {
        let j = &project.job;
        let program = j.command.clone().unwrap_or_default();
        let ranks = j.max_nodes.saturating_mul(j.nproc_per_node);
        let mut mpirun: Vec<String> = vec!["mpirun".into(), "-np".into(), ranks.to_string()];
        mpirun.extend(program);
        let workers: Vec<String> = WORKER_COMMAND.iter().map(|s| s.to_string()).collect();
        let mut metadata = object_meta(project, &j.name, "worker");
        queue_label(project, &mut metadata);
        let job = MpiJobObject {
            metadata,
            spec: MpiJobSpec {
                slots_per_worker: j.nproc_per_node,
                run_policy: RunPolicy {
                    clean_pod_policy: "Running".into(),
                    ttl_seconds_after_finished: j.ttl_seconds,
                    backoff_limit: j.max_restarts as i32,
                },
                mpi_implementation: j.mpi_implementation.name().into(),
                launcher_creation_policy: "WaitForWorkersReady".into(),
                ssh_auth_mount_path: SSH_AUTH_MOUNT_PATH.into(),
                mpi_replica_specs: BTreeMap::from([
                    (
                        "Launcher".into(),
                        ReplicaSpec {
                            replicas: 1,
                            // A failed mpirun is retried in a new pod, up to backoffLimit; the
                            // failed one stays, with its termination message and logs.
                            restart_policy: "Never".into(),
                            template: mpi_template(project, "launcher", mpirun, false),
                        },
                    ),
                    (
                        "Worker".into(),
                        ReplicaSpec {
                            replicas: j.max_nodes,
                            restart_policy: "Never".into(),
                            template: mpi_template(project, "worker", workers, true),
                        },
                    ),
                ]),
            },
        };
        vec![Manifest::of(&job)]
    }

    fn rdzv_host(&self, project: &Project) -> String {
        // No rendezvous: the launcher reaches the workers by the operator's hostfile.
        format!("{}-worker-0", project.job.name)
    }

    fn status(&self, object: &DynamicObject) -> JobStatus {
        JobStatus::from_conditions(object, "MPIJob", "Succeeded", Launcher::MpiJob.operator())
    }

    fn pod_job_label(&self) -> &'static str {
        "training.kubeflow.org/job-name"
    }

    fn scales(&self) -> Result<(), &'static str> {
        Err(
            "mpirun starts every rank once, on the hosts it was given at launch: an MPI world \
             cannot grow or shrink; launch with --launcher indexed to scale in place",
        )
    }
}
