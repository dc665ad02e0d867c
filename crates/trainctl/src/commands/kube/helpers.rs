//! The one-pod helper jobs: `trainctl data job` (the data set onto the claim) and `trainctl test
//! job` (`trainctl eval` on the saved model).

use deploy::config::Renders;
use deploy::manifests;

use super::super::project::{ProjectArgs, uses};
use super::{bad_settings_are_usage, helper_job, print_yaml, reviewed, seconds};

#[derive(clap::Subcommand)]
pub(crate) enum TestCommand {
    /// Run `trainctl eval` on the saved model in the cluster and print the per-class table.
    Job {
        #[command(flatten)]
        project: ProjectArgs<uses::TestJob>,
        /// Print the Job instead of creating it.
        #[arg(long)]
        dry_run: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, default_value_t = 1800.0)]
        timeout: f64,
    },
}

pub(crate) fn data_job(
    project: ProjectArgs<uses::DataJob>,
    dry_run: bool,
    timeout: f64,
    synthetic: Option<u32>,
) -> anyhow::Result<i32> {
    bad_settings_are_usage((|| {
        let project = reviewed(project.project()?, Renders::HelperJob)?;
        let doc = manifests::data_job(&project, synthetic);
        if dry_run {
            print_yaml(&[doc]);
            return Ok(0);
        }
        helper_job(&project, doc, seconds("timeout", timeout)?)
    })())
}

pub(crate) fn test(cmd: TestCommand) -> anyhow::Result<i32> {
    bad_settings_are_usage(test_job(cmd))
}

fn test_job(cmd: TestCommand) -> anyhow::Result<i32> {
    let TestCommand::Job {
        project,
        dry_run,
        timeout,
    } = cmd;
    let project = reviewed(project.project()?, Renders::HelperJob)?;
    let doc = manifests::test_job(&project);
    if dry_run {
        print_yaml(&[doc]);
        return Ok(0);
    }
    helper_job(&project, doc, seconds("timeout", timeout)?)
}
