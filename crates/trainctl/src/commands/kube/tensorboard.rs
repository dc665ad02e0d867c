//! `trainctl tensorboard`: TensorBoard over the runs folder, beside the job.

use deploy::manifests;

use super::super::project::ProjectArgs;
use super::{apply_and_report, connect, print_yaml, runtime};

#[derive(clap::Args)]
pub struct TensorboardArgs {
    #[command(flatten)]
    project: ProjectArgs,
    /// Print the objects instead of creating them.
    #[arg(long)]
    dry_run: bool,
    /// Remove TensorBoard's Deployment and Service (`job delete` removes them too).
    #[arg(long, conflicts_with = "dry_run")]
    delete: bool,
}

pub fn tensorboard(args: TensorboardArgs) -> anyhow::Result<i32> {
    let project = args.project.project()?;
    let docs = manifests::tensorboard(&project);
    if args.dry_run {
        print_yaml(&docs);
        return Ok(0);
    }
    let name = manifests::tensorboard_name(&project);
    runtime()?.block_on(async {
        let kube = connect(&project).await?;
        if args.delete {
            let selector = manifests::component_selector(&project.job.name, "tensorboard");
            let deleted = kube.delete_matching(&selector).await?;
            if deleted.is_empty() {
                println!("no TensorBoard of job {} to delete", project.job.name);
            }
            for d in deleted {
                println!("deleted {} {}", d.kind, d.name);
            }
            return Ok(0);
        }
        apply_and_report(&kube, &docs).await?;
        let port = manifests::TENSORBOARD_PORT;
        println!(
            "TensorBoard reads {runs} on the claim. To open it from here:\n  kubectl \
             port-forward -n {ns} service/{name} {port}:{port}\nthen http://localhost:{port} \
             (inside the cluster: http://{name}.{ns}.svc:{port}). Remove it with trainctl \
             tensorboard --delete.",
            runs = project.job.runs_dir,
            ns = project.namespace,
        );
        Ok(0)
    })
}
