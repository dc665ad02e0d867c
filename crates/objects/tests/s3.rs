//! The S3 layer against a real S3-compatible server (moto, with IAM checks) over real HTTP,
//! through a proxy that throttles and cuts connections on demand.

use std::path::Path;

use objects::{Client, Error, S3Uri, Settings, StageProgress};
use testkit::s3::{FORBIDDEN_BUCKET, FaultProxy, MISSING_BUCKET, S3Server};

const PART: usize = 5 << 20;

fn settings() -> Settings {
    Settings {
        part_size: PART,
        concurrency: 4,
        initial_backoff: std::time::Duration::from_millis(20),
        ..Settings::default()
    }
}

fn client(server: &S3Server, endpoint: &str) -> Client {
    client_as(endpoint, &server.access_key, &server.secret_key)
}

fn client_as(endpoint: &str, key: &str, secret: &str) -> Client {
    Client::with_options(
        [
            ("aws_endpoint", endpoint),
            ("aws_access_key_id", key),
            ("aws_secret_access_key", secret),
            ("aws_region", "us-east-1"),
        ],
        settings(),
    )
    .unwrap()
}

fn uri(text: &str) -> S3Uri {
    text.parse().unwrap()
}

/// Bytes that differ from part to part (a repeated pattern would hide a part sent twice).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_file_larger_than_a_part_goes_up_in_parts_and_comes_back_verified() {
    let server = S3Server::start();
    let s3 = client(&server, &server.endpoint);
    let dir = tempfile::tempdir().unwrap();
    let original = pattern(2 * PART + 12_345, 1);
    let file = dir.path().join("model.safetensors");
    std::fs::write(&file, &original).unwrap();

    let to = uri("s3://train-models/runs/a/model.safetensors");
    let sent = s3.upload(&file, &to).unwrap();
    assert_eq!(sent.bytes, original.len() as u64);
    let head = server.head("train-models", "runs/a/model.safetensors");
    assert_eq!(head["size"], original.len());
    // The SHA-256 of the whole file rides with the object for every later download to check.
    let sha256 = head["metadata"]["sha256"].as_str().unwrap().to_string();
    assert_eq!(sha256.len(), 64);

    let back = dir.path().join("back/model.safetensors");
    let got = s3.download(&to, &back).unwrap();
    assert!(got.verified);
    assert_eq!(std::fs::read(&back).unwrap(), original);
    assert_eq!(files_in(&dir.path().join("back")), ["model.safetensors"]);
}

#[test]
fn throttling_and_dropped_connections_are_retried() {
    let server = S3Server::start();
    let proxy = FaultProxy::start(server.addr);
    let s3 = client(&server, &proxy.endpoint);
    let dir = tempfile::tempdir().unwrap();
    let original = pattern(3 << 20, 2);
    let file = dir.path().join("data.bin");
    std::fs::write(&file, &original).unwrap();
    let at = uri("s3://train-data/data.bin");

    proxy.throttle_next(3);
    s3.upload(&file, &at).unwrap();
    assert_eq!(proxy.throttled(), 3);

    proxy.throttle_next(2);
    proxy.cut_next(1);
    let back = dir.path().join("back.bin");
    let got = s3.download(&at, &back).unwrap();
    assert_eq!(proxy.throttled(), 5);
    assert_eq!(proxy.cut(), 1, "the response was cut off once and resumed");
    assert!(got.verified);
    assert_eq!(std::fs::read(&back).unwrap(), original);
}

