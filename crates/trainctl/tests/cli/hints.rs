//! Every hint names a flag that the command it is printed for accepts. One test runs a failing
//! command line of each kind a user meets and checks each `--flag` word of its output against
//! the `--help` of the command that printed it, so a new hint cannot name a flag that is not
//! there.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use crate::support::*;

/// The long flags `trainctl PATH... --help` lists.
fn flags_of(path: &[&str]) -> BTreeSet<String> {
    let help = text(&run_ok(trainctl().args(path).arg("--help")).stdout);
    help_entries(&help)
        .0
        .iter()
        .flat_map(|(spec, _)| spec.split([',', ' ', '=']).map(str::to_string))
        .filter(|word| word.starts_with("--"))
        .collect()
}

/// The `--flag` words of `text` (not `---`, not the `--` that ends a launcher's flags).
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("--").map(|at| at + i) {
        let before_ok =
            at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'-');
        let end = text[at + 2..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
            .map_or(text.len(), |n| at + 2 + n);
        let word = &text[at..end];
        if before_ok && word.len() > 2 && word.as_bytes()[2].is_ascii_lowercase() {
            found.insert(word.trim_end_matches('-').to_string());
        }
        i = end.max(at + 2);
    }
    found
}

/// A failing command line and the commands whose flags its output may name (a launcher's
/// output names its own and the trainer's).
struct Case {
    what: &'static str,
    cmd: Command,
    commands: &'static [&'static [&'static str]],
    /// The output says this: the case reached the hint it is here for.
    says: &'static str,
}

fn case(
    what: &'static str,
    commands: &'static [&'static [&'static str]],
    says: &'static str,
    args: &[&str],
) -> Case {
    let mut cmd = trainctl();
    cmd.args(args);
    Case {
        what,
        cmd,
        commands,
        says,
    }
}

/// Trains `args` (a small run) to its end; the run's folder is `out/local`.
fn train(args: &[&str]) {
    run_ok(trainctl().arg("train").args(args).args([
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--threads",
        "1",
    ]));
}

/// Serves 404 to every request; returns an address on it.
fn not_found() -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "http://{}/cifar-10-binary.tar.gz",
        listener.local_addr().unwrap()
    );
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
    });
    url
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn every_hint_names_a_flag_of_its_command() {
    let job = Job::new(64, 16);
    let dir = job.dir.path();
    let (data, empty, out) = (job.data(), dir.join("empty"), dir.join("runs"));
    std::fs::create_dir_all(&empty).unwrap();
    // A finished run of the seed CNN (its model and checkpoint), and a 64-pixel ResNet trained
    // on an image folder.
    train(&["--data", s(&data), "--out", s(&out)]);
    let seed_model = out.join("local/model.safetensors");
    let checkpoint = out.join("local/checkpoint.ckpt");
    let folder = dir.join("folder");
    run_ok(
        trainctl()
            .args(["data", "synth", "--folder", "--out", s(&folder)])
            .args([
                "--train",
                "16",
                "--test",
                "4",
                "--classes",
                "2",
                "--image-size",
                "64",
            ]),
    );
    let resnet_out = dir.join("resnet");
    train(&[
        "--data",
        s(&folder),
        "--out",
        s(&resnet_out),
        "--model",
        "resnet18",
    ]);
    let resnet_model = resnet_out.join("local/model.safetensors");
    let no_val = dir.join("no-val");
    std::fs::create_dir_all(&no_val).unwrap();
    std::fs::rename(folder.join("train"), no_val.join("train")).unwrap();
    let missing = not_found();
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/cifar-10-binary.tar.gz", l.local_addr().unwrap())
    };
    let foreign = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = foreign.local_addr().unwrap().to_string();
    let other_out = dir.join("other");
    const TRAIN: &[&[&str]] = &[&["train"]];
    const EVAL: &[&[&str]] = &[&["eval"]];
    const RUN: &[&[&str]] = &[&["run"], &["train"]];
    let e = s(&empty);
    let o = s(&other_out);
    let cases = vec![
        case(
            "no data, downloads off",
            TRAIN,
            "drop --no-download",
            &["train", "--data", e, "--out", o, "--no-download"],
        ),
        case(
            "no data, downloads off, two workers",
            RUN,
            "drop --no-download",
            &["run", "--standalone", "--nproc-per-node", "2"],
        ),
        case(
            "eval without data",
            EVAL,
            "pass --download",
            &["eval", "--model", s(&seed_model), "--data", e],
        ),
        case(
            "eval of a 64-pixel model on CIFAR-10",
            EVAL,
            "evaluate it on the data set it was trained on",
            &["eval", "--model", s(&resnet_model), "--data", s(&data)],
        ),
        case(
            "train at 64 pixels on CIFAR-10",
            TRAIN,
            "drop --image-size",
            &[
                "train",
                "--data",
                s(&data),
                "--out",
                o,
                "--image-size",
                "64",
            ],
        ),
        case(
            "an image folder without val/",
            TRAIN,
            "--no-eval",
            &[
                "train",
                "--data",
                s(&no_val),
                "--out",
                o,
                "--image-size",
                "32",
            ],
        ),
        case(
            "a mirror that answers 404 (train)",
            TRAIN,
            "--download-url",
            &["train", "--data", e, "--out", o, "--download-url", &missing],
        ),
        case(
            "a mirror that answers 404 (eval)",
            EVAL,
            "--download-url",
            &[
                "eval",
                "--model",
                s(&seed_model),
                "--data",
                e,
                "--download",
                "--download-url",
                &missing,
            ],
        ),
        case(
            "a mirror that refuses",
            &[&["data", "fetch"]],
            "check the mirror's address (--download-url)",
            &["data", "fetch", "--data", e, "--download-url", &refused],
        ),
        case(
            "predict on a checkpoint",
            &[&["predict"]],
            "not a model file",
            &["predict", "--model", s(&checkpoint), s(&checkpoint)],
        ),
        case(
            "a finished run trained again",
            TRAIN,
            "--train-again",
            &[
                "train",
                "--data",
                s(&data),
                "--out",
                s(&out),
                "--epochs",
                "1",
            ],
        ),
        case(
            "another model resumed from a checkpoint",
            TRAIN,
            "--checkpoint-file",
            &[
                "train",
                "--data",
                s(&data),
                "--out",
                o,
                "--model",
                "resnet18",
                "--checkpoint-file",
                s(&checkpoint),
                "--epochs",
                "2",
            ],
        ),
        case(
            "a rendezvous port held by another program",
            RUN,
            "--rdzv-endpoint",
            &[
                "run",
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                &endpoint,
                "--rdzv-conf",
                "is_host=0,timeout=1",
                "--",
                "true",
            ],
        ),
        case(
            "a mistyped training flag under run",
            RUN,
            "--epochs",
            &["run", "--standalone", "train", "--epoch", "1"],
        ),
        case(
            "a mistyped launcher flag",
            RUN,
            "--nnodes",
            &["run", "--nnode", "2", "train"],
        ),
    ];
    let mut cases = cases;
    // The two-worker case's program and its arguments.
    cases[1]
        .cmd
        .args(["train", "--data", e, "--out", o, "--no-download"]);
    let outputs: Vec<(Case, String, BTreeSet<String>)> = std::thread::scope(|scope| {
        let runs: Vec<_> = cases
            .into_iter()
            .map(|mut c| {
                scope.spawn(move || {
                    let out = c.cmd.output().unwrap();
                    assert!(!out.status.success(), "{}: succeeded", c.what);
                    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
                    // A flag the user typed may be named back (a typo, with the suggestion).
                    let typed = c.cmd.get_args().map(|a| a.to_string_lossy().into_owned());
                    let accepted: BTreeSet<String> = c
                        .commands
                        .iter()
                        .flat_map(|path| flags_of(path))
                        .chain(typed)
                        .collect();
                    (c, said, accepted)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let mut wrong = Vec::new();
    for (c, said, accepted) in &outputs {
        assert!(
            said.contains(c.says),
            "{}: expected {:?} in\n{said}",
            c.what,
            c.says
        );
        for flag in flags_in(said) {
            if !accepted.contains(&flag) {
                wrong.push(format!(
                    "{}: {flag} (not a flag of {:?})\n{said}",
                    c.what, c.commands
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "hints naming flags that are not there:\n{}",
        wrong.join("\n")
    );
    drop(foreign);
}

/// The flag scanner finds flags in prose and leaves other dashes alone.
#[test]
fn flags_are_found_in_prose() {
    let found = flags_in("drop --no-download to fetch --dataset cifar10 (--out); a -- b ---x x--y");
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["--dataset", "--no-download", "--out"]
    );
}
