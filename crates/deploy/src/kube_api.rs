//! Applying the rendered objects and watching jobs, through the Kubernetes API (kube-rs).
//!
//! Every call goes through one [`kube::Client`], so the tests give it a mock service (kube-rs's
//! tower-test pattern) and the CLI one made from KUBECONFIG or the pod's service account.
//! API errors become [`ApiError`]s that say what to do: a missing CRD names the operator to
//! install, a missing metrics API names metrics-server, a refused request names the permission.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use futures::{AsyncBufReadExt, StreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, LogParams, Patch,
    PatchParams, PropagationPolicy,
};
use serde::Deserialize;
use serde_json::Value;

use crate::manifests::{self, CONTAINER};

/// What went wrong talking to the cluster, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(
        "cannot reach the Kubernetes API: {0}; check KUBECONFIG and its current context, \
         or run inside a pod with a service account"
    )]
    Unreachable(String),
    #[error("the cluster does not serve {api} ({what}); {hint}")]
    NotServed {
        what: String,
        api: String,
        hint: String,
    },
    #[error(
        "the metrics API (metrics.k8s.io) is not served, so there is no CPU or memory usage to \
         show: install metrics-server (`trainctl cluster addons` on EKS) and try again a minute \
         after it starts"
    )]
    MetricsMissing,
    #[error(
        "{what}: forbidden: {message}; your identity needs RBAC permission for this {}",
        scope_words(namespace)
    )]
    Forbidden {
        what: String,
        message: String,
        /// Empty for cluster-scoped objects.
        namespace: String,
    },
    #[error(
        "{what}: the cluster does not accept your credentials (401 {message}): the token in your \
         kubeconfig may have expired; refresh it (EKS: `aws eks update-kubeconfig --name \
         CLUSTER`, or log in to AWS again), and check the current context (`kubectl config \
         current-context`)"
    )]
    Unauthorized { what: String, message: String },
    #[error(
        "job {name} already exists in namespace {namespace} ({state}); delete it first with \
         `trainctl job delete --name {name}`, or give another --name"
    )]
    Exists {
        name: String,
        namespace: String,
        state: String,
    },
    #[error(
        "no job {name} in namespace {namespace}; `trainctl job launch` starts one (check --name \
         and --namespace)"
    )]
    NoJob { name: String, namespace: String },
    #[error("{what}: the API server answered {code} {reason}: {message}")]
    Api {
        what: String,
        code: u16,
        reason: String,
        message: String,
    },
    #[error("{what}: {message}")]
    Other { what: String, message: String },
    #[error(
        "PersistentVolume {volume} is bound to claim {claim} in namespace {bound}, so a claim in \
         namespace {namespace} could never bind it: use --namespace {bound}, or move the storage \
         (`kubectl delete pvc {claim} -n {bound} && kubectl delete pv {volume}`, which keeps the \
         data: the volume's reclaim policy is Retain) and run `trainctl storage` again"
    )]
    StorageElsewhere {
        volume: String,
        claim: String,
        bound: String,
        namespace: String,
    },
    #[error(
        "{what} exists with other settings that cannot be changed in place ({message}); nothing \
         was changed. To replace the storage, stop the jobs that use it, remove it (`{undo}`; the \
         data stays on the file system: the reclaim policy is Retain) and run `trainctl storage` \
         again"
    )]
    StorageChange {
        what: String,
        message: String,
        undo: String,
    },
    #[error(
        "no pod of job {name} has started yet, so there are no logs ({pods}); `trainctl job \
         status --name {name} --namespace {namespace}` shows where it stands"
    )]
    NoLogsYet {
        name: String,
        namespace: String,
        pods: String,
    },
    #[error(
        "the cluster runs Kubernetes {version}; trainctl's training Job needs 1.{MIN_KUBERNETES_MINOR} \
         or later (podFailurePolicy, which retries evictions without counting them): upgrade the \
         cluster (EKS: `eksctl upgrade cluster`), or use --launcher pytorchjob"
    )]
    TooOld { version: String },
    #[error(
        "namespace {namespace} does not exist: create it (`kubectl create namespace {namespace}`) \
         or pass another --namespace"
    )]
    NoNamespace { namespace: String },
    #[error("{cause}; {undone}")]
    RolledBack {
        cause: Box<ApiError>,
        /// What was removed, and what could not be.
        undone: String,
    },
    #[error(
        "job {name} did not finish within {after:?} (still {state}); `trainctl job status --name \
         {name} --namespace {namespace}` shows where it stands"
    )]
    WaitTimeout {
        name: String,
        namespace: String,
        after: Duration,
        state: String,
    },
}

/// The namespace argument of [`api_error`] for cluster-scoped calls.
const CLUSTER: &str = "";

fn scope_words(namespace: &str) -> String {
    if namespace.is_empty() {
        "at the cluster scope (a ClusterRole)".into()
    } else {
        format!("in namespace {namespace}")
    }
}

/// Turns a kube error into an [`ApiError`] for the action `what` in `namespace` ([`CLUSTER`]
/// for cluster-scoped objects).
fn api_error(what: &str, namespace: &str, e: kube::Error) -> ApiError {
    match e {
        kube::Error::Api(status) if status.code == 401 => ApiError::Unauthorized {
            what: what.into(),
            message: status.message,
        },
        kube::Error::Api(status) if status.code == 403 => ApiError::Forbidden {
            what: what.into(),
            message: status.message,
            namespace: namespace.into(),
        },
        // The API server names the namespace as what was not found when it is the namespace
        // that is missing.
        kube::Error::Api(status)
            if status.code == 404
                && !namespace.is_empty()
                && status
                    .details
                    .as_ref()
                    .is_some_and(|d| d.kind == "namespaces" && d.name == namespace) =>
        {
            ApiError::NoNamespace {
                namespace: namespace.into(),
            }
        }
        kube::Error::Api(status) => ApiError::Api {
            what: what.into(),
            code: status.code,
            reason: status.reason,
            message: status.message,
        },
        kube::Error::HyperError(e) => ApiError::Unreachable(connect_problem(&e)),
        kube::Error::Service(e) => ApiError::Unreachable(connect_problem(e.as_ref())),
        kube::Error::Auth(e) => ApiError::Unreachable(format!(
            "the credentials in your kubeconfig cannot be used: {}",
            error_chain(&e)
        )),
        other => ApiError::Other {
            what: what.into(),
            message: error_chain(&other),
        },
    }
}

