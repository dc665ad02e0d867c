//! `trainctl storage`: the StorageClass, PersistentVolume and ReadWriteMany claim (applied
//! only when all of them can be; `--delete` removes them).

use deploy::manifests;

use super::super::project::{ProjectArgs, uses};
use super::{bad_settings_are_usage, connect, print_yaml, runtime};
use crate::output;

#[derive(clap::Args)]
pub(crate) struct StorageArgs {
    #[command(flatten)]
    project: ProjectArgs<uses::Storage>,
    /// Print the objects instead of creating them.
    #[arg(long)]
    dry_run: bool,
    /// Remove the claim, the volume and the class instead (the data stays on the file system:
    /// the volume's reclaim policy is Retain). Stop the jobs that use it first.
    #[arg(long, conflicts_with = "dry_run")]
    delete: bool,
}

pub(crate) fn storage(args: StorageArgs) -> anyhow::Result<i32> {
    bad_settings_are_usage(run(args))
}

fn run(args: StorageArgs) -> anyhow::Result<i32> {
    let project = args.project.project()?;
    let docs = manifests::storage(&project)?;
    if args.dry_run {
        print_yaml(&docs);
        return Ok(0);
    }
    runtime()?.block_on(async {
        let kube = connect(&project).await?;
        if args.delete {
            let none = format!("no storage {} to delete", project.storage.claim);
            output::kube::deleted(&kube.delete_storage(&docs).await?, Some(&none));
        } else {
            output::kube::applied(&kube.apply_storage(&docs).await?, false);
        }
        anyhow::Ok(())
    })?;
    Ok(0)
}
