//! What went wrong talking to the cluster, said with its cause and what to do next.

use std::time::Duration;

use super::MIN_KUBERNETES_MINOR;

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
         was changed. To replace the storage, stop the jobs that use it, remove it (`trainctl \
         storage --delete`, or `{undo}`; the data stays on the file system: the reclaim policy \
         is Retain) and run `trainctl storage` again"
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
        "could not read the logs of {missing}; the other pods' lines were printed. Run `trainctl \
         job logs --name {name} --namespace {namespace}` again once `trainctl job status --name \
         {name} --namespace {namespace}` shows the pod's node Ready, or add --follow, which waits \
         for the kubelet and reattaches when it answers"
    )]
    LogsMissing {
        name: String,
        namespace: String,
        /// Each pod not read, with why: "cifar10-1-abcde (the kubelet on node n2 did not
        /// answer: ...)".
        missing: String,
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
pub(super) const CLUSTER: &str = "";

fn scope_words(namespace: &str) -> String {
    if namespace.is_empty() {
        "at the cluster scope (a ClusterRole)".into()
    } else {
        format!("in namespace {namespace}")
    }
}

/// Turns a kube error into an [`ApiError`] for the action `what` in `namespace` ([`CLUSTER`]
/// for cluster-scoped objects).
pub(super) fn api_error(what: &str, namespace: &str, e: kube::Error) -> ApiError {
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

/// Why one pod's logs could not be read, when the trouble is that pod's rather than the
/// cluster's (its node's kubelet did not answer, the pod is gone, its container cannot serve
/// logs), so that the other pods' logs can still be read; any other error is handed back.
///
/// The API server proxies a log request to the pod's kubelet and answers a 5xx when that
/// kubelet does not answer: "500: Get \"https://10.0.1.12:10250/containerLogs/...\": dial tcp
/// 10.0.1.12:10250: connect: connection refused".
pub(super) fn pod_logs_problem(node: Option<&str>, e: kube::Error) -> Result<String, kube::Error> {
    match e {
        kube::Error::Api(s) if s.code >= 500 => {
            let kubelet = match node {
                Some(node) => format!("the kubelet on node {node}"),
                None => "the pod's kubelet".to_string(),
            };
            let said = match (s.message.is_empty(), s.reason.is_empty()) {
                (false, _) => format!("{}: {}", s.code, s.message),
                (true, false) => format!("{} {}", s.code, s.reason),
                (true, true) => s.code.to_string(),
            };
            Ok(format!("{kubelet} did not answer ({said})"))
        }
        kube::Error::Api(s) if s.code == 404 => Ok("the pod is gone".into()),
        // "container \"pytorch\" in pod \"...\" is waiting to start: ContainerCreating"
        kube::Error::Api(s) if s.code == 400 && !s.message.is_empty() => Ok(s.message),
        other => Err(other),
    }
}

/// An error and its sources, outermost first: `client error (Connect): invalid peer
/// certificate: UnknownIssuer`, not just `client error (Connect)`.
pub(super) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
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

pub(super) fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}
