//! `trainctl config show`: every setting's value and where it came from.

use deploy::config::{Project, SETTINGS};

use super::super::project::ProjectArgs;

#[derive(clap::Subcommand)]
pub enum ConfigCommand {
    /// Print every setting's effective value and where it came from.
    Show {
        #[command(flatten)]
        project: ProjectArgs,
    },
}

pub fn config(cmd: ConfigCommand) -> anyhow::Result<i32> {
    let ConfigCommand::Show { project } = cmd;
    let resolved = project.resolve()?;
    let width = SETTINGS.iter().map(|s| s.key.len()).max().unwrap_or(0);
    for s in SETTINGS {
        match resolved.values.get(s.key) {
            Some((value, source)) => println!("{:<width$}  {:<40}  {source}", s.key, value),
            None => println!("{:<width$}  {:<40}  (not set)", s.key, "-"),
        }
    }
    // Show the values first, then refuse the bad ones with the reason.
    Project::from_resolved(&resolved)?;
    Ok(0)
}
