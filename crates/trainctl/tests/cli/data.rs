//! Getting the data: download from a local HTTP server, MD5 checks, missing data.

use md5::{Digest, Md5};

use crate::support::*;

fn archive() -> (Vec<u8>, String) {
    let bytes = cifar_archive(50, 20);
    let md5 = format!("{:x}", Md5::digest(&bytes));
    (bytes, md5)
}

#[test]
fn missing_data_is_downloaded_verified_and_extracted() {
    let (bytes, md5) = archive();
    let bytes_len = bytes.len();
    let url = serve(bytes, "cifar-10-binary.tar.gz");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = run_ok(trainctl().args([
        "data",
        "fetch",
        "--data",
        data.to_str().unwrap(),
        "--download-url",
        &url,
        "--download-md5",
        &md5,
    ]));
    assert!(text(&out.stdout).contains("cifar-10-batches-bin"));
    assert!(data.join("cifar-10-batches-bin/data_batch_1.bin").is_file());
    // Not a terminal: progress comes as plain lines, ending at the archive's full size.
    let err = text(&out.stderr);
    let mb = format!("{:.1}", bytes_len as f64 / 1e6);
    assert!(
        err.contains(&format!("downloading CIFAR-10: {mb} of {mb} MB (100 %)")),
        "{err}"
    );
    assert!(
        err.contains(&format!("extracting CIFAR-10: {mb} of {mb} MB (100 %)")),
        "{err}"
    );
    assert!(
        !err.contains('\r'),
        "no bar drawing off a terminal: {err:?}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        ["cifar-10-batches-bin"],
        "no temporary files left behind"
    );

    // Training finds the extracted layout under the data directory.
    run_ok(
        trainctl()
            .args([
                "train",
                "--data",
                data.to_str().unwrap(),
                "--epochs",
                "1",
                "--batch-size",
                "25",
                "--threads",
                "1",
                "--no-download",
                "--out",
            ])
            .arg(dir.path()),
    );
}

#[test]
fn an_archive_with_the_wrong_md5_is_refused() {
    let (bytes, _) = archive();
    let url = serve(bytes, "cifar-10-binary.tar.gz");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let err = run_failing(
        trainctl()
            .args([
                "train",
                "--data",
                data.to_str().unwrap(),
                "--download-url",
                &url,
                "--out",
            ])
            .arg(dir.path()),
    );
    assert!(
        err.contains("MD5") && err.contains(contract::CIFAR10.md5),
        "{err}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&data).unwrap().collect();
    assert!(
        leftovers.is_empty(),
        "nothing half-downloaded is kept: {leftovers:?}"
    );
}

#[test]
fn missing_data_without_download_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let err = run_failing(
        trainctl()
            .args(["train", "--no-download", "--data"])
            .arg(dir.path().join("nothing")),
    );
    assert!(
        err.contains("no data set here")
            && err.contains("image folder")
            && err.contains("--no-download"),
        "{err}"
    );
}
