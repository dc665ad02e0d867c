//! One file per subcommand: parse, call the library, report.

pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod eval;
pub mod install;
pub mod kube;
pub mod predict;
pub mod project;
pub mod report;
pub mod run;
pub mod s3;
pub mod train;

/// A command line that cannot work (a value out of range, an unknown flag or model): the
/// process exits 2, as for clap's own refusals, after the message says what to pass instead.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// `e` as a [`Usage`] error: its message (with its causes), exit code 2.
pub fn usage(e: anyhow::Error) -> anyhow::Error {
    anyhow::Error::new(Usage(crate::output::chain(&e)))
}

/// The exit code for an error: 2 for a bad command line ([`Usage`]), else 1.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.is::<Usage>()) {
        2
    } else {
        1
    }
}
