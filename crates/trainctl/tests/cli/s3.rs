//! S3 from the command line, against a real S3-compatible server (moto, with IAM checks):
//! staging a prefix (and resuming a killed staging), uploads at the end of training, models
//! read from S3, a program's code fetched before its workers start, and the errors.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use testkit::s3::{FORBIDDEN_BUCKET, FaultProxy, S3Server};

use crate::support::*;

fn with_env(mut cmd: Command, env: Vec<(String, String)>) -> Command {
    cmd.envs(env);
    cmd
}

/// Visible files under `dir`, as paths relative to it.
fn files_under(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if !entry.file_name().to_string_lossy().starts_with('.') {
                found.push(path.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    found.sort();
    found
}

#[test]
fn a_killed_staging_resumes_without_copying_anything_twice() {
    let server = S3Server::start();
    let proxy = FaultProxy::start(server.addr);
    let source = tempfile::tempdir().unwrap();
    for i in 0..40 {
        let dir = source.path().join(format!("train/class{}", i % 4));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(format!("{i}.jpg")),
            format!("image {i} ").repeat(50 + i),
        )
        .unwrap();
    }
    server.put_dir(source.path(), "train-data", "pets");
    let dest = tempfile::tempdir().unwrap();
    let dest_dir = dest.path().join("data");

    // One listing and ten objects get through; then every request hangs, as on a dead link.
    proxy.hold_after(11);
    let mut stage = with_env(trainctl(), server.env_at(&proxy.endpoint));
    stage.args([
        "data",
        "stage",
        "s3://train-data/pets",
        dest_dir.to_str().unwrap(),
    ]);
    let mut running = Running::start(&mut stage);
    eventually(Duration::from_secs(60), "ten files staged", || {
        files_under(&dest_dir).len() == 10
    });
    running.child.kill().unwrap();
    running.wait(Duration::from_secs(10));
    proxy.release();

    let out = run_ok(with_env(trainctl(), server.env_at(&proxy.endpoint)).args([
        "data",
        "stage",
        "s3://train-data/pets",
        dest_dir.to_str().unwrap(),
    ]));
    let summary = text(&out.stdout);
    assert!(
        summary.contains("staged s3://train-data/pets into")
            && summary.contains("40 files (30 copied, 10 already there)"),
        "{summary}"
    );
    assert_eq!(files_under(&dest_dir), files_under(source.path()));
    for file in files_under(source.path()) {
        assert_eq!(
            std::fs::read(dest_dir.join(&file)).unwrap(),
            std::fs::read(source.path().join(&file)).unwrap(),
            "{file}"
        );
    }
    let leftovers: Vec<String> = files_under(&dest_dir.join("train/class0"))
        .into_iter()
        .filter(|f| f.contains("trainctl-part"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn training_uploads_its_results_and_eval_and_predict_read_the_model_from_s3() {
    let server = S3Server::start();
    let job = Job::new(96, 40);
    let mut args = train_args(&job, "out", 1);
    args.extend(["--upload".into(), "s3://train-models/runs/first".into()]);
    let out = run_ok(
        with_env(trainctl(), server.env())
            .args([
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--rdzv-id",
                "first",
            ])
            .args(&args),
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("to s3://train-models/runs/first/model.safetensors"),
        "{err}"
    );
    let local = job.path("out/first");
    for (key, file) in [
        ("model.safetensors", "model.safetensors"),
        ("checkpoint.ckpt", "checkpoint.ckpt"),
        ("metrics/rank-0.jsonl", "metrics/rank-0.jsonl"),
        ("report/report.html", "report/report.html"),
    ] {
        let head = server.head("train-models", &format!("runs/first/{key}"));
        let size = std::fs::metadata(local.join(file)).unwrap().len();
        assert_eq!(head["size"], size, "{key}");
        assert_eq!(
            head["metadata"]["sha256"].as_str().unwrap().len(),
            64,
            "{key}"
        );
    }

    // The model read back from S3 evaluates exactly like the local file.
    let eval = |model: &str| {
        let out = run_ok(with_env(trainctl(), server.env()).args([
            "eval",
            "--model",
            model,
            "--data",
            job.data().to_str().unwrap(),
        ]));
        text(&out.stdout)
    };
    let from_s3 = eval("s3://train-models/runs/first/model.safetensors");
    assert_eq!(
        from_s3,
        eval(local.join("model.safetensors").to_str().unwrap())
    );
    assert!(from_s3.contains("accuracy"), "{from_s3}");

    let image = job.path("plane.png");
    image::RgbImage::from_pixel(32, 32, image::Rgb([200, 30, 30]))
        .save(&image)
        .unwrap();
    let predicted = run_ok(with_env(trainctl(), server.env()).args([
        "predict",
        "--model",
        "s3://train-models/runs/first/model.safetensors",
        image.to_str().unwrap(),
    ]));
    assert!(text(&predicted.stdout).starts_with(&format!("{}: ", image.display())));
}

#[test]
fn a_failed_upload_warns_and_keeps_the_run_and_its_files() {
    let server = S3Server::start();
    let job = Job::new(64, 32);
    let mut args = train_args(&job, "out", 1);
    args.extend(["--upload".into(), format!("s3://{FORBIDDEN_BUCKET}/runs/x")]);
    let out = run_ok(with_env(trainctl(), server.env()).args(&args));
    let err = text(&out.stderr);
    // The first file (the model) is refused; a refusal would refuse the rest too, so they
    // are named once rather than tried.
    let run = job.path("out/local");
    assert!(
        err.contains(&format!(
            "could not upload {}",
            run.join("model.safetensors").display()
        )) && err.contains("access denied"),
        "{err}"
    );
    assert!(err.contains("The local copy stays"), "{err}");
    assert_eq!(err.matches("could not upload").count(), 1, "{err}");
    assert!(
        err.contains("were not sent to s3://other-team/runs/x after that refusal"),
        "{err}"
    );
    assert!(
        err.contains(&run.join("model.safetensors").display().to_string()),
        "{err}"
    );
    assert!(exists(&run.join("model.safetensors")));
    assert!(exists(&run.join("checkpoint.ckpt")));

    // A URI that cannot be one, or no credentials at all, stop the run before it trains.
    let err = run_failing(
        trainctl()
            .args(train_args(&job, "bad", 1))
            .args(["--upload", "s3:/x"]),
    );
    assert!(err.contains("--upload \"s3:/x\""), "{err}");
    let err = run_failing(
        trainctl()
            .args(train_args(&job, "bad", 1))
            .args(["--upload", "s3://train-models/x"])
            .env_remove("AWS_ACCESS_KEY_ID")
            .env("AWS_SHARED_CREDENTIALS_FILE", job.path("no-such-file"))
            .env("AWS_CONFIG_FILE", job.path("no-such-file"))
            .env("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9"),
    );
    assert!(
        err.contains("no AWS credentials to reach s3://train-models/x"),
        "{err}"
    );
    assert!(!job.path("bad").exists(), "nothing trained");
}

#[test]
fn run_fetches_the_program_from_s3_before_starting_its_workers() {
    let server = S3Server::start();
    let code = tempfile::tempdir().unwrap();
    std::fs::write(
        code.path().join("main.sh"),
        "echo \"hello from rank $RANK of $WORLD_SIZE\"\n",
    )
    .unwrap();
    server.put_dir(code.path(), "train-data", "code");
    let work = tempfile::tempdir().unwrap();

    let out = run_ok(
        with_env(trainctl(), server.env())
            .current_dir(work.path())
            .args(["run", "--standalone", "--nproc-per-node", "2"])
            .args([
                "--fetch",
                "s3://train-data/code/main.sh",
                "--",
                "sh",
                "main.sh",
            ]),
    );
    let stdout = text(&out.stdout);
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("hello from rank {rank} of 2")),
            "{stdout}"
        );
    }
    assert!(work.path().join("main.sh").is_file());

    let err = run_failing(
        with_env(trainctl(), server.env())
            .current_dir(work.path())
            .args([
                "run",
                "--standalone",
                "--fetch",
                "s3://train-data/code/nope.py",
            ])
            .args(["--", "python3", "nope.py"]),
    );
    assert!(
        err.contains("--fetch s3://train-data/code/nope.py")
            && err.contains("nothing at s3://train-data/code/nope.py")
            && err.contains("aws s3 ls s3://train-data/code/"),
        "{err}"
    );

    let mut wrong = server.env();
    wrong.retain(|(k, _)| k != "AWS_SECRET_ACCESS_KEY");
    wrong.push(("AWS_SECRET_ACCESS_KEY".into(), "wrong".into()));
    let dest = work.path().join("staged");
    let err = run_failing(with_env(trainctl(), wrong).args([
        "data",
        "stage",
        "s3://train-data/code",
        dest.to_str().unwrap(),
    ]));
    assert!(
        err.contains("S3 refused the credentials while reaching s3://train-data/code")
            && err.contains("SignatureDoesNotMatch"),
        "{err}"
    );
    assert!(!dest.exists(), "nothing written");

    // An AWS CLI profile's keys and region serve when the environment has none.
    let aws = work.path().join("aws");
    std::fs::create_dir_all(&aws).unwrap();
    std::fs::write(
        aws.join("credentials"),
        format!(
            "[default]\naws_access_key_id = AKIAOTHER\naws_secret_access_key = x\n\n[train]\n\
             aws_access_key_id = {}\naws_secret_access_key = {}\n",
            server.access_key, server.secret_key
        ),
    )
    .unwrap();
    std::fs::write(aws.join("config"), "[profile train]\nregion = us-east-1\n").unwrap();
    let out = run_ok(
        trainctl()
            .args([
                "data",
                "stage",
                "s3://train-data/code",
                dest.to_str().unwrap(),
            ])
            .env("AWS_ENDPOINT_URL", &server.endpoint)
            .env("AWS_PROFILE", "train")
            .env("AWS_SHARED_CREDENTIALS_FILE", aws.join("credentials"))
            .env("AWS_CONFIG_FILE", aws.join("config")),
    );
    assert!(
        text(&out.stdout).contains("1 files (1 copied"),
        "{}",
        text(&out.stdout)
    );
}

/// The seed tutorials keep the CIFAR-10 archive in S3: staged into the data folder, it is
/// checked and extracted there with no download (`--no-download` and no network), and one that
/// fails the checks is refused by name and left for the user to replace.
#[test]
fn an_archive_staged_from_s3_is_extracted_without_a_download() {
    use md5::Digest;
    let server = S3Server::start();
    let bytes = cifar_archive(64, 32);
    let md5 = format!("{:x}", md5::Md5::digest(&bytes));
    let upload = tempfile::tempdir().unwrap();
    std::fs::write(upload.path().join("cifar-10-binary.tar.gz"), &bytes).unwrap();
    server.put_dir(upload.path(), "train-data", "datasets");
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");

    // `data stage` extracts the official archive it brought; this generated one has neither
    // the official size nor MD5: refused by name, and kept.
    let err = run_failing(with_env(trainctl(), server.env()).args([
        "data",
        "stage",
        "s3://train-data/datasets/cifar-10-binary.tar.gz",
        data.to_str().unwrap(),
    ]));
    assert!(
        err.contains("cifar-10-binary.tar.gz")
            && err.contains(&format!("expected {}", contract::CIFAR10.size))
            && err.contains("replace it with the official archive")
            && err.contains("--no-extract"),
        "{err}"
    );
    assert!(data.join("cifar-10-binary.tar.gz").is_file());
    assert!(!data.join("cifar-10-batches-bin").exists());

    // Training finds it, checks it against the MD5 it is given and extracts it, offline.
    let out = run_ok(
        trainctl()
            .args(train_args_at(&data, &work.path().join("out"), 1, "0.001"))
            .args(["--no-download", "--download-md5", &md5]),
    );
    assert!(
        text(&out.stdout).contains("Accuracy"),
        "{}",
        text(&out.stdout)
    );
    assert!(data.join("cifar-10-batches-bin/data_batch_1.bin").is_file());
}
