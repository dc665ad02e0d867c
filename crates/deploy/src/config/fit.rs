//! Whether what a command renders can run where it is sent, said before anything is rendered:
//! what can never work is refused (a [`ConfigError`], a bad command line), what may not is
//! warned about, each with the figures.
//!
//! The figures are the catalog's: an instance type's vCPUs, memory and GPUs, and what trainctl
//! expects one node of it to have left for pods ([`pod_size`](super::layers::pod_size): the
//! kubelet, the system daemons and the DaemonSets take the rest; the default requests). They
//! say something about the nodes only when the training pods are pinned to that instance type
//! (the default node selector); with another selector, or `none`, the pods go wherever the
//! cluster has room, which `job launch` asks the cluster itself about.

use crate::catalog::{INSTANCE_TYPE_LABEL, InstanceType};

use super::layers::pod_size;
use super::values::{Values, bytes, millicores};
use super::{ConfigError, DEFAULT_IMAGE, Project, Source};

/// What a command renders, for [`Project::review`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renders {
    /// `job render|launch`: the training pods.
    TrainingJob,
    /// `doctor`: pods on the training nodes, with what a training pod takes.
    Doctor,
    /// `data job`, `test job`: one small pod of trainctl's image.
    HelperJob,
}

const GIB: u64 = 1 << 30;

impl Project {
    /// What is wrong with rendering `what` for this project: `Err` when it can never run (a
    /// request larger than a node; more pods than the node group holds), else the warnings to
    /// print (each one line, saying why and what to do).
    pub fn review(&self, what: Renders) -> Result<Vec<String>, ConfigError> {
        let mut warnings = Vec::new();
        let image = match what {
            Renders::TrainingJob => &self.image,
            Renders::Doctor | Renders::HelperJob => &self.trainctl_image,
        };
        if *image == DEFAULT_IMAGE && self.source("image") == Some(&Source::Default) {
            warnings.push(format!(
                "image {DEFAULT_IMAGE} is the default, which no registry serves: build trainctl's \
                 image (docker build -t REGISTRY/trainctl:TAG .), push it where the nodes pull \
                 from and name it with --image (setting image, TRAINCTL_IMAGE); on kind, `kind \
                 load docker-image {DEFAULT_IMAGE}` puts it on the nodes instead"
            ));
        }
        if matches!(what, Renders::TrainingJob | Renders::Doctor) {
            warnings.extend(self.idle_accelerators());
        }
        if what == Renders::TrainingJob {
            if let Some(why) = self.job.launcher.refuses(&self.job) {
                return Err(ConfigError::Invalid {
                    key: "job.launcher",
                    value: self.job.launcher.to_string(),
                    from: self
                        .source("job.launcher")
                        .cloned()
                        .unwrap_or(Source::Default),
                    problem: why,
                });
            }
            warnings.extend(self.training_pods_fit()?);
        }
        Ok(warnings)
    }

    /// The built-in trainer on a GPU instance: its pods take no GPUs (it trains on CPUs only),
    /// which is said, with how to use them.
    fn idle_accelerators(&self) -> Option<String> {
        let t = self.cluster.instance_type;
        if self.job.command.is_some() || t.gpus == 0 || self.job.gpus_per_node == 0 {
            return None;
        }
        let efa = match t.efa_interfaces {
            0 => String::new(),
            1 => " or its EFA adapter".into(),
            n => format!(" or its {n} EFA adapters"),
        };
        Some(format!(
            "the built-in trainer trains on CPUs only, so its pods (and the doctor's) request none \
             of a {name} node's {gpus} GPUs{efa}, which would sit idle; to train on them, run your \
             own program: `trainctl job launch -- PROGRAM ARGS...` (or job.command in \
             trainctl.toml)",
            name = t.name,
            gpus = t.gpus,
        ))
    }

