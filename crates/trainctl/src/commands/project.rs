//! The project settings as command-line flags: one per [`deploy::config::SETTINGS`] entry,
//! generated from that table so that flags, variables and file keys never drift apart.

use std::path::PathBuf;

use clap::{Arg, ArgMatches, Command, FromArgMatches};
use deploy::config::{Layers, Project, Resolved, SETTINGS};

/// `--config FILE` and every setting's flag.
#[derive(Debug, Clone, Default)]
pub struct ProjectArgs {
    pub config: Option<PathBuf>,
    pub flags: Vec<(&'static str, String)>,
}

const HEADING: &str = "Project settings (flag > TRAINCTL_* > trainctl.toml > default)";

impl clap::Args for ProjectArgs {
    fn augment_args(cmd: Command) -> Command {
        let mut cmd = cmd.arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("Project file [default: ./trainctl.toml when present; env: TRAINCTL_CONFIG]")
                .help_heading(HEADING),
        );
        for s in SETTINGS {
            cmd = cmd.arg(
                Arg::new(s.key)
                    .long(s.flag.trim_start_matches("--"))
                    .value_name("VALUE")
                    .help(format!("{} [{}]", s.help, s.env_var()))
                    .help_heading(HEADING),
            );
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for ProjectArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = ProjectArgs {
            config: m.get_one::<PathBuf>("config").cloned(),
            flags: Vec::new(),
        };
        for s in SETTINGS {
            if let Some(v) = m.get_one::<String>(s.key) {
                args.flags.push((s.key, v.clone()));
            }
        }
        Ok(args)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// The project's variables: `TRAINCTL_*` only. The worker environment is read in
/// collective::world; this is the one other place trainctl reads variables, for the settings.
#[allow(clippy::disallowed_methods)]
fn env_lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl ProjectArgs {
    /// The layered values and where each came from (no checks beyond the file's syntax).
    pub fn resolve(&self) -> anyhow::Result<Resolved> {
        let config = self
            .config
            .clone()
            .or_else(|| env_lookup("TRAINCTL_CONFIG").map(PathBuf::from));
        let layers = Layers {
            flags: self.flags.clone(),
            env: &env_lookup,
            file: Layers::read_file(config.as_deref())?,
        };
        Ok(Resolved::resolve(&layers)?)
    }

    /// The checked project: bad values are refused here, before anything is rendered.
    pub fn project(&self) -> anyhow::Result<Project> {
        Ok(Project::from_resolved(&self.resolve()?)?)
    }
}
