//! `trainctl config show`: every setting's value and where it came from.

use deploy::config::{Project, SETTINGS};

use super::super::project::{ProjectArgs, uses};
use super::bad_settings_are_usage;
use crate::output;

#[derive(clap::Subcommand)]
pub(crate) enum ConfigCommand {
    /// Print every setting's effective value and where it came from.
    Show {
        #[command(flatten)]
        project: ProjectArgs<uses::Every>,
    },
}

pub(crate) fn config(cmd: ConfigCommand) -> anyhow::Result<i32> {
    bad_settings_are_usage(show(cmd))
}

fn show(cmd: ConfigCommand) -> anyhow::Result<i32> {
    let ConfigCommand::Show { project } = cmd;
    let resolved = project.resolve()?;
    let width = SETTINGS.iter().map(|s| s.key.len()).max().unwrap_or(0);
    for s in SETTINGS {
        let value = resolved.values.get(s.key);
        let value = value.map(|(v, source)| (v.as_str(), source as &dyn std::fmt::Display));
        output::kube::setting(s.key, width, value);
    }
    // Show the values first, then refuse the bad ones with the reason.
    Project::from_resolved(&resolved)?;
    Ok(0)
}