/// An error and its sources, outermost first: `client error (Connect): invalid peer
/// certificate: UnknownIssuer`, not just `client error (Connect)`.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// What a failed connection to the API server means, with its whole chain of causes.
fn connect_problem(e: &(dyn std::error::Error + 'static)) -> String {
    let chain = error_chain(e);
    let lower = chain.to_ascii_lowercase();
    let meaning = if lower.contains("certificate") || lower.contains("unknownissuer") {
        "the server's TLS certificate is not one your kubeconfig trusts (its \
         certificate-authority-data is for another cluster, or the server's certificate \
         changed): fetch the kubeconfig again"
    } else if lower.contains("connection refused") {
        "nothing listens at the API server's address: is the cluster up, and is the kubeconfig's \
         server address right?"
    } else if lower.contains("dns error") || lower.contains("failed to lookup") {
        "the API server's host name does not resolve: check the kubeconfig's server address and \
         your network"
    } else if lower.contains("timed out") || lower.contains("deadline") {
        "the API server did not answer in time: check your network, VPN or the cluster's \
         endpoint access (EKS private endpoints answer only inside the VPC)"
    } else {
        "the connection to the API server failed"
    };
    format!("{meaning} ({chain})")
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// The training operator release whose CRD the PyTorchJobs are validated against.
pub const TRAINING_OPERATOR_VERSION: &str = "v1.9.0";

/// The kinds trainctl renders: group, version, kind, plural, namespaced.
const KINDS: &[(&str, &str, &str, &str, bool)] = &[
    ("", "v1", "Secret", "secrets", true),
    ("", "v1", "Service", "services", true),
    ("", "v1", "PersistentVolume", "persistentvolumes", false),
    (
        "",
        "v1",
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
        true,
    ),
    (
        "storage.k8s.io",
        "v1",
        "StorageClass",
        "storageclasses",
        false,
    ),
    ("batch", "v1", "Job", "jobs", true),
    ("apps", "v1", "DaemonSet", "daemonsets", true),
    ("apps", "v1", "Deployment", "deployments", true),
    ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs", true),
];

fn resource_of(doc: &Value) -> Option<(ApiResource, bool)> {
    let api_version = doc["apiVersion"].as_str()?;
    let kind = doc["kind"].as_str()?;
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    KINDS
        .iter()
        .find(|(g, v, k, _, _)| *g == group && *v == version && *k == kind)
        .map(|(g, v, k, plural, namespaced)| {
            let gvk = GroupVersionKind::gvk(g, v, k);
            (ApiResource::from_gvk_with_plural(&gvk, plural), *namespaced)
        })
}

fn pytorchjob_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubeflow.org", "v1", "PyTorchJob"),
        "pytorchjobs",
    )
}

/// The oldest Kubernetes minor version (1.x) the training Job's fields work on: podFailurePolicy
/// (with the DisruptionTarget condition) is on by default from 1.26; Indexed Jobs since 1.24.
pub const MIN_KUBERNETES_MINOR: u32 = 26;