#[test]
fn staging_copies_a_prefix_once_and_skips_it_the_next_time() {
    let server = S3Server::start();
    let proxy = FaultProxy::start(server.addr);
    let s3 = client(&server, &proxy.endpoint);
    let source = tempfile::tempdir().unwrap();
    for class in ["cat", "dog"] {
        std::fs::create_dir_all(source.path().join("train").join(class)).unwrap();
        for i in 0..12 {
            let bytes = pattern(1000 + i * 37, i as u64 + class.len() as u64);
            std::fs::write(source.path().join(format!("train/{class}/{i}.jpg")), bytes).unwrap();
        }
    }
    // As the AWS CLI uploads: ETags are the files' MD5s, no trainctl metadata.
    server.put_dir(source.path(), "train-data", "sets/pets");
    // And one object trainctl uploaded in parts: its ETag is not an MD5.
    let big = source.path().join("big.bin");
    std::fs::write(&big, pattern(PART + 10, 9)).unwrap();
    s3.upload(&big, &uri("s3://train-data/sets/pets/big.bin"))
        .unwrap();
    // The S3 console's empty "folder" objects are not files.
    server.put_text("train-data", "sets/pets/train/", "", None);
    server.put_text("train-data", "sets/pets/train/cat/", "", None);
    // A neighbouring prefix that shares the name's start is not part of the folder.
    s3.upload(&big, &uri("s3://train-data/sets/pets2/other.bin"))
        .unwrap();

    let dest = tempfile::tempdir().unwrap();
    let mut seen = Vec::new();
    let first = s3
        .stage(
            &uri("s3://train-data/sets/pets"),
            dest.path(),
            &mut |p: &StageProgress| seen.push(p.clone()),
        )
        .unwrap();
    assert_eq!((first.files, first.copied, first.skipped), (25, 25, 0));
    assert_eq!(
        first.verified, 1,
        "only trainctl's upload carries a SHA-256"
    );
    assert_eq!(seen.last().unwrap().files_done, 25);
    assert_eq!(seen.last().unwrap().bytes_copied, first.bytes_copied);
    for class in ["cat", "dog"] {
        for i in 0..12 {
            let rel = format!("train/{class}/{i}.jpg");
            assert_eq!(
                std::fs::read(dest.path().join(&rel)).unwrap(),
                std::fs::read(source.path().join(&rel)).unwrap(),
                "{rel}"
            );
        }
    }
    assert!(!dest.path().join("other.bin").exists());

    let requests = proxy.requests();
    let second = s3
        .stage(&uri("s3://train-data/sets/pets/"), dest.path(), &mut |_| {})
        .unwrap();
    assert_eq!((second.files, second.copied, second.skipped), (25, 0, 25));
    assert_eq!(second.bytes_copied, 0);
    assert_eq!(
        proxy.requests() - requests,
        1,
        "one listing, no object read twice"
    );

    // A file changed locally is copied again, and only that one.
    std::fs::write(
        dest.path().join("train/cat/3.jpg"),
        pattern(1000 + 3 * 37, 77),
    )
    .unwrap();
    let third = s3
        .stage(&uri("s3://train-data/sets/pets"), dest.path(), &mut |_| {})
        .unwrap();
    assert_eq!((third.copied, third.skipped), (1, 24));
    assert_eq!(
        std::fs::read(dest.path().join("train/cat/3.jpg")).unwrap(),
        std::fs::read(source.path().join("train/cat/3.jpg")).unwrap()
    );

    // One object named directly lands under its own name.
    let single = tempfile::tempdir().unwrap();
    let one = s3
        .stage(
            &uri("s3://train-data/sets/pets/big.bin"),
            single.path(),
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(one.copied, 1);
    assert_eq!(
        std::fs::read(single.path().join("big.bin")).unwrap(),
        std::fs::read(&big).unwrap()
    );
}

#[test]
fn a_download_that_does_not_match_its_recorded_checksum_is_refused_and_not_kept() {
    let server = S3Server::start();
    let s3 = client(&server, &server.endpoint);
    let wrong = "0".repeat(64);
    server.put_text(
        "train-data",
        "corrupt.bin",
        "these bytes are not what was recorded",
        Some(&wrong),
    );
    let dir = tempfile::tempdir().unwrap();
    let err = s3
        .download(
            &uri("s3://train-data/corrupt.bin"),
            &dir.path().join("corrupt.bin"),
        )
        .unwrap_err();
    assert!(
        matches!(&err, Error::Checksum { expected, .. } if *expected == wrong),
        "{err}"
    );
    assert!(err.to_string().contains("nothing was kept"), "{err}");
    assert!(
        files_in(dir.path()).is_empty(),
        "{:?}",
        files_in(dir.path())
    );

    // Staging stops at it too, leaving no part file; the good files stay for the next run.
    server.put_text("train-data", "set/a.txt", "fine", None);
    server.put_text("train-data", "set/b.txt", "corrupt", Some(&wrong));
    let err = s3
        .stage(&uri("s3://train-data/set"), dir.path(), &mut |_| {})
        .unwrap_err();
    assert!(matches!(err, Error::Checksum { .. }), "{err}");
    assert!(
        !files_in(dir.path()).iter().any(|f| f.contains("b.txt")),
        "{:?}",
        files_in(dir.path())
    );
}

#[test]
fn bad_credentials_missing_things_and_denied_buckets_are_named() {
    let server = S3Server::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f.bin");
    std::fs::write(&file, b"weights").unwrap();
    let s3 = client(&server, &server.endpoint);
    s3.upload(&file, &uri("s3://train-data/f.bin")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("f.bin");

    let err = client_as(&server.endpoint, &server.access_key, "not-the-secret")
        .download(&uri("s3://train-data/f.bin"), &target)
        .unwrap_err();
    assert!(
        matches!(&err, Error::BadCredentials { code, .. } if code == "SignatureDoesNotMatch"),
        "{err}"
    );
    assert!(err.to_string().contains("s3://train-data/f.bin"), "{err}");

    let err = client_as(&server.endpoint, "AKIANOBODY0000000000", "x")
        .upload(&file, &uri("s3://train-data/g.bin"))
        .unwrap_err();
    assert!(
        matches!(&err, Error::BadCredentials { code, .. } if code == "InvalidAccessKeyId"),
        "{err}"
    );

    let err = s3
        .download(&uri("s3://train-data/no/such.bin"), &target)
        .unwrap_err();
    assert!(matches!(err, Error::NoSuchKey { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("s3://train-data/no/such.bin does not exist"),
        "{message}"
    );
    assert!(
        message.contains("aws s3 ls s3://train-data/no/"),
        "{message}"
    );

    let err = s3
        .download(&uri(&format!("s3://{MISSING_BUCKET}/f.bin")), &target)
        .unwrap_err();
    assert!(matches!(err, Error::NoSuchBucket { .. }), "{err}");

    let err = s3
        .upload(&file, &uri(&format!("s3://{FORBIDDEN_BUCKET}/f.bin")))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::AccessDenied {
                action: "write",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--s3-bucket other-team"), "{err}");

    let err = s3
        .stage(
            &uri("s3://train-data/nothing-here"),
            out.path(),
            &mut |_| {},
        )
        .unwrap_err();
    assert!(matches!(err, Error::EmptyPrefix { .. }), "{err}");

    assert!(
        files_in(out.path()).is_empty(),
        "nothing half-written: {:?}",
        files_in(out.path())
    );
}
