//! README's examples, run as written in a scratch folder, so that the README cannot drift from
//! the tool. What a reader supplies is supplied here: the images they classify, and (these
//! machines cannot download data sets) a local server for `data fetch`, whose address and MD5
//! are the one thing added to a command line.

use std::path::{Path, PathBuf};

use md5::{Digest, Md5};
use trainer::data::synthetic::{FolderSpec, write_folder};

use crate::support::*;

fn readme() -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
        .unwrap()
}

/// The commands of the first `sh` block after the line starting with `after`: continuation
/// lines joined, comments dropped, `a && b` split in two.
fn block_after(readme: &str, after: &str) -> Vec<String> {
    let start = readme
        .find(after)
        .unwrap_or_else(|| panic!("README has no {after:?}"));
    let block = readme[start..]
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap_or_else(|| panic!("no sh block after {after:?}"));
    let joined = block.replace("\\\n", " ");
    joined
        .lines()
        .map(|l| l.split(" #").next().unwrap_or(l).trim())
        .filter(|l| !l.is_empty())
        .flat_map(|l| l.split("&&").map(|c| c.trim().to_string()))
        .collect()
}

/// Runs each `trainctl ...` command in `dir` (the alias the block sets up is the binary under
/// test; `cargo build` is the test's own build), `edit`ing its words first.
fn walk(commands: &[String], dir: &Path, edit: impl Fn(Vec<String>) -> Vec<String>) -> usize {
    let mut ran = 0;
    for command in commands {
        let words: Vec<String> = command.split_whitespace().map(String::from).collect();
        match words.first().map(String::as_str) {
            Some("cargo") | Some("alias") => continue,
            Some("trainctl") => {}
            _ => panic!("not a trainctl command: {command}"),
        }
        let words = edit(words);
        let out = trainctl()
            .args(&words[1..])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "README's `{command}` failed ({}):\n{}{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        ran += 1;
    }
    ran
}

/// A photo of the reader's, as `name` (JPEG or PNG by its extension).
fn photo(dir: &Path, name: &str) {
    image::RgbImage::from_fn(48, 40, |x, y| {
        image::Rgb([(x * 5) as u8, (y * 6) as u8, 90])
    })
    .save(dir.join(name))
    .unwrap();
}

#[test]
fn the_cli_examples_run_as_written() {
    let commands = block_after(&readme(), "Examples (a test runs them");
    assert!(commands.len() >= 5, "{commands:?}");
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny");
    for name in ["cat.jpg", "ship.png"] {
        photo(dir.path(), name);
    }
    // The block's scratch data set, in this test's own folder.
    let ran = walk(&commands, dir.path(), |words| {
        words
            .into_iter()
            .map(|w| w.replace("/tmp/tiny", tiny.to_str().unwrap()))
            .collect()
    });
    assert_eq!(ran, 5, "every trainctl command: {commands:?}");
    assert!(dir.path().join("runs/local/model.safetensors").is_file());
    assert!(dir.path().join("runs/local/report/report.html").is_file());
}

#[test]
fn the_resnet_examples_run_as_written() {
    let commands = block_after(&readme(), "### ResNets on image folders");
    let source = tempfile::tempdir().unwrap();
    write_folder(
        source.path(),
        &FolderSpec {
            classes: 4,
            train_per_class: 8,
            val_per_class: 2,
            size: 32,
            tiny_layout: true,
            seed: 3,
        },
    )
    .unwrap();
    let archive = crate::images::zip_dir(source.path());
    let md5 = format!("{:x}", Md5::digest(&archive));
    let url = serve(archive, "tiny-imagenet-200.zip");
    let dir = tempfile::tempdir().unwrap();
    photo(dir.path(), "dog.jpg");
    let ran = walk(&commands, dir.path(), |mut words| {
        if words[1..3] == ["data", "fetch"] {
            words.extend(["--download-url".into(), url.clone()]);
            words.extend(["--download-md5".into(), md5.clone()]);
        }
        words
    });
    assert_eq!(ran, 4, "{commands:?}");
    assert!(dir.path().join("runs/local/model.safetensors").is_file());
}
