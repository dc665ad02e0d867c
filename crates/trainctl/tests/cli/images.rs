//! ResNets on image folders: learning on two workers, exact resume, evaluation and prediction
//! with class names, tiny-imagenet's layout fetched from a local server, unreadable images.

use std::path::{Path, PathBuf};
use std::time::Duration;

use trainer::data::synthetic::{FolderSpec, write_folder};

use crate::support::*;

/// Eight colour classes at 32×32: chance is 12.5 %.
fn folder(dir: &Path, tiny_layout: bool) -> FolderSpec {
    let spec = FolderSpec {
        classes: 8,
        train_per_class: 24,
        val_per_class: 4,
        size: 32,
        tiny_layout,
        seed: 3,
    };
    write_folder(dir, &spec).unwrap();
    spec
}

fn resnet_args(data: &Path, out: &Path, epochs: usize) -> Vec<String> {
    [
        "train",
        "--model",
        "resnet18",
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        &epochs.to_string(),
        "--batch-size",
        "16",
        "--learning-rate",
        "0.02",
        "--print-freq",
        "1",
        "--seed",
        "5",
        "--threads",
        "1",
        "--loader-threads",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn two_workers() -> std::process::Command {
    let mut cmd = trainctl();
    cmd.args(["run", "--standalone", "--nproc-per-node", "2"]);
    cmd
}

fn report_lines(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[0]:"))
        .filter(|l| l.starts_with("Accuracy") || l.starts_with("Top-5"))
        .map(str::to_string)
        .collect()
}

fn top1(report: &[String]) -> f64 {
    report[0]
        .rsplit(": ")
        .next()
        .and_then(|s| s.trim_end_matches(" %").parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {report:?}"))
}

#[test]
fn a_resnet_learns_an_image_folder_on_two_workers_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    folder(&data, false);
    let mut args = resnet_args(&data, &dir.path().join("a"), 4);
    args.extend(["--checkpoint-every".into(), "3".into()]);
    let whole = text(&run_ok(two_workers().args(&args)).stdout);

    // 192 images / 2 ranks / 16 per step = 6 steps an epoch.
    let loss = losses(&whole);
    assert_eq!(loss.len(), 4 * 6, "{whole}");
    let (first, last) = (
        loss[..4].iter().sum::<f32>(),
        loss[20..].iter().sum::<f32>(),
    );
    assert!(last < first * 0.5, "loss must fall: {loss:?}");
    let expected = finished(&whole);
    assert_eq!(expected.len(), 2, "{whole}");
    assert_eq!(
        expected[0].2, expected[1].2,
        "ranks end with identical weights"
    );
    let report = report_lines(&whole);
    assert_eq!(report.len(), 2 + 8, "top-1, top-5, eight classes: {whole}");
    assert!(report[1].starts_with("Top-5 accuracy: "), "{report:?}");
    assert!(
        top1(&report) > 50.0,
        "well above chance (12.5 %): {report:?}"
    );
    assert!(
        report.iter().any(|l| l.contains("class: colour07 ")),
        "{report:?}"
    );

    // The model file describes itself: eval and predict need only it and the images.
    let model = dir.path().join("a/local/model.safetensors");
    let eval = text(
        &run_ok(
            trainctl()
                .args(["eval", "--model"])
                .arg(&model)
                .arg("--data")
                .arg(&data),
        )
        .stdout,
    );
    assert_eq!(eval.lines().collect::<Vec<_>>(), report, "{eval}");
    let image = data.join("val/colour03/00001.jpg");
    let predicted = text(
        &run_ok(
            trainctl()
                .args(["predict", "--model"])
                .arg(&model)
                .arg(&image),
        )
        .stdout,
    );
    assert!(
        predicted.starts_with(&format!("{}: colour", image.display())),
        "{predicted}"
    );

    // Killed after the checkpoint at step 9 (the middle of epoch 2), then rerun: the same
    // weights as the uninterrupted run.
    let mut args_b = resnet_args(&data, &dir.path().join("b"), 4);
    args_b.extend(["--checkpoint-every".into(), "3".into(), "--no-eval".into()]);
    let mut first = Running::start(two_workers().args(&args_b));
    first.wait_for_line(Duration::from_secs(180), |l| {
        l.contains("checkpoint saved at step 9")
    });
    first.kill_launcher(2);
    let resumed = text(&run_ok(two_workers().args(&args_b)).stdout);
    assert!(resumed.contains("resuming from checkpoint"), "{resumed}");
    assert!(
        losses(&resumed).len() < loss.len(),
        "the rerun does not start over"
    );
    let got = finished(&resumed);
    assert_eq!(got[0].1, expected[0].1, "{resumed}");
    assert_eq!(
        got[0].2, expected[0].2,
        "resuming mid-epoch is exact, augmentation included"
    );
}

/// `root`'s files as a zip, named relative to `root`, as the official archive is made.
pub(crate) fn zip_dir(root: &Path) -> Vec<u8> {
    use std::io::Write;
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(root, &mut files);
    let mut buf = std::io::Cursor::new(Vec::new());
    let mut zip = zip::ZipWriter::new(&mut buf);
    for f in files {
        let name = f.strip_prefix(root).unwrap().to_str().unwrap().to_string();
        zip.start_file(name, zip::write::SimpleFileOptions::default())
            .unwrap();
        zip.write_all(&std::fs::read(&f).unwrap()).unwrap();
    }
    zip.finish().unwrap();
    buf.into_inner()
}

#[test]
fn tiny_imagenet_is_fetched_checked_extracted_and_trained_on() {
    use md5::{Digest, Md5};
    let source = tempfile::tempdir().unwrap();
    folder(source.path(), true);
    let archive = zip_dir(source.path());
    let md5 = format!("{:x}", Md5::digest(&archive));
    let url = serve(archive, "tiny-imagenet-200.zip");

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let wrong = run_failing(
        trainctl()
            .args([
                "data",
                "fetch",
                "--dataset",
                "tiny-imagenet",
                "--download-url",
                &url,
                "--download-md5",
                "00000000000000000000000000000000",
                "--data",
            ])
            .arg(&data),
    );
    assert!(
        wrong.contains("MD5 of the archive is") && wrong.contains(&md5),
        "{wrong}"
    );
    assert!(
        !data.join("tiny-imagenet-200").exists(),
        "nothing extracted from a bad archive"
    );

    let out = text(
        &run_ok(
            trainctl()
                .args([
                    "data",
                    "fetch",
                    "--dataset",
                    "tiny-imagenet",
                    "--download-url",
                    &url,
                    "--download-md5",
                    &md5,
                    "--data",
                ])
                .arg(&data),
        )
        .stdout,
    );
    assert!(out.contains("tiny-imagenet-200 in"), "{out}");
    assert!(
        data.join("tiny-imagenet-200/val/val_annotations.txt")
            .is_file()
    );
    let leftovers: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "tiny-imagenet-200")
        .collect();
    assert!(leftovers.is_empty(), "no partial files: {leftovers:?}");

    // One worker, one epoch: classes named from words.txt, evaluated on val/images.
    let mut args = resnet_args(&data, &dir.path().join("runs"), 1);
    args.extend([
        "--no-download".into(),
        "--augment".into(),
        "resized-crop".into(),
    ]);
    let stdout = text(&run_ok(trainctl().args(&args)).stdout);
    assert!(
        stdout.contains("Accuracy of the network on the 32 test images"),
        "{stdout}"
    );
    assert!(stdout.contains("Accuracy for class: colour05 "), "{stdout}");
}

#[test]
fn an_unreadable_image_is_named_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    folder(&data, false);
    let bad = data.join("train/colour02/00003.jpg");
    std::fs::write(&bad, b"\xff\xd8\xff\xe0 this is not a JPEG").unwrap();
    let mut args = resnet_args(&data, &dir.path().join("runs"), 1);
    args.push("--no-eval".into());
    let out = run_ok(trainctl().args(&args));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&bad.display().to_string()) && stderr.contains("skipped"),
        "{stderr}"
    );
    assert!(
        stderr.contains("1 unreadable images were skipped"),
        "{stderr}"
    );
    assert!(
        text(&out.stdout).contains("finished after 12 steps"),
        "one epoch all the same"
    );
    // What was trained is counted, the unreadable image is not: in the finish line and in
    // the epoch's digest.
    let images = std::fs::read_dir(data.join("train"))
        .unwrap()
        .map(|class| std::fs::read_dir(class.unwrap().path()).unwrap().count())
        .sum::<usize>();
    assert!(
        text(&out.stdout).contains(&format!("{} samples trained in all", images - 1)),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn wrong_models_sizes_and_folders_are_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    folder(&data, false);
    let out = dir.path().join("runs");
    // An unknown network is a bad command line (exit 2), before anything is read.
    let mut unknown = resnet_args(&data, &out, 1);
    unknown[2] = "resnet7".to_string();
    let refused = trainctl().args(&unknown).output().unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(text(&refused.stderr).contains("choose seed-cnn, resnet18"));
    let cases: [(&str, Vec<&str>, &str); 2] = [
        (
            "seed-cnn",
            vec!["--image-size", "64"],
            "the seed CNN takes 32×32 images",
        ),
        ("resnet18", vec!["--image-size", "16"], "at least 32×32"),
    ];
    for (model, extra, expected) in cases {
        let mut args = resnet_args(&data, &out, 1);
        args[2] = model.to_string();
        args.extend(extra.iter().map(|s| s.to_string()));
        let err = run_failing(trainctl().args(&args));
        assert!(err.contains(expected), "{model} {extra:?}: {err}");
    }
    // A checkpoint of another network is named, not used.
    let mut seed = resnet_args(&data, &out, 1);
    seed[2] = "seed-cnn".into();
    seed.extend(["--no-eval".into(), "--image-size".into(), "32".into()]);
    run_ok(trainctl().args(&seed));
    let err = run_failing(trainctl().args(resnet_args(&data, &out, 2)));
    assert!(
        err.contains("written for the network seed-cnn, this run has --model resnet18")
            && err.contains("not used"),
        "{err}"
    );
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(data.join("val")).unwrap();
    let err = run_failing(trainctl().args(resnet_args(&data, &out, 1)));
    assert!(
        err.contains("no validation folder") && err.contains("--no-eval"),
        "{err}"
    );
    assert!(
        !out.join("local/checkpoint.ckpt").exists(),
        "refused before any step"
    );
}