/// The minor version of a Kubernetes 1.x server (`minor` may carry a suffix: EKS says "30+").
fn minor_version(major: &str, minor: &str) -> Option<u32> {
    if major != "1" {
        return None;
    }
    let digits: String = minor.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn operator_missing(what: &str) -> ApiError {
    ApiError::NotServed {
        what: what.into(),
        api: "kubeflow.org/v1 PyTorchJob".into(),
        hint: "install the Kubeflow training operator (`trainctl cluster addons --launcher \
               pytorchjob` says how), or use --launcher indexed"
            .into(),
    }
}

fn is_job_kind(doc: &Value) -> bool {
    matches!(doc["kind"].as_str(), Some("Job" | "PyTorchJob"))
}

/// An owner reference to the applied job `object` (rendered as `doc`), when it has a uid.
fn owner_reference(doc: &Value, object: &DynamicObject) -> Option<Value> {
    let uid = object.metadata.uid.as_deref()?;
    Some(serde_json::json!({
        "apiVersion": doc["apiVersion"],
        "kind": doc["kind"],
        "name": doc["metadata"]["name"],
        "uid": uid,
    }))
}

/// The commands that remove the storage objects `docs` (claim first), for a change that cannot
/// be applied in place.
fn storage_undo(docs: &[Value], namespace: &str) -> String {
    let name = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind)
            .and_then(|d| d["metadata"]["name"].as_str())
            .map(str::to_string)
    };
    let mut steps = Vec::new();
    if let Some(claim) = name("PersistentVolumeClaim") {
        steps.push(format!("kubectl delete pvc {claim} -n {namespace}"));
    }
    if let Some(volume) = name("PersistentVolume") {
        steps.push(format!("kubectl delete pv {volume}"));
    }
    steps.join(" && ")
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
    fn of(doc: &Value) -> Applied {
        Applied {
            kind: doc["kind"].as_str().unwrap_or("?").to_string(),
            name: doc["metadata"]["name"].as_str().unwrap_or("?").to_string(),
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
        let client = if paths.is_empty() {
            Client::try_default()
                .await
                .map_err(|e| ApiError::Unreachable(format!("{e:#}")))?
        } else {
            let unreadable = |e: kube::config::KubeconfigError| {
                ApiError::Unreachable(format!("reading KUBECONFIG: {e}"))
            };
            let existing: Vec<_> = paths.iter().filter(|p| p.exists()).collect();
            if existing.is_empty() {
                // As kubectl and kube-rs do without a kubeconfig: the pod's service account.
                let config = kube::Config::incluster().map_err(|_| {
                    ApiError::Unreachable(format!(
                        "KUBECONFIG names no file that exists ({}), and this is not a pod with \
                         a service account",
                        paths
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?;
                let client = Client::try_from(config)
                    .map_err(|e| ApiError::Unreachable(format!("{e:#}")))?;
                return Ok(Kube::new(client, namespace));
            }
            let mut merged = kube::config::Kubeconfig::default();
            for path in existing {
                merged = merged
                    .merge(kube::config::Kubeconfig::read_from(path).map_err(unreadable)?)
                    .map_err(unreadable)?;
            }
            let config = kube::Config::from_custom_kubeconfig(
                merged,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(unreadable)?;
            Client::try_from(config).map_err(|e| ApiError::Unreachable(format!("{e:#}")))?
        };
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

    /// Server-side applies `docs` in order (field manager `trainctl`): creating what is missing,
    /// updating what trainctl made before.
    pub async fn apply(&self, docs: &[Value]) -> Result<Vec<Applied>, ApiError> {
        let mut applied = Vec::new();
        for doc in docs {
            self.apply_one(doc).await?;
            applied.push(Applied::of(doc));
        }
        Ok(applied)
    }

    /// Applies the storage objects (StorageClass, PersistentVolume, claim) only if all of them
    /// can be: a volume bound to a claim in another namespace, or a change the API server
    /// refuses (a volume's source or a claim's size are immutable), is said with what to delete
    /// first, before anything is written.
    pub async fn apply_storage(&self, docs: &[Value]) -> Result<Vec<Applied>, ApiError> {
        if let Some(volume) = docs.iter().find(|d| d["kind"] == "PersistentVolume") {
            let name = volume["metadata"]["name"].as_str().unwrap_or_default();
            let volumes: Api<k8s_openapi::api::core::v1::PersistentVolume> =
                Api::all(self.client.clone());
            let existing = volumes
                .get_opt(name)
                .await
                .map_err(|e| api_error(&format!("get PersistentVolume {name}"), CLUSTER, e))?;
            let claim = existing
                .and_then(|v| v.spec)
                .and_then(|s| s.claim_ref)
                .and_then(|c| Some((c.namespace?, c.name?)));
            if let Some((namespace, claim)) = claim
                && namespace != self.namespace
            {
                return Err(ApiError::StorageElsewhere {
                    volume: name.into(),
                    claim,
                    bound: namespace,
                    namespace: self.namespace.clone(),
                });
            }
        }
        for doc in docs {
            if let Err(e) = self.apply_doc(doc, true).await {
                let Applied { kind, name } = Applied::of(doc);
                return Err(match e {
                    ApiError::Api {
                        code: 422, message, ..
                    } => ApiError::StorageChange {
                        what: format!("{kind} {name}"),
                        message,
                        undo: storage_undo(docs, &self.namespace),
                    },
                    other => other,
                });
            }
        }
        self.apply(docs).await
    }

    /// Deletes the storage objects `docs` (claim, then volume, then class); returns those that
    /// existed.
    pub async fn delete_storage(&self, docs: &[Value]) -> Result<Vec<Applied>, ApiError> {
        let mut deleted = Vec::new();
        for doc in docs.iter().rev() {
            let Applied { kind, name } = Applied::of(doc);
            let Some((resource, namespaced)) = resource_of(doc) else {
                continue;
            };
            match self
                .api(&resource, namespaced)
                .delete(&name, &DeleteParams::default())
                .await
            {
                Ok(_) => deleted.push(Applied { kind, name }),
                Err(e) if is_not_found(&e) => {}
                Err(e) => {
                    return Err(api_error(
                        &format!("delete {kind} {name}"),
                        self.scope(namespaced),
                        e,
                    ));
                }
            }
        }
        Ok(deleted)
    }

    /// Server-side applies one object; returns it as the server stored it.
    async fn apply_one(&self, doc: &Value) -> Result<DynamicObject, ApiError> {
        self.apply_doc(doc, false).await
    }

    /// Server-side applies one object, or only asks whether it would apply (`dry_run`).
    async fn apply_doc(&self, doc: &Value, dry_run: bool) -> Result<DynamicObject, ApiError> {
        let Applied { kind, name } = Applied::of(doc);
        let what = format!("apply {kind} {name}");
        let (resource, namespaced) = resource_of(doc).ok_or_else(|| ApiError::Other {
            what: what.clone(),
            message: "trainctl does not know where this kind lives".into(),
        })?;
        let mut params = PatchParams::apply("trainctl").force();
        params.dry_run = dry_run;
        match self
            .api(&resource, namespaced)
            .patch(&name, &params, &Patch::Apply(doc))
            .await
        {
            Ok(object) => Ok(object),
            Err(e) if is_not_found(&e) && resource.group == "kubeflow.org" => {
                Err(operator_missing(&what))
            }
            Err(e) => Err(api_error(&what, self.scope(namespaced), e)),
        }
    }

    /// Launches a training job: refuses if a job of that name exists (a finished Job cannot be
    /// changed, and a running one must not be), checks what the job needs from the cluster
    /// before writing anything (see [`Kube::preflight`]), applies the objects, and makes the job
    /// the owner of the others (token Secret, Services, etcd), so that the garbage collector
    /// removes them with it (its `ttlSecondsAfterFinished` too). A launch that fails half-way
    /// removes what it applied.
    pub async fn launch(&self, name: &str, docs: &[Value]) -> Result<Vec<Applied>, ApiError> {
        if let Some(status) = self.find_job(name).await? {
            return Err(ApiError::Exists {
                name: name.into(),
                namespace: self.namespace.clone(),
                state: status.phase.to_string(),
            });
        }
        self.preflight(docs).await?;
        let mut applied: Vec<&Value> = Vec::new();
        let mut owner = None;
        for doc in docs {
            match self.apply_one(doc).await {
                Ok(object) => {
                    applied.push(doc);
                    if is_job_kind(doc) && object.metadata.name.as_deref() == Some(name) {
                        owner = owner_reference(doc, &object);
                    }
                }
                Err(e) => return Err(self.roll_back(&applied, e).await),
            }
        }
        if let Some(owner) = owner {
            for doc in applied.iter().filter(|d| !is_job_kind(d)) {
                let mut owned = (*doc).clone();
                owned["metadata"]["ownerReferences"] = serde_json::json!([owner]);
                if let Err(e) = self.apply_one(&owned).await {
                    return Err(self.roll_back(&applied, e).await);
                }
            }
        }
        Ok(applied.into_iter().map(Applied::of).collect())
    }

    /// What a training job needs from the cluster, asked before anything is written: a server
    /// recent enough for the Job's fields, the namespace, and the PyTorchJob CRD when the job
    /// is one.
    pub async fn preflight(&self, docs: &[Value]) -> Result<(), ApiError> {
        if docs.iter().any(|d| d["kind"] == "Job") {
            let info = self
                .client
                .apiserver_version()
                .await
                .map_err(|e| api_error("ask the API server's version", CLUSTER, e))?;
            if let Some(found) = minor_version(&info.major, &info.minor)
                && found < MIN_KUBERNETES_MINOR
            {
                return Err(ApiError::TooOld {
                    version: info.git_version,
                });
            }
        }
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client.clone());
        match namespaces.get_opt(&self.namespace).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                return Err(ApiError::NoNamespace {
                    namespace: self.namespace.clone(),
                });
            }
            // Allowed to work in the namespace but not to read it: carry on.
            Err(kube::Error::Api(status)) if status.code == 403 => {}
            Err(e) => return Err(api_error("get the namespace", &self.namespace, e)),
        }
        if let Some(doc) = docs.iter().find(|d| d["kind"] == "PyTorchJob") {
            let what = format!("launch PyTorchJob {}", doc["metadata"]["name"]);
            let api_version = doc["apiVersion"].as_str().unwrap_or("kubeflow.org/v1");
            match self.client.list_api_group_resources(api_version).await {
                Ok(list) if list.resources.iter().any(|r| r.name == "pytorchjobs") => {}
                Ok(_) => return Err(operator_missing(&what)),
                Err(e) if is_not_found(&e) => return Err(operator_missing(&what)),
                Err(e) => return Err(api_error(&what, &self.namespace, e)),
            }
        }
        Ok(())
    }

    /// Whether any node can take a pod of the training size: one with the node selector's label
    /// (when there is one), and that much allocatable CPU and memory. `Some(why)` when none can,
    /// naming the selector and the nodes' instance types, and what to pass instead; `None`
    /// when one can, or the nodes cannot be read. (A cluster that scales from zero, as EKS node
    /// groups and Karpenter do, has no matching node until the pods ask: it is a warning.)
    pub async fn no_node_fits(
        &self,
        selector: Option<&(String, String)>,
        cpu: &str,
        memory: &str,
    ) -> Option<String> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let list = nodes.list(&ListParams::default()).await.ok()?;
        if list.items.is_empty() {
            return None;
        }
        let (want_cpu, want_mem) = (millicores(cpu)?, bytes(memory)?);
        let describe = |n: &Node| {
            let labels = n.metadata.labels.clone().unwrap_or_default();
            let a = n
                .status
                .as_ref()
                .and_then(|s| s.allocatable.clone())
                .unwrap_or_default();
            format!(
                "{} ({}, {} CPU, {} memory)",
                n.metadata.name.as_deref().unwrap_or("?"),
                labels
                    .get("node.kubernetes.io/instance-type")
                    .map_or("no instance type", String::as_str),
                a.get("cpu").map_or("?", |q| q.0.as_str()),
                a.get("memory").map_or("?", |q| q.0.as_str()),
            )
        };
        let all: Vec<String> = list.items.iter().take(8).map(describe).collect();
        let matching: Vec<&Node> = list
            .items
            .iter()
            .filter(|n| {
                selector.is_none_or(|(k, v)| {
                    n.metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v)
                })
            })
            .collect();
        if let Some((k, v)) = selector
            && matching.is_empty()
        {
            return Some(format!(
                "no node has the label {k}={v} that the pods select (nodes: {}); pass \
                 --node-selector none (or a label a node has), or add nodes of that type",
                all.join(", ")
            ));
        }
        let fits = matching.iter().any(|n| {
            let a = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
            let have = |k: &str, f: fn(&str) -> Option<u64>| {
                a.and_then(|a| a.get(k)).and_then(|q| f(&q.0)).unwrap_or(0)
            };
            have("cpu", millicores) >= want_cpu && have("memory", bytes) >= want_mem
        });
        if fits {
            return None;
        }
        Some(format!(
            "no node can give a pod {cpu} CPU and {memory} memory (nodes: {}); pass a smaller \
             --cpu and --memory (or --node-selector none), or add larger nodes",
            all.join(", ")
        ))
    }

    /// Deletes what a failed launch applied (newest first) and says so beside its error.
    async fn roll_back(&self, applied: &[&Value], cause: ApiError) -> ApiError {
        let mut removed = Vec::new();
        let mut left = Vec::new();
        for doc in applied.iter().rev() {
            let Applied { kind, name } = Applied::of(doc);
            let Some((resource, namespaced)) = resource_of(doc) else {
                continue;
            };
            match self
                .api(&resource, namespaced)
                .delete(&name, &delete_with_pods())
                .await
            {
                Ok(_) => removed.push(format!("{kind} {name}")),
                Err(e) if is_not_found(&e) => {}
                Err(_) => left.push(format!("{kind} {name}")),
            }
        }
        let mut undone = Vec::new();
        if !removed.is_empty() {
            undone.push(format!(
                "removed what this launch had applied ({})",
                removed.join(", ")
            ));
        }
        if !left.is_empty() {
            undone.push(format!(
                "could not remove {}: `trainctl job delete` does",
                left.join(", ")
            ));
        }
        if undone.is_empty() {
            return cause;
        }
        ApiError::RolledBack {
            cause: Box::new(cause),
            undone: undone.join("; "),
        }
    }

    /// The job `name` (a Job or a PyTorchJob), or None.
    async fn find_job(&self, name: &str) -> Result<Option<JobStatus>, ApiError> {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        match jobs.get_opt(name).await {
            Ok(Some(job)) => return Ok(Some(JobStatus::from_job(&job))),
            Ok(None) => {}
            Err(e) => return Err(api_error(&format!("get Job {name}"), &self.namespace, e)),
        }
        let api = self.api(&pytorchjob_resource(), true);
        match api.get_opt(name).await {
            Ok(Some(job)) => Ok(Some(JobStatus::from_pytorchjob(&job))),
            Ok(None) => Ok(None),
            // No PyTorchJob CRD: then there is no such PyTorchJob either.
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(api_error(
                &format!("get PyTorchJob {name}"),
                &self.namespace,
                e,
            )),
        }
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

    /// A pod on a node that is gone or NotReady (its kubelet stopped reporting) still reads
    /// Running and ready; say that its node is lost, and that its ranks are. Where nodes
    /// cannot be read (RBAC), pods stay as the API server reports them.
    async fn mark_lost_nodes(&self, pods: impl Iterator<Item = &mut PodStatus>) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let mut known: BTreeMap<String, Option<String>> = BTreeMap::new();
        for pod in pods {
            let Some(node) = pod.node.clone() else {
                continue;
            };
            if !known.contains_key(&node) {
                let problem = match nodes.get_opt(&node).await {
                    Ok(None) => Some(format!("node {node} is gone")),
                    Ok(Some(n)) => node_problem(&n).map(|p| format!("node {node} {p}")),
                    Err(_) => None,
                };
                known.insert(node.clone(), problem);
            }
            if let Some(Some(problem)) = known.get(&node)
                && pod.phase == "Running"
            {
                pod.ready = false;
                let lost = format!("{problem}: this pod's workers are lost");
                pod.why = if pod.why.is_empty() {
                    lost
                } else {
                    format!("{lost}; {}", pod.why)
                };
                pod.node_lost = true;
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
    /// matches, jobs first.
    pub async fn delete_matching(&self, selector: &str) -> Result<Vec<Applied>, ApiError> {
        let params = delete_with_pods();
        let mut deleted = Vec::new();
        // The jobs first, so that their workers stop before their etcd, Service and token go.
        for wanted in ["PyTorchJob", "Job", "Deployment", "Service", "Secret"] {
            let Some((group, version, kind, plural, _)) =
                KINDS.iter().find(|(_, _, k, _, _)| *k == wanted)
            else {
                continue;
            };
            let resource = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, version, kind),
                plural,
            );
            let api = self.api(&resource, true);
            let list = match api.list(&ListParams::default().labels(selector)).await {
                Ok(list) => list,
                Err(e) if is_not_found(&e) && *group == "kubeflow.org" => continue,
                Err(e) => return Err(api_error(&format!("list {plural}"), &self.namespace, e)),
            };
            for object in list.items {
                let Some(object_name) = object.metadata.name.clone() else {
                    continue;
                };
                match api.delete(&object_name, &params).await {
                    Ok(_) => deleted.push(Applied {
                        kind: kind.to_string(),
                        name: object_name,
                    }),
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => {
                        return Err(api_error(
                            &format!("delete {kind} {object_name}"),
                            &self.namespace,
                            e,
                        ));
                    }
                }
            }
        }
        Ok(deleted)
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

    /// CPU and memory of the job's pods and of the nodes they run on (the metrics API).
    pub async fn top(&self, name: &str) -> Result<Top, ApiError> {
        let pods = self.pods(name).await?;
        if pods.is_empty() {
            self.require_job(name).await?;
        }
        let selector = format!("{}={}", manifests::MANAGED_BY.0, manifests::MANAGED_BY.1);
        let url = format!(
            "/apis/metrics.k8s.io/v1beta1/namespaces/{}/pods?labelSelector={}",
            self.namespace,
            selector.replace('=', "%3D").replace(',', "%2C")
        );
        let pod_metrics: MetricsList<PodMetrics> = self.metrics(&url).await?;
        let node_metrics: MetricsList<NodeMetrics> =
            self.metrics("/apis/metrics.k8s.io/v1beta1/nodes").await?;
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node_list = nodes
            .list(&ListParams::default())
            .await
            .map_err(|e| api_error("list nodes", CLUSTER, e))?;
        let allocatable: BTreeMap<String, (u64, u64)> = node_list
            .items
            .iter()
            .filter_map(|n| {
                let a = n.status.as_ref()?.allocatable.as_ref()?;
                Some((
                    n.metadata.name.clone()?,
                    (
                        a.get("cpu").and_then(|q| millicores(&q.0)).unwrap_or(0),
                        a.get("memory").and_then(|q| bytes(&q.0)).unwrap_or(0),
                    ),
                ))
            })
            .collect();
        let mut top = Top::default();
        for pod in &pods {
            let usage = pod_metrics
                .items
                .iter()
                .find(|m| m.metadata.name == pod.name)
                .map(|m| {
                    m.containers.iter().fold((0, 0), |(c, b), ct| {
                        (
                            c + millicores(&ct.usage.cpu).unwrap_or(0),
                            b + bytes(&ct.usage.memory).unwrap_or(0),
                        )
                    })
                });
            top.pods.push(Usage {
                name: pod.name.clone(),
                index: pod.index,
                node: pod.node.clone(),
                millicores: usage.map(|u| u.0),
                bytes: usage.map(|u| u.1),
                allocatable: None,
            });
        }
        let job_nodes: Vec<String> = pods.iter().filter_map(|p| p.node.clone()).collect();
        for m in &node_metrics.items {
            if !job_nodes.contains(&m.metadata.name) {
                continue;
            }
            top.nodes.push(Usage {
                name: m.metadata.name.clone(),
                index: None,
                node: None,
                millicores: millicores(&m.usage.cpu),
                bytes: bytes(&m.usage.memory),
                allocatable: allocatable.get(&m.metadata.name).copied(),
            });
        }
        Ok(top)
    }

    async fn metrics<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<T, ApiError> {
        let request = http::Request::get(url)
            .body(Vec::new())
            .map_err(|e| ApiError::Other {
                what: "metrics request".into(),
                message: e.to_string(),
            })?;
        match self.client.request::<T>(request).await {
            Ok(v) => Ok(v),
            Err(e) if is_not_found(&e) => Err(ApiError::MetricsMissing),
            // An unavailable aggregated API (metrics-server down) answers 503.
            Err(kube::Error::Api(s)) if s.code == 503 => Err(ApiError::MetricsMissing),
            Err(e) => Err(api_error("read the metrics API", &self.namespace, e)),
        }
    }

    /// The logs of every pod of the job, each line prefixed with its pod and node index.
    /// Without `follow`, all lines so far, merged in time order (the API's timestamps). With
    /// `follow`, lines as they come, from pods as they start, until the job has finished and
    /// its streams have ended.
    pub async fn logs(
        &self,
        name: &str,
        follow: bool,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        if !follow {
            let pods = self.pods(name).await?;
            if pods.is_empty() {
                self.require_job(name).await?;
            }
            if !pods.is_empty() && !pods.iter().any(PodStatus::has_started) {
                return Err(ApiError::NoLogsYet {
                    name: name.into(),
                    namespace: self.namespace.clone(),
                    pods: pods
                        .iter()
                        .map(|p| match p.why.as_str() {
                            "" => format!("{} {}", p.name, p.phase.to_lowercase()),
                            why => format!("{} {}: {why}", p.name, p.phase.to_lowercase()),
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                });
            }
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
            let mut lines: Vec<(String, usize, String)> = Vec::new();
            for (order, pod) in pods.iter().enumerate() {
                if !pod.has_started() {
                    continue;
                }
                if pod.node_lost {
                    // The kubelet that serves its logs is gone: the API server would answer a
                    // bare 500 "connection refused".
                    lines.push((
                        String::new(),
                        order,
                        format!("{}(no logs: {})", pod.prefix(), pod.why),
                    ));
                    continue;
                }
                let params = LogParams {
                    container: Some(CONTAINER.into()),
                    timestamps: true,
                    ..LogParams::default()
                };
                let text = api.logs(&pod.name, &params).await.map_err(|e| {
                    api_error(&format!("logs of pod {}", pod.name), &self.namespace, e)
                })?;
                for line in text.lines() {
                    let (stamp, rest) = split_timestamp(line);
                    lines.push((stamp.to_string(), order, pod.prefix() + rest));
                }
            }
            // Stable sort: lines of one pod keep their order when stamps tie.
            lines.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
            for (_, _, line) in lines {
                out(&line);
            }
            return Ok(());
        }
        self.follow_logs(name, out).await
    }

    async fn follow_logs(
        &self,
        name: &str,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(1024);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut streaming: BTreeMap<String, tokio::task::JoinHandle<()>> = BTreeMap::new();
        let mut seen_job = false;
        let mut pending: BTreeMap<String, String> = BTreeMap::new();
        loop {
            let status = match self.find_job(name).await? {
                Some(s) => s,
                None if seen_job => return Ok(()),
                None => return Err(self.no_job(name)),
            };
            seen_job = true;
            for pod in self.pods(name).await? {
                if !pod.has_started() {
                    // Why it waits (unschedulable, pulling its image), once each time it changes.
                    if !pod.why.is_empty() && pending.get(&pod.uid) != Some(&pod.why) {
                        out(&format!(
                            "{}{} pending: {}",
                            pod.prefix(),
                            pod.name,
                            pod.why
                        ));
                        pending.insert(pod.uid.clone(), pod.why.clone());
                    }
                    continue;
                }
                if streaming.contains_key(&pod.uid) {
                    continue;
                }
                let api = api.clone();
                let tx = tx.clone();
                let prefix = pod.prefix();
                let pod_name = pod.name.clone();
                let task = tokio::spawn(async move {
                    let params = LogParams {
                        container: Some(CONTAINER.into()),
                        follow: true,
                        ..LogParams::default()
                    };
                    match api.log_stream(&pod_name, &params).await {
                        Ok(stream) => {
                            let mut lines = stream.lines();
                            while let Some(Ok(line)) = lines.next().await {
                                if tx.send(format!("{prefix}{line}")).await.is_err() {
                                    break;
                                }
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(format!("{prefix}(no logs: {e})")).await;
                        }
                    }
                });
                streaming.insert(pod.uid.clone(), task);
            }
            let finished = status.phase.is_finished();
            // Print what came in during a poll interval.
            let tick = tokio::time::sleep(self.poll);
            tokio::pin!(tick);
            loop {
                tokio::select! {
                    Some(line) = rx.recv() => out(&line),
                    () = &mut tick => break,
                }
            }
            if finished && streaming.values().all(|t| t.is_finished()) {
                while let Ok(line) = rx.try_recv() {
                    out(&line);
                }
                return Ok(());
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

/// Whether pod `p` belongs to job `name` itself (not its data, test or doctor job).
fn owned_by(p: &Pod, name: &str) -> bool {
    let labels = p.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    // Pods of a Job carry job-name; the operator's carry training.kubeflow.org/job-name.
    label("job-name") == Some(name)
        || label("batch.kubernetes.io/job-name") == Some(name)
        || label("training.kubeflow.org/job-name") == Some(name)
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

fn split_timestamp(line: &str) -> (&str, &str) {
    match line.split_once(' ') {
        Some((stamp, rest)) if stamp.len() >= 20 && stamp.as_bytes()[4] == b'-' => (stamp, rest),
        _ => ("", line),
    }
}

/// Where a job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Created; no pod running yet.
    Pending,
    Running,
    Succeeded,
    Failed,
}

impl Phase {
    pub fn is_finished(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Pending => "pending",
            Phase::Running => "running",
            Phase::Succeeded => "succeeded",
            Phase::Failed => "failed",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
}

/// A job and its pods.
#[derive(Debug, Clone)]
pub struct JobStatus {
    pub name: String,
    /// `Job` or `PyTorchJob`.
    pub kind: String,
    pub phase: Phase,
    pub conditions: Vec<Condition>,
    /// Pods that failed and were replaced (a Job's `status.failed`).
    pub failed_pods: i32,
    pub pods: Vec<PodStatus>,
    /// The pods beside the job: its etcd (`--rdzv-backend etcd`), its TensorBoard.
    pub companions: Vec<PodStatus>,
}

impl JobStatus {
    fn from_job(job: &Job) -> JobStatus {
        let status = job.status.clone().unwrap_or_default();
        let conditions: Vec<Condition> = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .map(|c| Condition {
                type_: c.type_,
                status: c.status,
                reason: c.reason.unwrap_or_default(),
                message: c.message.unwrap_or_default(),
            })
            .collect();
        let phase = phase_from_conditions(&conditions, &["Complete"], &["Failed"]).unwrap_or(
            if status.active.unwrap_or(0) > 0 {
                Phase::Running
            } else {
                Phase::Pending
            },
        );
        JobStatus {
            name: job.metadata.name.clone().unwrap_or_default(),
            kind: "Job".into(),
            phase,
            conditions,
            failed_pods: status.failed.unwrap_or(0),
            pods: Vec::new(),
            companions: Vec::new(),
        }
    }

    fn from_pytorchjob(job: &DynamicObject) -> JobStatus {
        let conditions: Vec<Condition> = job.data["status"]["conditions"]
            .as_array()
            .map(|cs| {
                cs.iter()
                    .map(|c| {
                        let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
                        Condition {
                            type_: s("type"),
                            status: s("status"),
                            reason: s("reason"),
                            message: s("message"),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let phase = phase_from_conditions(&conditions, &["Succeeded"], &["Failed"]).unwrap_or(
            if conditions
                .iter()
                .any(|c| c.type_ == "Running" && c.status == "True")
            {
                Phase::Running
            } else {
                Phase::Pending
            },
        );
        JobStatus {
            name: job.metadata.name.clone().unwrap_or_default(),
            kind: "PyTorchJob".into(),
            phase,
            conditions,
            failed_pods: 0,
            pods: Vec::new(),
            companions: Vec::new(),
        }
    }

    /// A job Kubernetes counts as active is only running once one of its pods is.
    fn settle(&mut self) {
        if self.phase == Phase::Running && !self.pods.iter().any(|p| p.phase == "Running") {
            self.phase = Phase::Pending;
        }
        if self.phase == Phase::Pending && self.pods.iter().any(|p| p.phase == "Running") {
            self.phase = Phase::Running;
        }
    }

    /// The failure condition's reason and message, when the job failed.
    pub fn failure(&self) -> Option<&Condition> {
        self.conditions
            .iter()
            .find(|c| c.type_ == "Failed" && c.status == "True")
    }

    /// `job status` as text: the job line, conditions, then one row per pod.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{} {}: {}", self.kind, self.name, self.phase);
        if self.failed_pods > 0 {
            let _ = writeln!(s, "  failed pods so far: {}", self.failed_pods);
        }
        for c in &self.conditions {
            if c.status != "True" {
                continue;
            }
            let _ = write!(s, "  condition {}", c.type_);
            if !c.reason.is_empty() {
                let _ = write!(s, " ({})", c.reason);
            }
            if !c.message.is_empty() {
                let _ = write!(s, ": {}", c.message);
            }
            s.push('\n');
        }
        if self.kind == "PyTorchJob" && self.conditions.is_empty() && self.pods.is_empty() {
            // The training operator sets a Created condition at once: none means nothing
            // reconciles PyTorchJobs here.
            s.push_str(
                "  no conditions and no pods: nothing has picked this PyTorchJob up; is the \
                 Kubeflow training operator running? (`kubectl get pods -A | grep training-operator`)\n",
            );
        }
        if self.pods.is_empty() {
            s.push_str("  no pods yet\n");
            if self.companions.is_empty() {
                return s;
            }
        }
        // Columns as wide as their longest entry: long pod and node names keep the table.
        let all = || self.pods.iter().chain(&self.companions);
        let pod_w = all().map(|p| p.name.len()).max().unwrap_or(0).max(3);
        let on = |p: &PodStatus| p.node.clone().unwrap_or_else(|| "(unscheduled)".into());
        let on_w = all().map(|p| on(p).len()).max().unwrap_or(0).max(2);
        let _ = writeln!(
            s,
            "  {:<pod_w$} {:>5} {:<10} {:>5} {:>8}  {:<on_w$}  WHY",
            "POD", "INDEX", "PHASE", "READY", "RESTARTS", "ON"
        );
        for p in all() {
            let _ = writeln!(
                s,
                "  {:<pod_w$} {:>5} {:<10} {:>5} {:>8}  {:<on_w$}  {}",
                p.name,
                p.index.map_or("-".into(), |i| i.to_string()),
                p.phase,
                if p.ready { "yes" } else { "no" },
                p.restarts,
                on(p),
                p.why
            );
        }
        if self.pods.iter().any(|p| p.index.is_some()) {
            s.push_str(
                "  (INDEX is the pod's place in the job; the rendezvous gives each round's node \
                 ranks in join order, which `job logs` shows as \"node rank N of M\")\n",
            );
        }
        for p in self.pods.iter().chain(&self.companions) {
            if let Some(words) = &p.last_words {
                let _ = writeln!(s, "  {} failed; its last lines:", p.name);
                for line in last_lines(words, LAST_WORDS_LINES) {
                    let _ = writeln!(s, "    {line}");
                }
            }
        }
        s
    }
}

/// How many of a failed container's last lines `job status` shows.
const LAST_WORDS_LINES: usize = 10;

/// The last `n` non-empty lines of `text`, without terminal colour codes.
fn last_lines(text: &str, n: usize) -> Vec<String> {
    let lines: Vec<String> = text
        .lines()
        .map(|l| strip_ansi(l).trim_end().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// `line` without ANSI escape sequences (CSI: ESC [ ... final byte).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

fn phase_from_conditions(cs: &[Condition], success: &[&str], failure: &[&str]) -> Option<Phase> {
    let is_true = |names: &[&str]| {
        cs.iter()
            .any(|c| names.contains(&c.type_.as_str()) && c.status == "True")
    };
    if is_true(failure) {
        Some(Phase::Failed)
    } else if is_true(success) {
        Some(Phase::Succeeded)
    } else {
        None
    }
}

/// What is wrong with `node`, if it is not Ready: "is NotReady (Kubelet stopped posting node
/// status.)".
fn node_problem(node: &Node) -> Option<String> {
    let ready = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    if ready.status == "True" {
        return None;
    }
    let state = if ready.status == "Unknown" {
        "is unreachable"
    } else {
        "is NotReady"
    };
    Some(match ready.message.as_deref() {
        Some(m) if !m.is_empty() => format!("{state} ({m})"),
        _ => state.to_string(),
    })
}

/// One pod of a job.
#[derive(Debug, Clone)]
pub struct PodStatus {
    pub name: String,
    pub uid: String,
    /// The node index: the Indexed Job's completion index or the PyTorchJob's replica index.
    /// (The rendezvous assigns node ranks in join order; the logs say which each got.)
    pub index: Option<u32>,
    pub phase: String,
    pub ready: bool,
    pub restarts: i32,
    pub node: Option<String>,
    pub ip: Option<String>,
    /// Why it is not running well: unschedulable and the scheduler's message, a waiting reason
    /// (ImagePullBackOff...), the last termination (OOMKilled, exit code).
    pub why: String,
    /// A failed container's termination message: what it wrote there, or its last log lines
    /// (`FallbackToLogsOnError`).
    pub last_words: Option<String>,
    /// Its node is gone or not ready: no logs can be read from it.
    pub node_lost: bool,
}

impl PodStatus {
    fn from_pod(p: &Pod) -> PodStatus {
        let labels = p.metadata.labels.clone().unwrap_or_default();
        let index = [
            "batch.kubernetes.io/job-completion-index",
            "training.kubeflow.org/replica-index",
        ]
        .iter()
        .find_map(|k| labels.get(*k).and_then(|v| v.parse().ok()));
        let status = p.status.clone().unwrap_or_default();
        let containers = status.container_statuses.clone().unwrap_or_default();
        let restarts = containers.iter().map(|c| c.restart_count).sum();
        let ready = !containers.is_empty() && containers.iter().all(|c| c.ready);
        let mut why = Vec::new();
        let mut last_words = None;
        for c in status.conditions.iter().flatten() {
            if c.type_ == "PodScheduled" && c.status == "False" {
                why.push(format!(
                    "{}: {}",
                    c.reason.as_deref().unwrap_or("not scheduled"),
                    c.message.as_deref().unwrap_or("")
                ));
            }
        }
        for c in &containers {
            let state = c.state.clone().unwrap_or_default();
            if let Some(w) = state.waiting
                && let Some(reason) = w.reason.filter(|r| r != "ContainerCreating")
            {
                why.push(match w.message {
                    Some(m) => format!("{reason}: {m}"),
                    None => reason,
                });
            }
            if let Some(t) = state.terminated.filter(|t| t.exit_code != 0) {
                why.push(format!(
                    "exited {} ({})",
                    t.exit_code,
                    t.reason.unwrap_or_else(|| "Error".into())
                ));
                last_words = last_words.or(t.message);
            }
            if let Some(t) = c.last_state.as_ref().and_then(|s| s.terminated.as_ref()) {
                why.push(format!(
                    "last run exited {} ({})",
                    t.exit_code,
                    t.reason.clone().unwrap_or_else(|| "Error".into())
                ));
                last_words = last_words.or_else(|| t.message.clone());
            }
        }
        PodStatus {
            name: p.metadata.name.clone().unwrap_or_default(),
            uid: p.metadata.uid.clone().unwrap_or_default(),
            index,
            phase: status.phase.clone().unwrap_or_else(|| "Unknown".into()),
            ready,
            restarts,
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            ip: status.pod_ip.clone(),
            why: why.join("; "),
            last_words: last_words.filter(|m: &String| !m.trim().is_empty()),
            node_lost: false,
        }
    }

    fn has_started(&self) -> bool {
        matches!(self.phase.as_str(), "Running" | "Succeeded" | "Failed")
    }

    fn prefix(&self) -> String {
        match self.index {
            Some(i) => format!("[{} pod {i}] ", self.name),
            None => format!("[{}] ", self.name),
        }
    }
}

#[derive(Deserialize)]
struct MetricsList<T> {
    items: Vec<T>,
}

#[derive(Deserialize)]
struct MetricsMeta {
    name: String,
}

#[derive(Deserialize)]
struct ResourceUsage {
    cpu: String,
    memory: String,
}

#[derive(Deserialize)]
struct ContainerMetrics {
    usage: ResourceUsage,
}

#[derive(Deserialize)]
struct PodMetrics {
    metadata: MetricsMeta,
    containers: Vec<ContainerMetrics>,
}

#[derive(Deserialize)]
struct NodeMetrics {
    metadata: MetricsMeta,
    usage: ResourceUsage,
}

/// `job top`: usage per pod and per node.
#[derive(Debug, Default, Clone)]
pub struct Top {
    pub pods: Vec<Usage>,
    pub nodes: Vec<Usage>,
}

#[derive(Debug, Clone)]
pub struct Usage {
    pub name: String,
    pub index: Option<u32>,
    pub node: Option<String>,
    pub millicores: Option<u64>,
    pub bytes: Option<u64>,
    /// The node's allocatable (millicores, bytes).
    pub allocatable: Option<(u64, u64)>,
}

impl Top {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let cpu = |m: Option<u64>| m.map_or("-".into(), |m| format!("{m}m"));
        let mem = |b: Option<u64>| b.map_or("-".into(), |b| format!("{}Mi", b / (1 << 20)));
        let _ = writeln!(
            s,
            "{:<32} {:>4} {:>10} {:>10}  ON",
            "POD", "NODE", "CPU", "MEMORY"
        );
        for p in &self.pods {
            let _ = writeln!(
                s,
                "{:<32} {:>4} {:>10} {:>10}  {}",
                p.name,
                p.index.map_or("-".into(), |i| i.to_string()),
                cpu(p.millicores),
                mem(p.bytes),
                p.node.as_deref().unwrap_or("(unscheduled)")
            );
        }
        if !self.nodes.is_empty() {
            s.push('\n');
            let _ = writeln!(
                s,
                "{:<32} {:>10} {:>5} {:>10} {:>5}",
                "NODE", "CPU", "CPU%", "MEMORY", "MEM%"
            );
            for n in &self.nodes {
                let pct = |used: Option<u64>, total: Option<u64>| match (used, total) {
                    (Some(u), Some(t)) if t > 0 => format!("{}%", u * 100 / t),
                    _ => "-".into(),
                };
                let _ = writeln!(
                    s,
                    "{:<32} {:>10} {:>5} {:>10} {:>5}",
                    n.name,
                    cpu(n.millicores),
                    pct(n.millicores, n.allocatable.map(|a| a.0)),
                    mem(n.bytes),
                    pct(n.bytes, n.allocatable.map(|a| a.1)),
                );
            }
        }
        s
    }
}

/// A CPU quantity in millicores: `2`, `250m`, `123456789n`, `1500u`.
pub fn millicores(q: &str) -> Option<u64> {
    let (number, scale) = if let Some(n) = q.strip_suffix('n') {
        (n, 1e-6)
    } else if let Some(n) = q.strip_suffix('u') {
        (n, 1e-3)
    } else if let Some(n) = q.strip_suffix('m') {
        (n, 1.0)
    } else {
        (q, 1000.0)
    };
    let v: f64 = number.parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * scale).round() as u64)
}

/// A memory quantity in bytes: `1024`, `512Ki`, `2Gi`, `1G`.
pub fn bytes(q: &str) -> Option<u64> {
    const UNITS: [(&str, f64); 10] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
    ];
    let (number, scale) = UNITS
        .iter()
        .find_map(|(u, s)| q.strip_suffix(u).map(|n| (n, *s)))
        .unwrap_or((q, 1.0));
    let v: f64 = number.parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * scale).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_convert() {
        assert_eq!(millicores("2"), Some(2000));
        assert_eq!(millicores("250m"), Some(250));
        assert_eq!(millicores("123456789n"), Some(123));
        assert_eq!(millicores("x"), None);
        assert_eq!(bytes("512Ki"), Some(512 * 1024));
        assert_eq!(bytes("2Gi"), Some(2 << 30));
        assert_eq!(bytes("1G"), Some(1_000_000_000));
        assert_eq!(bytes("-1"), None);
    }

    #[test]
    fn timestamps_split_off() {
        assert_eq!(
            split_timestamp("2026-11-21T10:00:00.123456789Z epoch 1"),
            ("2026-11-21T10:00:00.123456789Z", "epoch 1")
        );
        assert_eq!(split_timestamp("plain line"), ("", "plain line"));
    }
}
