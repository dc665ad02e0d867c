//! `--launcher indexed`: an Indexed Job and its headless Service. Needs no operator: each pod
//! gets a stable name (NAME-INDEX) and DNS name, a lost pod is replaced under its index, and
//! the podFailurePolicy tells evictions and trainctl's own exits apart from failures.
//!
//! Elastic: `job scale` patches completions and parallelism together (Kubernetes' elastic
//! Indexed Job, 1.27+): the Job controller deletes the pods of the indexes removed (their
//! agents leave gracefully) and creates the new ones (they join in place). The successPolicy
//! ends the job, Succeeded, when pod 0 has (1.31+): a node's agent exits 0 only once every
//! node's workers have finished (the rendezvous' exit barrier), so its success says training
//! is over, and a pod still Pending then is removed instead of keeping the job running. Pod 0
//! is the one that may stay last (the c10d store's host keeps the store up for a node lost
//! near the end): the others have ended by then, so the policy removes none that still runs,
//! and every pod's logs stay.

use k8s_openapi::api::batch::v1::{Job, SuccessPolicy, SuccessPolicyRule};
use kube::api::{ApiResource, DynamicObject};

use crate::config::{Launcher, Project};
use crate::manifests::{Manifest, headless_service, job};
use crate::status::JobStatus;

use super::Kind;
use super::training::{
    Token, queue_label, rendezvous_objects, sizing_annotations, worker_template,
};

pub struct Indexed;

impl Kind for Indexed {
    fn launcher(&self) -> Launcher {
        Launcher::Indexed
    }

    fn resources(&self) -> Vec<ApiResource> {
        vec![ApiResource::erase::<Job>(&())]
    }

    fn render(&self, project: &Project, token: Token) -> Vec<Manifest> {
        let j = &project.job;
        let template = worker_template(project, crate::manifests::CONTAINER, Some(j.name.clone()));
        let service = headless_service(project, &j.name, "worker", j.rdzv_port);
        // Spares beyond MAX: their agents wait, workers warm, for a node's place.
        let pods = (j.max_nodes + j.spares) as i32;
        // A lost pod is replaced under the same index and rejoins; each node may fail
        // max_restarts times (failures the podFailurePolicy ignores do not count) before
        // Kubernetes gives up on the job.
        let backoff = (j.max_restarts as i32).saturating_mul(pods).max(1);
        let mut job = job(project, &j.name, template, (pods, true), backoff);
        if let Some(spec) = job.spec.as_mut() {
            // Per index, the Job controller also delays a replacement by the failures of that
            // index alone (10 s doubling, counting the ignored ones), not of the whole job: a
            // node lost after others were waits 10 s, not 10 s × 2^(losses so far). One index
            // past its limit fails the job at once, as the job's limit did. Servers before 1.29
            // drop both fields and keep backoffLimit, the whole job's limit.
            spec.backoff_limit_per_index = Some(j.max_restarts as i32);
            spec.max_failed_indexes = Some(0);
            // Training is over when pod 0 has succeeded (its agent passed the exit barrier:
            // every node's workers finished), whatever the job's size then. Pod 0, not any
            // pod: it may end last (lingering as the store's host), and a pod still running
            // when the policy is met is removed, its logs with it.
            spec.success_policy = Some(SuccessPolicy {
                rules: vec![SuccessPolicyRule {
                    succeeded_count: None,
                    succeeded_indexes: Some("0".into()),
                }],
            });
        }
        queue_label(project, &mut job.metadata);
        sizing_annotations(project, &mut job.metadata);
        let mut out = rendezvous_objects(project, token);
        out.push(Manifest::of(&service));
        out.push(Manifest::of(&job));
        out
    }

    fn rdzv_host(&self, project: &Project) -> String {
        // Indexed Job pods are NAME-INDEX, in the headless Service's subdomain NAME.
        let name = &project.job.name;
        format!("{name}-0.{name}")
    }

    fn runs_a_job(&self) -> bool {
        true
    }

    fn status(&self, object: &DynamicObject) -> JobStatus {
        JobStatus::from_job(&read_job(object))
    }

    fn pod_job_label(&self) -> &'static str {
        "batch.kubernetes.io/job-name"
    }

    fn scales(&self) -> Result<(), &'static str> {
        Ok(())
    }

    fn size(&self, object: &DynamicObject) -> Option<u32> {
        let completions = read_job(object).spec?.completions?;
        u32::try_from(completions).ok()
    }

    fn size_patch(&self, nodes: u32) -> Option<serde_json::Value> {
        // Kubernetes takes a new completions only with the same parallelism.
        Some(serde_json::json!({ "spec": { "completions": nodes, "parallelism": nodes } }))
    }
}

/// The server's Job read back into its type; a Job always reads (every field optional).
fn read_job(object: &DynamicObject) -> Job {
    object.clone().try_parse().unwrap_or_default()
}
