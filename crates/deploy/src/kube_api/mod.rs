//! Applying the rendered objects and watching jobs, through the Kubernetes API (kube-rs).
//!
//! Every call goes through one [`kube::Client`], so the tests give it a mock service (kube-rs's
//! tower-test pattern) and the CLI one made from KUBECONFIG or the pod's service account.
//! API errors become [`ApiError`]s that say what to do: a missing CRD names the operator to
//! install, a missing metrics API names metrics-server, a refused request names the permission.

mod error;
mod launch;
mod logs;
mod scale;
mod top;

pub use crate::config::{bytes, millicores};
pub use crate::status::{Condition, JobStatus, Phase, PodStatus, Round, last_round};
pub use error::ApiError;
pub use launch::MIN_KUBERNETES_MINOR;
pub use scale::{ScaleError, Scaled};
pub use top::{Top, Usage};

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams,
    PropagationPolicy,
};

use crate::status::{self, node_problem};
use error::{CLUSTER, api_error, is_not_found};

use crate::launchers::is_custom;
use crate::manifests::{self, Manifest};

/// A client that cannot be built from a kubeconfig: its TLS material (client certificate and
/// key, CA) is what fails there.
fn unusable_credentials(e: kube::Error) -> ApiError {
    ApiError::Unreachable(format!(
        "the kubeconfig's TLS settings cannot be used ({}): check its client-certificate-data, \
         client-key-data and certificate-authority-data (a key that does not match its \
         certificate, or a file cut short, reads as an invalid key)",
        error::error_chain(&e)
    ))
}

/// The API of the cluster, in one namespace.
#[derive(Clone)]
pub struct Kube {
    client: Client,
    namespace: String,
    /// How often `wait` and `logs --follow` look at the job again.
    poll: Duration,
}

/// What `apply` did to one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub kind: String,
    pub name: String,
}

impl Applied {
    fn of(doc: &Manifest) -> Applied {
        Applied {
            kind: doc.kind().to_string(),
            name: doc.name().to_string(),
        }
    }
}

impl Kube {
    pub fn new(client: Client, namespace: &str) -> Kube {
        Kube {
            client,
            namespace: namespace.into(),
            poll: Duration::from_secs(2),
        }
    }

    /// Looks at a job every `poll` when waiting or following (default 2 s).
    pub fn with_poll(self, poll: Duration) -> Kube {
        Kube { poll, ..self }
    }

