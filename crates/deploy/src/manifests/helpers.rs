//! One-pod helper jobs: the data job, the test job and the doctor.

use std::collections::BTreeMap;

use crate::config::Project;

use super::Manifest;
use super::pod::{PodOptions, headless_service, job, pod_template};

/// `data job`: downloads and verifies the data set onto the claim (a no-op when it is there),
/// copies it from S3 (`data.from`: files already there are skipped), or, with
/// `synthetic: Some(n)`, writes a small generated set of `n` training images in the same
/// layout (to try a cluster out without the download).
pub fn data_job(project: &Project, synthetic: Option<u32>) -> Manifest {
    let args = match (synthetic, &project.data.from) {
        (None, Some(from)) => vec![
            "data".into(),
            "stage".into(),
            from.clone(),
            project.data.dir.clone(),
        ],
        (None, None) => {
            let mut args = vec!["data".into(), "fetch".into()];
            if project.data.dataset != contract::CIFAR10 {
                args.extend(["--dataset".into(), project.data.dataset.name.to_string()]);
            }
            args.extend([
                "--data".into(),
                project.data.dir.clone(),
                "--download-url".into(),
                project.data.url.clone(),
                "--download-md5".into(),
                project.data.md5.clone(),
            ]);
            args
        }
        (Some(n), _) => vec![
            "data".into(),
            "synth".into(),
            "--out".into(),
            project.data.dir.clone(),
            "--train".into(),
            n.to_string(),
            "--test".into(),
            (n / 4).max(10).to_string(),
        ],
    };
    helper_job(project, "data", args, 3)
}

/// A one-pod Job NAME-COMPONENT running `trainctl ARGS` in the trainctl image, in a container
/// named after what it does (COMPONENT), retried up to `backoff` times.
fn helper_job(
    project: &Project,
    component: &'static str,
    args: Vec<String>,
    backoff: i32,
) -> Manifest {
    let template = pod_template(
        project,
        PodOptions {
            runs_trainctl: true,
            component,
            container: component,
            image: project.trainctl_image.clone(),
            args,
            training_size: false,
            accelerators: false,
            user_program: false,
            port: None,
            metrics_port: None,
            token_secret: None,
            subdomain: None,
            service_account: true,
        },
    );
    Manifest::of(&job(
        project,
        &format!("{}-{component}", project.job.name),
        template,
        (1, false),
        backoff,
    ))
}

/// `test job`: the seed's test job, `trainctl eval` on the saved model.
pub fn test_job(project: &Project) -> Manifest {
    let args = vec![
        "eval".into(),
        "--model".into(),
        project.job.model_path(),
        "--data".into(),
        project.data.dir.clone(),
    ];
    helper_job(project, "test", args, 1)
}

pub fn doctor_job_name(project: &Project) -> String {
    format!("{}-doctor", project.job.name)
}

/// `doctor`: one pod per node, each checking DNS, the rendezvous port, every peer and the
/// claim, from inside the cluster (`trainctl doctor check`).
pub fn doctor_job(project: &Project) -> Vec<Manifest> {
    let j = &project.job;
    let name = doctor_job_name(project);
    let pods = j.max_nodes;
    let peers: Vec<String> = (0..pods).map(|i| format!("{name}-{i}.{name}")).collect();
    let mut args = vec![
        "doctor".into(),
        "check".into(),
        "--peers".into(),
        peers.join(","),
        "--port".into(),
        j.rdzv_port.to_string(),
        "--claim".into(),
        project.storage.mount_path.clone(),
        "--data".into(),
        project.data.dir.clone(),
    ];
    let (gpus, adapters) = project.accelerators();
    if gpus > 0 {
        args.extend(["--expect-gpus".into(), gpus.to_string()]);
    }
    if adapters > 0 {
        args.extend(["--expect-efa".into(), adapters.to_string()]);
    }
    let template = pod_template(
        project,
        PodOptions {
            runs_trainctl: true,
            component: "doctor",
            container: "doctor",
            image: project.trainctl_image.clone(),
            args,
            training_size: false,
            accelerators: true,
            user_program: false,
            port: Some(j.rdzv_port),
            metrics_port: None,
            token_secret: None,
            subdomain: Some(name.clone()),
            service_account: false,
        },
    );
    let mut template = template;
    // The doctor checks the nodes the training will use (its pods take their GPUs and EFA
    // adapters, and tolerate GPU nodes' taint, so it sees what a training pod sees).
    if let Some(spec) = template.spec.as_mut()
        && let Some((k, v)) = j.node_selector.as_ref()
    {
        spec.node_selector = Some(BTreeMap::from([(k.clone(), v.clone())]));
    }
    let service = headless_service(project, &name, "doctor", j.rdzv_port);
    vec![
        Manifest::of(&service),
        // Indexed whatever the count: the peers are named NAME-INDEX.NAME.
        Manifest::of(&job(project, &name, template, (pods as i32, true), 0)),
    ]
}
