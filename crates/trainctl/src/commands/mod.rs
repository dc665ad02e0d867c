//! One file per subcommand: parse, call the library, report.

pub(crate) mod args;
pub(crate) mod bench;
pub(crate) mod checkpoint;
pub(crate) mod data;
pub(crate) mod eval;
pub(crate) mod install;
pub(crate) mod kube;
pub(crate) mod predict;
pub(crate) mod project;
pub(crate) mod report;
pub(crate) mod run;
pub(crate) mod s3;
pub(crate) mod train;

/// A command line that cannot work (a value out of range, an unknown flag or model): the
/// process exits 2, as for clap's own refusals, after the message says what to pass instead.
#[derive(Debug)]
pub(crate) struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// `e` as a [`Usage`] error: its message (with its causes), exit code 2.
pub(crate) fn usage(e: anyhow::Error) -> anyhow::Error {
    anyhow::Error::new(Usage(crate::output::chain(&e)))
}

/// The exit code for an error: 2 for a bad command line ([`Usage`]), else 1.
pub(crate) fn exit_code(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.is::<Usage>()) {
        2
    } else {
        1
    }
}
