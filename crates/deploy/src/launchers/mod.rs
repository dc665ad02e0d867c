//! How a training job's pods are started on Kubernetes: one module per kind of launcher, each
//! behind [`Kind`], found from the project's [`Launcher`] by [`kind`]; [`KINDS`] lists them
//! for what reads a job back from the cluster.
//!
//! Adding a launcher is a variant of [`Launcher`] (its name and what the project's checks
//! must know of it, in `config`) and one file here implementing [`Kind`] (its objects, the API
//! resource the job is served at, its status), named in [`kind`]. Nothing else names a kind:
//! rendering, launching, `job status|logs|wait|delete` and `cluster addons` go through them.
//! Custom resources are typed structs ([`custom_resource!`]), so no code compares kind
//! strings. [`training`] holds what every launcher builds its job from.

#[macro_use]
mod crd;
mod indexed;
mod mpijob;
mod pytorchjob;
mod training;
mod trainjob;

use kube::api::{ApiResource, DynamicObject};

use contract::argv::RunFlag;

use crate::config::{Launcher, Project};
use crate::manifests::Manifest;
use crate::status::JobStatus;

pub use indexed::Indexed;
pub use mpijob::MpiJob;
pub use pytorchjob::PyTorchJob;
pub use training::{
    Token, rdzv_host, token_secret, token_secret_name, training_job, worker_run_args,
};
pub use trainjob::TrainJob;

/// Every launcher, in [`Launcher::ALL`]'s order.
pub static KINDS: &[&dyn Kind] = &[&Indexed, &PyTorchJob, &TrainJob, &MpiJob];

/// The launcher the project names.
pub fn kind(launcher: Launcher) -> &'static dyn Kind {
    match launcher {
        Launcher::Indexed => &Indexed,
        Launcher::PyTorchJob => &PyTorchJob,
        Launcher::TrainJob => &TrainJob,
        Launcher::MpiJob => &MpiJob,
    }
}

/// One way of starting a training job's pods.
pub trait Kind: Sync {
    /// Which launcher it is.
    fn launcher(&self) -> Launcher;

    /// Its name for `--launcher` and `job.launcher`.
    fn name(&self) -> &'static str {
        self.launcher().name()
    }

    /// The API resources of what it renders, the job's own first: `job delete` removes them,
    /// and finds the job by the first.
    fn resources(&self) -> Vec<ApiResource>;

    /// The job's objects in the order they are applied: what the pods need first, the job
    /// last.
    fn render(&self, project: &Project, token: Token) -> Vec<Manifest>;

    /// The stable DNS name of the job's first pod, where the c10d store lives.
    fn rdzv_host(&self, project: &Project) -> String;

    /// What tells the pods' `trainctl run` its nodes, rendezvous and restarts: the flags by
    /// default; an operator that injects torchrun's `PET_*` variables may leave some out.
    fn node_flags(&self, project: &Project) -> Vec<RunFlag> {
        training::node_flags(project)
    }

    /// Its pods run in a Job of trainctl's (podFailurePolicy, per-index backoff), which needs a
    /// server of 1.[`crate::kube_api::MIN_KUBERNETES_MINOR`] or later.
    fn runs_a_job(&self) -> bool {
        false
    }

    /// The job's state, read from the object the API server returned.
    fn status(&self, object: &DynamicObject) -> JobStatus;

    /// The label each of the job's pods carries with the job's name.
    fn pod_job_label(&self) -> &'static str;

    /// Whether a running job of this kind can change its number of nodes in place (`job
    /// scale`), and why not when it cannot.
    fn scales(&self) -> Result<(), &'static str>;

    /// The number of nodes a running job asks for now, read from its object.
    fn size(&self, _object: &DynamicObject) -> Option<u32> {
        None
    }

    /// The JSON merge patch that asks for `nodes` nodes (only where [`Kind::scales`]).
    fn size_patch(&self, _nodes: u32) -> Option<serde_json::Value> {
        None
    }
}

/// The launcher whose objects include one served at `resource`.
pub fn serving(resource: &ApiResource) -> Option<&'static dyn Kind> {
    KINDS
        .iter()
        .copied()
        .find(|k| k.resources().iter().any(|r| r == resource))
}

/// Whether `resource` is a custom resource (an operator's, served only where its CRD is
/// installed), not one of Kubernetes' own.
pub(crate) fn is_custom(resource: &ApiResource) -> bool {
    resource.group.contains('.')
}

/// Whether `doc` is a training job itself (not what it owns).
pub(crate) fn is_job(doc: &Manifest) -> bool {
    KINDS.iter().any(|k| k.resources()[0] == *doc.resource())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `patch` applied to `doc` as the API server applies a JSON merge patch (RFC 7386).
    fn merge(doc: &mut serde_json::Value, patch: &serde_json::Value) {
        match (doc, patch) {
            (serde_json::Value::Object(d), serde_json::Value::Object(p)) => {
                for (k, v) in p {
                    merge(d.entry(k.clone()).or_insert(serde_json::Value::Null), v);
                }
            }
            (d, p) => *d = p.clone(),
        }
    }

    /// Every launcher that scales reads back the size its own patch sets, starting from the
    /// size it rendered (MAX); the others say why not and name the launcher that can.
    #[test]
    fn a_scaling_launchers_patch_sets_the_size_it_reads() {
        for kind in KINDS {
            let project = crate::config::Project::from_settings(&[
                ("storage.efs", "fs-1"),
                ("job.nnodes", "2:4"),
                ("job.launcher", kind.name()),
            ])
            .unwrap();
            let docs = kind.render(&project, Token::Withheld);
            let job = docs.iter().find(|d| is_job(d)).unwrap();
            let object: DynamicObject = serde_json::from_value((**job).clone()).unwrap();
            match kind.scales() {
                Ok(()) => {
                    assert_eq!(kind.size(&object), Some(4), "{}", kind.name());
                    let patch = kind.size_patch(3).unwrap();
                    let mut doc = serde_json::to_value(&object).unwrap();
                    merge(&mut doc, &patch);
                    let object: DynamicObject = serde_json::from_value(doc).unwrap();
                    assert_eq!(kind.size(&object), Some(3), "{}", kind.name());
                    assert_eq!(
                        object.metadata.annotations.unwrap()[crate::manifests::NNODES_ANNOTATION],
                        "2:4"
                    );
                }
                Err(why) => {
                    assert!(kind.size_patch(3).is_none(), "{}", kind.name());
                    assert!(why.contains("--launcher indexed"), "{}: {why}", kind.name());
                }
            }
        }
    }

    #[test]
    fn names_and_resources_are_unique() {
        let mut names: Vec<&str> = KINDS.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), KINDS.len());
        for (k, launcher) in KINDS.iter().zip(Launcher::ALL) {
            assert_eq!(k.launcher(), launcher);
            assert_eq!(kind(launcher).name(), k.name());
            assert_eq!(serving(&k.resources()[0]).map(|f| f.name()), Some(k.name()));
        }
    }
}
