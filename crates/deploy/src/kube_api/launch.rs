//! Writing to the cluster: server-side apply, a training job's launch (checked first, owning
//! what it needs, rolled back when refused half-way), the shared storage.

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::Value;

use crate::config::{bytes, millicores};
use crate::launchers::is_custom;
use crate::manifests::Manifest;

use super::error::{CLUSTER, api_error, is_not_found};
use super::{ApiError, Applied, Kube, delete_with_pods};

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

/// The cluster does not serve `resource`, which `what` needs: say which operator to install,
/// or which launcher needs none.
fn operator_missing(what: &str, resource: &ApiResource) -> ApiError {
    let kind = crate::launchers::serving(resource);
    let operator = kind.and_then(|k| k.launcher().operator());
    ApiError::NotServed {
        what: what.into(),
        api: format!("{} {}", resource.api_version, resource.kind),
        hint: match (kind, operator) {
            (Some(kind), Some(operator)) => format!(
                "install {} (`trainctl cluster addons --launcher {}` says how), or use \
                 --launcher indexed",
                operator.name,
                kind.name()
            ),
            _ => "install the operator that serves it, or use --launcher indexed".into(),
        },
    }
}

/// An owner reference to the applied job `object` (rendered as `doc`), when it has a uid.
fn owner_reference(doc: &Manifest, object: &DynamicObject) -> Option<Value> {
    let uid = object.metadata.uid.as_deref()?;
    Some(serde_json::json!({
        "apiVersion": doc.resource().api_version,
        "kind": doc.kind(),
        "name": doc.name(),
        "uid": uid,
    }))
}

/// The commands that remove the storage objects `docs` (claim first), for a change that cannot
/// be applied in place.
fn storage_undo(docs: &[Manifest], namespace: &str) -> String {
    let name = |kind: &str| docs.iter().find(|d| d.kind() == kind).map(Manifest::name);
    let mut steps = Vec::new();
    if let Some(claim) = name("PersistentVolumeClaim") {
        steps.push(format!("kubectl delete pvc {claim} -n {namespace}"));
    }
    if let Some(volume) = name("PersistentVolume") {
        steps.push(format!("kubectl delete pv {volume}"));
    }
    steps.join(" && ")
}

impl Kube {
    /// Server-side applies `docs` in order (field manager `trainctl`): creating what is missing,
    /// updating what trainctl made before.
    pub async fn apply(&self, docs: &[Manifest]) -> Result<Vec<Applied>, ApiError> {
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
    pub async fn apply_storage(&self, docs: &[Manifest]) -> Result<Vec<Applied>, ApiError> {
        if let Some(volume) = docs.iter().find(|d| d.kind() == "PersistentVolume") {
            let name = volume.name();
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
    pub async fn delete_storage(&self, docs: &[Manifest]) -> Result<Vec<Applied>, ApiError> {
        let mut deleted = Vec::new();
        for doc in docs.iter().rev() {
            if self.delete_doc(doc, &DeleteParams::default()).await? {
                deleted.push(Applied::of(doc));
            }
        }
        Ok(deleted)
    }

    /// Deletes the object `doc` names: `Ok(false)` when it was not there.
    async fn delete_doc(&self, doc: &Manifest, params: &DeleteParams) -> Result<bool, ApiError> {
        let Applied { kind, name } = Applied::of(doc);
        let namespaced = doc.namespaced();
        match self
            .api(doc.resource(), namespaced)
            .delete(&name, params)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(api_error(
                &format!("delete {kind} {name}"),
                self.scope(namespaced),
                e,
            )),
        }
    }

    /// Server-side applies one object; returns it as the server stored it.
    async fn apply_one(&self, doc: &Manifest) -> Result<DynamicObject, ApiError> {
        self.apply_doc(doc, false).await
    }

    /// Server-side applies one object, or only asks whether it would apply (`dry_run`).
    async fn apply_doc(&self, doc: &Manifest, dry_run: bool) -> Result<DynamicObject, ApiError> {
        let Applied { kind, name } = Applied::of(doc);
        let what = format!("apply {kind} {name}");
        let (resource, namespaced) = (doc.resource(), doc.namespaced());
        let mut params = PatchParams::apply("trainctl").force();
        params.dry_run = dry_run;
        match self
            .api(resource, namespaced)
            .patch(&name, &params, &Patch::Apply(doc))
            .await
        {
            Ok(object) => Ok(object),
            Err(e) if is_not_found(&e) && is_custom(resource) => {
                Err(operator_missing(&what, resource))
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
    pub async fn launch(&self, name: &str, docs: &[Manifest]) -> Result<Vec<Applied>, ApiError> {
        if let Some(status) = self.find_job(name).await? {
            return Err(ApiError::Exists {
                name: name.into(),
                namespace: self.namespace.clone(),
                state: status.phase.to_string(),
            });
        }
        self.preflight(docs).await?;
        let mut applied: Vec<&Manifest> = Vec::new();
        let mut owner = None;
        for doc in docs {
            match self.apply_one(doc).await {
                Ok(object) => {
                    applied.push(doc);
                    if crate::launchers::is_job(doc)
                        && object.metadata.name.as_deref() == Some(name)
                    {
                        owner = owner_reference(doc, &object);
                    }
                }
                Err(e) => return Err(self.roll_back(&applied, e).await),
            }
        }
        if let Some(owner) = owner {
            for doc in applied.iter().filter(|d| !crate::launchers::is_job(d)) {
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
    /// recent enough for the Job's fields, the namespace, and the CRDs of the operator's
    /// objects it renders (a PyTorchJob, a TrainJob and its runtime, an MPIJob).
    async fn preflight(&self, docs: &[Manifest]) -> Result<(), ApiError> {
        let job_fields = docs
            .iter()
            .filter_map(|d| crate::launchers::serving(d.resource()))
            .any(|k| k.runs_a_job());
        if job_fields {
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
        // Every custom resource the job renders must be served: its operator's CRDs.
        for doc in docs.iter().filter(|d| is_custom(d.resource())) {
            let what = format!("launch {} {}", doc.kind(), doc.name());
            let resource = doc.resource();
            match self
                .client
                .list_api_group_resources(&resource.api_version)
                .await
            {
                Ok(list) if list.resources.iter().any(|r| r.name == resource.plural) => {}
                Ok(_) => return Err(operator_missing(&what, resource)),
                Err(e) if is_not_found(&e) => return Err(operator_missing(&what, resource)),
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
                    .get(crate::config::INSTANCE_TYPE_LABEL)
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
    async fn roll_back(&self, applied: &[&Manifest], cause: ApiError) -> ApiError {
        let mut removed = Vec::new();
        let mut left = Vec::new();
        for doc in applied.iter().rev() {
            let Applied { kind, name } = Applied::of(doc);
            match self.delete_doc(doc, &delete_with_pods()).await {
                Ok(true) => removed.push(format!("{kind} {name}")),
                Ok(false) => {}
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
}