    /// The training pods against the nodes they are pinned to: a request larger than a node
    /// is refused, one larger than what a node has left for pods is warned about, and a job
    /// needing more pods than `cluster.nodes` nodes hold is refused, unless it is elastic, its
    /// MIN fits and its launcher ends the job with pods still Pending (an Indexed Job's
    /// successPolicy): a PyTorchJob ends only when every pod has, so pods that cannot be
    /// placed would wait for the others to finish and then start alone.
    fn training_pods_fit(&self) -> Result<Vec<String>, ConfigError> {
        let t = self.cluster.instance_type;
        let pinned = self
            .job
            .node_selector
            .as_ref()
            .is_some_and(|(k, v)| k == INSTANCE_TYPE_LABEL && v == t.name);
        let (Some(cpu), Some(memory)) = (millicores(&self.job.cpu), bytes(&self.job.memory)) else {
            return Ok(Vec::new());
        };
        if !pinned || cpu == 0 || memory == 0 {
            return Ok(Vec::new());
        }
        let v = Values(&self.settings);
        let (left_cpu, left_memory) = left_for_pods(t);
        let mut warnings = Vec::new();
        if cpu > u64::from(t.vcpus) * 1000 {
            return Err(v.invalid(
                "job.cpu",
                format!(
                    "a {} node has {} vCPUs, so no node of the instance type can run a pod that \
                     asks for {}; ask for at most {} (what one has left for pods: the default), or \
                     pick a larger --instance-type",
                    t.name,
                    t.vcpus,
                    self.job.cpu,
                    cores(left_cpu)
                ),
            ));
        }
        if memory > u64::from(t.memory_gib) * GIB {
            return Err(v.invalid(
                "job.memory",
                format!(
                    "a {} node has {} GiB of memory, so no node of the instance type can run a pod \
                     that asks for {}; ask for at most {}Gi (what one has left for pods: the \
                     default), or pick a larger --instance-type",
                    t.name,
                    t.memory_gib,
                    self.job.memory,
                    left_memory / GIB
                ),
            ));
        }
        if cpu > left_cpu {
            warnings.push(format!(
                "job.cpu = {} is more than a {} node is expected to have left for pods ({} of its \
                 {} vCPUs; the kubelet, the system daemons and the DaemonSets take the rest), so \
                 the pods may stay Pending; `kubectl describe node` shows a node's allocatable \
                 CPU, and --cpu {} fits",
                self.job.cpu,
                t.name,
                cores(left_cpu),
                t.vcpus,
                cores(left_cpu)
            ));
        }
        if memory > left_memory {
            warnings.push(format!(
                "job.memory = {} is more than a {} node is expected to have left for pods ({}Gi of \
                 its {} GiB), so the pods may stay Pending; `kubectl describe node` shows a \
                 node's allocatable memory, and --memory {}Gi fits",
                self.job.memory,
                t.name,
                left_memory / GIB,
                t.memory_gib,
                left_memory / GIB
            ));
        }
        // How many pods one node holds (at least one: a pod between the estimate and the
        // node's size was warned about above and may fit).
        let (gpus, _) = self.accelerators();
        let mut per_node = (left_cpu / cpu).min(left_memory / memory);
        if let Some(by_gpus) = t.gpus.checked_div(gpus) {
            per_node = per_node.min(u64::from(by_gpus));
        }
        let per_node = per_node.max(1);
        warnings.extend(self.pods_against_room(per_node, gpus)?);
        Ok(warnings)
    }

    /// The job's pods against what `cluster.nodes` nodes of `per_node` pods hold: a warning
    /// when an elastic Indexed Job starts with fewer (it grows as room appears), a refusal
    /// when the job could not end (a fixed size, a MIN that does not fit, a PyTorchJob).
    fn pods_against_room(&self, per_node: u64, gpus: u32) -> Result<Option<String>, ConfigError> {
        let t = self.cluster.instance_type;
        let v = Values(&self.settings);
        let room = u64::from(self.cluster.nodes) * per_node;
        let pods = u64::from(self.job.max_nodes);
        let min = u64::from(self.job.min_nodes);
        if pods > room && self.job.launcher.ends_with_pods_pending() && min <= room {
            // An elastic job that ends whatever its size: it starts with the pods that fit and
            // the others join as room appears (a node the autoscaler adds, one freed).
            let warning = format!(
                "{pods} pods of {} CPU and {} memory, but {} {} nodes (cluster.nodes) hold \
                 {room} ({per_node} a node): the job starts with the pods that fit (at least \
                 --nnodes MIN = {min}) and the others wait Pending, joining the training as \
                 room appears; `trainctl job status` shows them and why they wait",
                self.job.cpu, self.job.memory, self.cluster.nodes, t.name
            );
            return Ok(Some(warning));
        }
        if pods > room {
            let fits = if self.job.is_elastic() && u64::from(self.job.min_nodes) <= room {
                format!("{}:{room}", self.job.min_nodes)
            } else {
                room.to_string()
            };
            let accelerators = if gpus > 0 {
                format!(" and {gpus} GPUs")
            } else {
                String::new()
            };
            return Err(v.invalid(
                "job.nnodes",
                format!(
                    "{pods} pods of {} CPU and {} memory{accelerators}, but {} {} nodes \
                     (cluster.nodes: the node group's maximum size) hold {room} ({per_node} a \
                     node): the pods that do not fit would wait for the others to finish, then \
                     start alone, and the job would not end; give --nnodes {fits}, a smaller \
                     --cpu and --memory, or --nodes {} if the node group has that many",
                    self.job.cpu,
                    self.job.memory,
                    self.cluster.nodes,
                    t.name,
                    pods.div_ceil(per_node)
                ),
            ));
        }
        Ok(None)
    }
}

/// What one node of `t` is expected to have left for pods: millicores and bytes (the default
/// requests, which fill it).
fn left_for_pods(t: &InstanceType) -> (u64, u64) {
    let (cpu, memory, _) = pod_size(t);
    (
        millicores(&cpu).unwrap_or_default(),
        bytes(&memory).unwrap_or_default(),
    )
}

/// Millicores as a CPU quantity: `13`, `13500m`.
fn cores(millis: u64) -> String {
    if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{millis}m")
    }
}
