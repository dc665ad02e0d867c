//! The project settings as command-line flags: one per [`deploy::config::SETTINGS`] entry,
//! generated from that table so that flags, variables and file keys never drift apart.
//!
//! Each command's `--help` lists the settings it reads (the table's `used_by`, picked by the
//! command's [`Uses`] marker), with their defaults; the others are accepted too, hidden, so
//! that one set of flags (a script's, a test's) serves every command, and `config show
//! --help` lists them all.

use std::marker::PhantomData;
use std::path::PathBuf;

use clap::{Arg, ArgMatches, Command, FromArgMatches};
use deploy::config::{Layers, Project, Resolved, SETTINGS, Setting, Source, UsedBy};

/// `--config FILE` and every setting's flag; `U` says which of them the command's help lists.
pub(crate) struct ProjectArgs<U> {
    pub config: Option<PathBuf>,
    pub flags: Vec<(&'static str, String)>,
    uses: PhantomData<fn() -> U>,
}

impl<U> Clone for ProjectArgs<U> {
    fn clone(&self) -> Self {
        ProjectArgs {
            config: self.config.clone(),
            flags: self.flags.clone(),
            uses: PhantomData,
        }
    }
}

impl<U> std::fmt::Debug for ProjectArgs<U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProjectArgs")
            .field("config", &self.config)
            .field("flags", &self.flags)
            .finish()
    }
}

/// Which settings a command reads: those whose `used_by` names one of `READS` (every setting
/// when it is empty).
pub(crate) trait Uses {
    const READS: &'static [UsedBy];
}

/// The commands' markers for [`ProjectArgs`].
pub(crate) mod uses {
    use deploy::config::UsedBy;

    macro_rules! markers {
        ($($(#[$doc:meta])* $name:ident => [$($reads:ident),*];)*) => {$(
            $(#[$doc])*
            pub(crate) struct $name;
            impl super::Uses for $name {
                const READS: &'static [UsedBy] = &[$(UsedBy::$reads),*];
            }
        )*};
    }

    markers! {
        /// `config show`: every setting.
        Every => [];
        /// `cluster config|create`.
        Cluster => [Cluster];
        /// `cluster addons`.
        Addons => [Cluster, Addons];
        /// `cluster delete`.
        ClusterDelete => [ClusterDelete];
        /// `storage`.
        Storage => [Storage];
        /// `data job`.
        DataJob => [DataJob];
        /// `test job`.
        TestJob => [TestJob];
        /// `doctor`.
        Doctor => [Doctor];
        /// `job render|launch`.
        Training => [Training];
        /// `job status|wait|logs|top|delete`.
        Lookup => [Lookup];
        /// `tensorboard`.
        Tensorboard => [Tensorboard];
    }
}

const HEADING: &str = "Project settings (flag > TRAINCTL_* > trainctl.toml > default)";
const HEADING_SOME: &str = "Project settings this command reads (flag > TRAINCTL_* > \
                            trainctl.toml > default; all of them: trainctl config show --help)";

/// What a setting is when nothing sets it, for its help: `[default: 10]`, `[default: 13, from
/// --instance-type]`; nothing when it has none.
fn default_of(s: &Setting, defaults: &Resolved) -> String {
    let Some((value, source)) = defaults.values.get(s.key) else {
        return String::new();
    };
    match source {
        Source::Preset(preset) => format!(" [default: {value} with --preset {preset}]"),
        Source::Derived(from) => {
            let flag = deploy::config::setting(from).map_or(*from, |f| f.flag);
            format!(" [default: {value}, from {flag}]")
        }
        _ => format!(" [default: {value}]"),
    }
}

impl<U: Uses> clap::Args for ProjectArgs<U> {
    fn augment_args(cmd: Command) -> Command {
        let every = U::READS.is_empty();
        let heading = if every { HEADING } else { HEADING_SOME };
        let mut cmd = cmd.arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("Project file [default: ./trainctl.toml when present] [env: TRAINCTL_CONFIG]")
                .help_heading(heading),
        );
        let no_env = |_: &str| None;
        let nothing = Layers {
            flags: Vec::new(),
            env: &no_env,
            file: None,
        };
        let defaults = Resolved::resolve(&nothing).expect("no file, nothing to misread");
        for s in SETTINGS {
            let mut arg = Arg::new(s.key)
                .long(s.flag.trim_start_matches("--"))
                .value_name("VALUE")
                .help(format!(
                    "{}{} [env: {}]",
                    s.help,
                    default_of(s, &defaults),
                    s.env_var()
                ))
                .help_heading(heading)
                .hide(!every && !s.used_by_any(U::READS));
            if let Some(alias) = s.alias {
                arg = arg.visible_alias(alias.trim_start_matches("--"));
            }
            cmd = cmd.arg(arg);
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl<U> FromArgMatches for ProjectArgs<U> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = ProjectArgs {
            config: m.get_one::<PathBuf>("config").cloned(),
            flags: Vec::new(),
            uses: PhantomData,
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

impl<U> ProjectArgs<U> {
    /// The layered values and where each came from (no checks beyond the file's syntax).
    pub(crate) fn resolve(&self) -> anyhow::Result<Resolved> {
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
    pub(crate) fn project(&self) -> anyhow::Result<Project> {
        Ok(Project::from_resolved(&self.resolve()?)?)
    }
}
