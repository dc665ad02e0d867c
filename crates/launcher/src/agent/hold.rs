//! The admission hold: while a node's workers start, a node arriving to join waits for them a
//! while, so that a program which regroups in place takes it in place instead of being
//! restarted for it.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

/// How long, from their start, a node's workers may hold the admission of nodes waiting to
/// join while they start (at this node's first start, or again after they regrouped in place
/// before), until they say they regroup in place: enough for a PyTorch program's imports on a
/// loaded machine. A node arriving while the first workers import torch is then taken in place
/// rather than costing them a restart. A Python program that never says so (one without
/// `trainctl.torch`) holds a late node this long at its first start, then is restarted for it
/// as torchrun would; after that it holds nobody. A program that cannot say so
/// ([`may_regroup_in_place`]) holds nobody; under `--regroup restart` nothing is held.
pub(super) const ADMISSION_HOLD: Duration = Duration::from_secs(20);

/// Whether `program` may say it regroups in place once started: a Python program (it may
/// import `trainctl.torch`: an interpreter named `python…` or `pypy…`, or a `.py` file,
/// anywhere on its command line, so `uv run train.py` and `env python3 x.py` count), or
/// trainctl's own trainer (`trainctl train`). Anything else (`sleep`, a shell script, a
/// compiled program) never does, so its first start holds no late node: the late node is
/// admitted at once and the workers are restarted for it, as torchrun does.
pub(super) fn may_regroup_in_place(program: &[OsString]) -> bool {
    let name = |arg: &OsString| {
        Path::new(arg)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let trainer = matches!(program, [exe, verb, ..] if name(exe) == "trainctl" && verb == "train");
    trainer
        || program
            .iter()
            .map(name)
            .any(|n| n.starts_with("python") || n.starts_with("pypy") || n.ends_with(".py"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    #[test]
    fn python_programs_and_the_trainer_may_regroup_others_never() {
        for may in [
            &["python", "train.py"][..],
            &["/opt/venv/bin/python3.12", "-m", "pkg.train"],
            &["uv", "run", "train.py"],
            &["/usr/bin/env", "python3", "x.py"],
            &["./train.py"],
            &["pypy3", "t"],
            &["/usr/local/bin/trainctl", "train", "--epochs", "1"],
        ] {
            assert!(may_regroup_in_place(&argv(may)), "{may:?}");
        }
        for never in [
            &["sleep", "600"][..],
            &["bash", "run.sh"],
            &["/usr/local/bin/trainctl", "eval"],
            &["./a.out"],
            &[],
        ] {
            assert!(!may_regroup_in_place(&argv(never)), "{never:?}");
        }
    }
}
