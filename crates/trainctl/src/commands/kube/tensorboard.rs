//! `trainctl tensorboard`: TensorBoard over the runs folder, beside the job.

use deploy::manifests;

use super::super::project::{ProjectArgs, uses};
use super::{apply_and_report, bad_settings_are_usage, connect, print_yaml, runtime};
use crate::output;

#[derive(clap::Args)]
pub(crate) struct TensorboardArgs {
    #[command(flatten)]
    project: ProjectArgs<uses::Tensorboard>,
    /// Print the objects instead of creating them.
    #[arg(long)]
    dry_run: bool,
    /// Remove TensorBoard's Deployment and Service (`job delete` removes them too).
    #[arg(long, conflicts_with = "dry_run")]
    delete: bool,
}

pub(crate) fn tensorboard(args: TensorboardArgs) -> anyhow::Result<i32> {
    bad_settings_are_usage(run(args))
}

fn run(args: TensorboardArgs) -> anyhow::Result<i32> {
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
            let none = format!("no TensorBoard of job {} to delete", project.job.name);
            output::kube::deleted(&kube.delete_matching(&selector).await?, Some(&none));
            return Ok(0);
        }
        apply_and_report(&kube, &docs).await?;
        output::kube::tensorboard_started(
            &name,
            &project.namespace,
            &project.job.runs_dir,
            manifests::TENSORBOARD_PORT,
        );
        Ok(0)
    })
}