    /// A client from `kubeconfig` (KUBECONFIG's value: files separated by `:`, merged, those that
    /// do not exist skipped as kubectl skips them), else ~/.kube/config, else the pod's service
    /// account.
    pub async fn connect(
        namespace: &str,
        kubeconfig: Option<&std::ffi::OsStr>,
    ) -> Result<Kube, ApiError> {
        let paths: Vec<std::path::PathBuf> = kubeconfig
            .map(|v| {
                std::env::split_paths(v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_default();
        if paths.is_empty() {
            let client = Client::try_default()
                .await
                .map_err(|e| ApiError::Unreachable(error::error_chain(&e)))?;
            return Ok(Kube::new(client, namespace));
        }
        let unreadable = |e: kube::config::KubeconfigError| {
            ApiError::Unreachable(format!("reading KUBECONFIG: {e}"))
        };
        let existing: Vec<_> = paths.iter().filter(|p| p.exists()).collect();
        let config = if existing.is_empty() {
            // As kubectl and kube-rs do without a kubeconfig: the pod's service account.
            kube::Config::incluster().map_err(|_| {
                ApiError::Unreachable(format!(
                    "KUBECONFIG names no file that exists ({}), and this is not a pod with a \
                     service account",
                    paths
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?
        } else {
            let mut merged = kube::config::Kubeconfig::default();
            for path in existing {
                merged = merged
                    .merge(kube::config::Kubeconfig::read_from(path).map_err(unreadable)?)
                    .map_err(unreadable)?;
            }
            kube::Config::from_custom_kubeconfig(
                merged,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(unreadable)?
        };
        let client = Client::try_from(config).map_err(unusable_credentials)?;
        Ok(Kube::new(client, namespace))
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The namespace for [`api_error`] of a call on a namespaced or a cluster-scoped object.
    fn scope(&self, namespaced: bool) -> &str {
        if namespaced { &self.namespace } else { CLUSTER }
    }

    fn no_job(&self, name: &str) -> ApiError {
        ApiError::NoJob {
            name: name.into(),
            namespace: self.namespace.clone(),
        }
    }

    /// The job `name`, which must exist.
    async fn require_job(&self, name: &str) -> Result<JobStatus, ApiError> {
        self.find_job(name).await?.ok_or_else(|| self.no_job(name))
    }

    fn api(&self, resource: &ApiResource, namespaced: bool) -> Api<DynamicObject> {
        if namespaced {
            Api::namespaced_with(self.client.clone(), &self.namespace, resource)
        } else {
            Api::all_with(self.client.clone(), resource)
        }
    }

    /// The job `name`, of whichever launcher ([`crate::launchers::KINDS`]), or None.
    async fn find_job(&self, name: &str) -> Result<Option<JobStatus>, ApiError> {
        Ok(self
            .find_object(name)
            .await?
            .map(|(kind, job)| kind.status(&job)))
    }

    /// The object of job `name` and its launcher, or None.
    async fn find_object(
        &self,
        name: &str,
    ) -> Result<Option<(&'static dyn crate::launchers::Kind, DynamicObject)>, ApiError> {
        for kind in crate::launchers::KINDS.iter().copied() {
            let resource = &kind.resources()[0];
            match self.api(resource, true).get_opt(name).await {
                Ok(Some(job)) => return Ok(Some((kind, job))),
                Ok(None) => {}
                // Not served (no CRD): then there is no such job either.
                Err(e) if is_not_found(&e) && is_custom(resource) => {}
                Err(e) => {
                    let what = format!("get {} {name}", resource.kind);
                    return Err(api_error(&what, &self.namespace, e));
                }
            }
        }
        Ok(None)
    }

    /// The job, its conditions, its pods and the pods beside it (its etcd, TensorBoard).
    pub async fn status(&self, name: &str) -> Result<JobStatus, ApiError> {
        let mut status = self.require_job(name).await?;
        (status.pods, status.companions) = self.pods_and_companions(name).await?;
        self.mark_lost_nodes(status.pods.iter_mut().chain(status.companions.iter_mut()))
            .await;
        status.settle();
        Ok(status)
    }

    /// The latest rendezvous round the job's running training pods say they joined (the
    /// last `round R: node rank N of M` line of each one's recent output), into `status`: the
    /// size the job trains at. A pod whose log cannot be read is left out.
    pub async fn read_training_round(&self, status: &mut JobStatus) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut latest: Option<Round> = None;
        for pod in &mut status.pods {
            if pod.phase != "Running" || pod.leaving || pod.node_problem.is_some() {
                continue;
            }
            let params = kube::api::LogParams {
                container: Some(pod.container.clone()),
                tail_lines: Some(2000),
                ..kube::api::LogParams::default()
            };
            let Ok(log) = pods.logs(&pod.name, &params).await else {
                continue;
            };
            if status::waits_as_a_spare(&log) {
                pod.spare = true;
                pod.why = status::SPARE.into();
                continue;
            }
            if let Some(round) = last_round(&log)
                && latest.is_none_or(|l| round.round > l.round)
            {
                latest = Some(round);
            }
        }
        status.training = latest;
    }

    /// A pod on a node that is NotReady (its kubelet stopped reporting) still reads Running and
    /// ready: say that it cannot be reached, not that it failed, since a kubelet that is down
    /// for a while leaves the containers running (they train on, and the job may well succeed).
    /// A pod whose node is gone has lost its workers. Where nodes cannot be read (RBAC), pods
    /// stay as the API server reports them.
    async fn mark_lost_nodes(&self, pods: impl Iterator<Item = &mut PodStatus>) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let mut known: BTreeMap<String, Option<(String, &str)>> = BTreeMap::new();
        for pod in pods {
            let Some(node) = pod.node.clone() else {
                continue;
            };
            if !known.contains_key(&node) {
                let problem = match nodes.get_opt(&node).await {
                    Ok(None) => Some((
                        format!("node {node} is gone"),
                        "this pod's workers are lost",
                    )),
                    Ok(Some(n)) => node_problem(&n).map(|p| {
                        (
                            format!("node {node} {p}"),
                            "unreachable; its workers may still be running",
                        )
                    }),
                    Err(_) => None,
                };
                known.insert(node.clone(), problem);
            }
            if let Some(Some((problem, meaning))) = known.get(&node)
                && pod.phase == "Running"
            {
                pod.ready = false;
                let said = format!("{problem}: {meaning}");
                pod.why = if pod.why.is_empty() {
                    said
                } else {
                    format!("{said}; {}", pod.why)
                };
                pod.node_problem = Some(problem.clone());
            }
        }
    }

    /// The pods of job `name`, by node index.
    async fn pods(&self, name: &str) -> Result<Vec<PodStatus>, ApiError> {
        let mut pods = self.pods_and_companions(name).await?.0;
        self.mark_lost_nodes(pods.iter_mut()).await;
        Ok(pods)
    }

    /// The pods of job `name` by node index, and the pods of its etcd and TensorBoard.
    async fn pods_and_companions(
        &self,
        name: &str,
    ) -> Result<(Vec<PodStatus>, Vec<PodStatus>), ApiError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        // The data, test and doctor jobs' pods carry the training job's label, so select on
        // what every trainctl pod has and keep the pods of job `name` itself.
        let selector = format!("{}={}", manifests::MANAGED_BY.0, manifests::MANAGED_BY.1);
        let list = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| api_error("list pods", &self.namespace, e))?;
        let mut out: Vec<PodStatus> = list
            .items
            .iter()
            .filter(|p| owned_by(p, name))
            .map(PodStatus::from_pod)
            .collect();
        out.sort_by(|a, b| (a.index, &a.name).cmp(&(b.index, &b.name)));
        let mut companions: Vec<PodStatus> = list
            .items
            .iter()
            .filter(|p| companion_of(p, name))
            .map(PodStatus::from_pod)
            .collect();
        companions.sort_by(|a, b| a.name.cmp(&b.name));
        Ok((out, companions))
    }

    /// Polls until the job succeeds (Ok) or fails (Err), up to `timeout`.
    pub async fn wait(&self, name: &str, timeout: Duration) -> Result<JobStatus, ApiError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let status = self.status(name).await?;
            if status.phase.is_finished() || tokio::time::Instant::now() >= deadline {
                if status.phase.is_finished() {
                    return Ok(status);
                }
                let mut state = status.phase.to_string();
                for p in status.pods.iter().filter(|p| !p.why.is_empty()) {
                    let _ = write!(state, "; {}: {}", p.name, p.why);
                }
                if let Some(unreconciled) = status.unreconciled() {
                    let _ = write!(state, "; {unreconciled}");
                }
                return Err(ApiError::WaitTimeout {
                    name: name.into(),
                    namespace: self.namespace.clone(),
                    after: timeout,
                    state,
                });
            }
            tokio::time::sleep(self.poll).await;
        }
    }

    /// Deletes the job `name` and everything labelled with it (its Service, token Secret, pods,
    /// etcd, TensorBoard, and its data, test and doctor jobs), but never the storage: the claim
    /// holds the data set, the checkpoints and the model.
    pub async fn delete(&self, name: &str) -> Result<Vec<Applied>, ApiError> {
        let deleted = self.delete_matching(&manifests::job_selector(name)).await?;
        if deleted.is_empty() {
            return Err(self.no_job(name));
        }
        Ok(deleted)
    }

    /// Deletes the jobs, Deployments (etcd, TensorBoard), Services and Secrets that `selector`
    /// matches, jobs first. Everything is listed before anything is deleted: the job's own
    /// objects are owned by it, so the garbage collector may remove them before their turn,
    /// and they are still reported (they went with their job), whatever the collector's pace.
    pub async fn delete_matching(&self, selector: &str) -> Result<Vec<Applied>, ApiError> {
        let params = delete_with_pods();
        let mut deleted = Vec::new();
        // The jobs first, so that their workers stop before their etcd, Service and token go.
        // Every launcher's objects (the custom resources first, as the table lists them),
        // then the helper Jobs and what jobs own.
        let mut kinds: Vec<ApiResource> = Vec::new();
        for kind in crate::launchers::KINDS.iter().rev() {
            for resource in kind.resources() {
                if !kinds.contains(&resource) {
                    kinds.push(resource);
                }
            }
        }
        kinds.sort_by_key(|r| !is_custom(r));
        kinds.extend([
            ApiResource::erase::<Deployment>(&()),
            ApiResource::erase::<Service>(&()),
            ApiResource::erase::<Secret>(&()),
        ]);
        let mut found = Vec::new();
        for resource in kinds {
            let api = self.api(&resource, true);
            let list = match api.list(&ListParams::default().labels(selector)).await {
                Ok(list) => list,
                // A custom resource this cluster does not serve: none to delete.
                Err(e) if is_not_found(&e) && is_custom(&resource) => continue,
                Err(e) => {
                    let plural = &resource.plural;
                    return Err(api_error(&format!("list {plural}"), &self.namespace, e));
                }
            };
            let names: Vec<String> = list
                .items
                .into_iter()
                .filter_map(|object| object.metadata.name)
                .collect();
            found.push((resource, api, names));
        }
        for (resource, api, names) in found {
            for object_name in names {
                match api.delete(&object_name, &params).await {
                    // Not found: gone already, deleted with its owner by the garbage collector.
                    Ok(_) => {}
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => {
                        return Err(api_error(
                            &format!("delete {} {object_name}", resource.kind),
                            &self.namespace,
                            e,
                        ));
                    }
                }
                deleted.push(Applied {
                    kind: resource.kind.clone(),
                    name: object_name,
                });
            }
        }
        Ok(deleted)
    }

    /// Scales the etcd of a finished job (succeeded or failed) to zero: nothing rendezvouses
    /// any more, and it would otherwise run until the job's `ttlSecondsAfterFinished` takes it
    /// with the job. The Deployment and its Service stay, for `job delete` and the TTL to
    /// remove (`kubectl scale --replicas 1` brings the etcd back, with its keys when they are on
    /// the claim). Does nothing while the job runs or when no etcd pod is left; returns the
    /// Deployments it scaled.
    pub async fn stop_etcd_if_finished(&self, job: &JobStatus) -> Result<Vec<Applied>, ApiError> {
        if !job.phase.is_finished() || !job.companions.iter().any(|p| p.component == "etcd") {
            return Ok(Vec::new());
        }
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &self.namespace);
        let selector = format!(
            "{}={},{}=etcd",
            manifests::JOB_LABEL,
            job.name,
            manifests::COMPONENT_LABEL
        );
        let list = deployments
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| api_error("list deployments", &self.namespace, e))?;
        let mut stopped = Vec::new();
        for deployment in list.items {
            let Some(name) = deployment.metadata.name else {
                continue;
            };
            if deployment.spec.and_then(|s| s.replicas) == Some(0) {
                continue;
            }
            let zero = Patch::Merge(serde_json::json!({ "spec": { "replicas": 0 } }));
            match deployments
                .patch_scale(&name, &PatchParams::default(), &zero)
                .await
            {
                Ok(_) => stopped.push(Applied {
                    kind: "Deployment".into(),
                    name,
                }),
                Err(e) if is_not_found(&e) => {}
                Err(e) => {
                    let what = format!("scale Deployment {name} to 0");
                    return Err(api_error(&what, &self.namespace, e));
                }
            }
        }
        Ok(stopped)
    }

    /// Makes room for a helper job (data, test, doctor) called `name`: a finished one from
    /// before is deleted, and this waits until it is gone. Returns false when one is still
    /// running, which the caller then waits for instead of starting another.
    pub async fn clear_finished(&self, name: &str) -> Result<bool, ApiError> {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        let what = format!("replace Job {name}");
        let Some(job) = jobs
            .get_opt(name)
            .await
            .map_err(|e| api_error(&what, &self.namespace, e))?
        else {
            return Ok(true);
        };
        if !JobStatus::from_job(&job).phase.is_finished() {
            return Ok(false);
        }
        let params = delete_with_pods();
        match jobs.delete(name, &params).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => return Ok(true),
            Err(e) => return Err(api_error(&what, &self.namespace, e)),
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            match jobs.get_opt(name).await {
                Ok(None) => return Ok(true),
                Ok(Some(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(self.poll).await;
                }
                Ok(Some(_)) => {
                    return Err(ApiError::Other {
                        what,
                        message: "the finished Job was not gone after 60 s".into(),
                    });
                }
                Err(e) => return Err(api_error(&what, &self.namespace, e)),
            }
        }
    }
}

/// Deletes that take the objects' pods with them (a Job's default would orphan them).
fn delete_with_pods() -> DeleteParams {
    DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    }
}

/// Whether pod `p` belongs to job `name` itself (not its data, test or doctor job): it carries
/// the job's name under its launcher's label (a Job's pods also under the older `job-name`).
fn owned_by(p: &Pod, name: &str) -> bool {
    let labels = p.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    label("job-name") == Some(name)
        || crate::launchers::KINDS
            .iter()
            .any(|k| label(k.pod_job_label()) == Some(name))
}

/// Whether pod `p` runs beside job `name`: its etcd or its TensorBoard.
fn companion_of(p: &Pod, name: &str) -> bool {
    let labels = p.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    label(manifests::JOB_LABEL) == Some(name)
        && matches!(
            label(manifests::COMPONENT_LABEL),
            Some("etcd" | "tensorboard")
        )
}
