//! What the Kubernetes commands print: the objects applied or deleted, rendered YAML, a job's
//! status and usage, the pods' log lines, the commands run for the user and the doctor's
//! checks. Results go to stdout; what a command says while it works goes to stderr.

use std::path::Path;
use std::time::Duration;

use deploy::kube_api::{Applied, JobStatus, Top};

use super::{err, out, out_raw};

/// Rendered objects (or an eksctl config) as one YAML stream on stdout.
pub(crate) fn yaml(text: &str) {
    out_raw(format_args!("{text}"));
}

/// The objects a command applied: its result on stdout, or a step of a helper job (stderr,
/// before the job's own output).
pub(crate) fn applied(applied: &[Applied], stderr: bool) {
    for a in applied {
        if stderr {
            err(format_args!("applied {} {}", a.kind, a.name));
        } else {
            out(format_args!("applied {} {}", a.kind, a.name));
        }
    }
}

/// The objects a command deleted; `none` is said when there were none.
pub(crate) fn deleted(deleted: &[Applied], none: Option<&str>) {
    if deleted.is_empty()
        && let Some(none) = none
    {
        out(format_args!("{none}"));
    }
    for d in deleted {
        out(format_args!("deleted {} {}", d.kind, d.name));
    }
}

/// What to run next after a launch.
pub(crate) fn launched(name: &str, at_namespace: &str) {
    out(format_args!(
        "next: trainctl job status --name {name}{at_namespace}; trainctl job logs --name {name}{at_namespace} --follow"
    ));
}

/// What `job scale` did and what the job does now.
pub(crate) fn scaled(scaled: &deploy::kube_api::Scaled) {
    for line in scaled.describe() {
        out(format_args!("{line}"));
    }
}

/// A job's status table (stderr when it explains a helper's failure).
pub(crate) fn status(status: &JobStatus, stderr: bool) {
    let text = status.render();
    if stderr {
        super::emit(true, text.as_bytes());
    } else {
        out_raw(format_args!("{text}"));
    }
}

/// The etcd Deployments scaled to zero because their job has finished (stderr: a step beside
/// the command's result).
pub(crate) fn etcd_stopped(stopped: &[Applied], job: &str) {
    for d in stopped {
        err(format_args!(
            "scaled {} {} to 0: job {job} has finished, so nothing rendezvouses through its etcd \
             any more (`trainctl job delete` removes it)",
            d.kind, d.name
        ));
    }
}

/// The job's pods' CPU, memory and GPU use.
pub(crate) fn top(top: &Top) {
    out_raw(format_args!("{}", top.render()));
}

/// One line of a pod's log (prefixed with its pod by `kube_api::logs`), or a doctor's check.
pub(crate) fn line(line: &str) {
    out(format_args!("{line}"));
}

/// `job render` shows the job's token Secret without its token (`job launch` writes a random
/// one): how to apply the YAML without trainctl.
pub(crate) fn token_withheld(secret: &str, namespace: &str) {
    err(format_args!(
        "Secret {secret} is shown without its token (trainctl job launch writes a random one); \
         to apply this YAML yourself, create it first: kubectl create secret generic {secret} \
         -n {namespace} --from-literal=token=$(openssl rand -hex 16)"
    ));
}

/// A helper job that outlived the time it was given.
pub(crate) fn not_finished(name: &str, after: Duration) {
    err(format_args!("job {name} has not finished after {after:?}"));
}

/// A file the command wrote for another tool (the eksctl config).
pub(crate) fn wrote(path: &Path) {
    super::wrote(path);
}

/// A command trainctl runs for the user (eksctl), said before it starts.
pub(crate) fn running(shown: &str) {
    err(format_args!("running: {shown}"));
}

/// A command for the user to run: `--dry-run`'s result, or what to run elsewhere.
pub(crate) fn command(shown: &str) {
    out(format_args!("{shown}"));
}

/// The program a command needs is not on this machine: the command follows on stdout.
pub(crate) fn not_installed(program: &str) {
    err(format_args!(
        "{program} is not installed here; run this where it is (https://eksctl.io/installation/):"
    ));
}

/// The availability zones trainctl chose because none were given.
pub(crate) fn zones_picked(zones: &[String], region: &str, instance_type: &str) {
    err(format_args!(
        "availability zones: {} (the first of {region}; give --az to choose others, e.g. where {instance_type} is offered)",
        zones.join(", ")
    ));
}

/// How to install the operator a launcher needs, which trainctl does not vendor.
pub(crate) fn install_operator(operator: &deploy::config::Operator) {
    out(format_args!("{}", operator.install));
}

/// One row of `config show`: a setting, its value (or none) and where the value came from.
pub(crate) fn setting(key: &str, width: usize, value: Option<(&str, &dyn std::fmt::Display)>) {
    match value {
        Some((value, source)) => out(format_args!("{key:<width$}  {value:<40}  {source}")),
        None => out(format_args!("{key:<width$}  {:<40}  (not set)", "-")),
    }
}

/// The doctor's verdict in a pod: how many checks failed, or that all passed.
pub(crate) fn checks_done(failed: usize) {
    if failed > 0 {
        out(format_args!("{failed} check(s) failed"));
    } else {
        out(format_args!("all checks passed"));
    }
}

/// The doctor job's verdict over every node.
pub(crate) fn doctor_passed() {
    out(format_args!("doctor: every check passed on every node"));
}

/// Where TensorBoard serves the job's runs, and how to reach it.
pub(crate) fn tensorboard_started(name: &str, ns: &str, runs: &str, port: u16) {
    out(format_args!(
        "TensorBoard reads {runs} on the claim. To open it from here:\n  kubectl \
         port-forward -n {ns} service/{name} {port}:{port}\nthen http://localhost:{port} \
         (inside the cluster: http://{name}.{ns}.svc:{port}). Remove it with trainctl \
         tensorboard --delete."
    ));
}
