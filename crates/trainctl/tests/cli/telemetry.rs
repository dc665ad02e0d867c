//! What a run records about itself: metrics files, TensorBoard events (read back by
//! TensorBoard's own reader), the report, the confusion matrix, Prometheus's `/metrics`
//! (parsed by prometheus_client), and the progress lines.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use telemetry::metrics::{Record, rank_file, read_metrics};

use crate::support::*;

/// The tests' usual `train` arguments, checkpointing every 2 steps.
fn args(job: &Job, out: &str, epochs: usize) -> Vec<String> {
    let mut args = train_args(job, out, epochs);
    args.extend(["--checkpoint-every".into(), "2".into()]);
    args
}

/// Pixels of exactly `rgb` in a PNG.
fn pixels_of(png: &Path, rgb: [u8; 3]) -> usize {
    let img = image::open(png).unwrap().to_rgb8();
    img.pixels().filter(|p| p.0 == rgb).count()
}

/// A two-worker run that loses a worker after its step-2 checkpoint and resumes: every
/// consumer of its records sees one consistent history of steps 1..=8.
#[test]
fn a_run_with_a_restart_is_recorded_for_tensorboard_and_the_report() {
    let job = Job::new(256, 40);
    let out = two_local_workers_one_killed(&args(&job, "runs", 2), |l| {
        l.contains("checkpoint saved at step 2")
    });
    // Off a terminal, progress is the seed's loss line with steps, throughput and ETA.
    assert!(
        out.lines().any(|l| l.contains("] loss: ")
            && l.contains("/4 steps, ")
            && l.contains(" images/s, epoch eta ")),
        "{out}"
    );
    let run_dir = job.path("runs/local");

    // Metrics: both ranks, two attempts, 4 steps an epoch of 64 images.
    let rank0 = read_metrics(&rank_file(&run_dir, 0)).unwrap();
    assert_eq!(rank0.skipped, 0, "rank 0 was not killed");
    let rank1 = read_metrics(&rank_file(&run_dir, 1)).unwrap();
    assert!(rank1.skipped <= 1, "a kill leaves at most one partial line");
    let starts: Vec<_> = rank0
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Start(s) => Some((s.restart, s.resumed, s.step)),
            _ => None,
        })
        .collect();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!(starts[0], (0, false, 0));
    let (restart, resumed, resumed_at) = starts[1];
    assert!(restart == 1 && resumed && resumed_at >= 2, "{starts:?}");
    let mut last_attempt = Vec::new();
    for r in &rank0.records {
        match r {
            Record::Start(_) => last_attempt.clear(),
            Record::Step(s) => {
                assert_eq!((s.world_size, s.images, s.rank), (2, 64, 0));
                assert!(s.loss.is_finite() && (0.0..=1.0).contains(&s.accuracy));
                assert!(s.images_per_sec > 0.0);
                let parts = s.data_s + s.compute_s + s.allreduce_s;
                assert!(parts > 0.0 && parts <= s.step_s + 1e-6, "{s:?}");
                last_attempt.push(s.step);
            }
            _ => {}
        }
    }
    assert_eq!(
        last_attempt,
        ((resumed_at + 1)..=8).collect::<Vec<_>>(),
        "the resumed attempt goes on from the checkpoint"
    );
    let eval = rank0
        .records
        .iter()
        .find_map(|r| match r {
            Record::Eval(e) => Some(e.clone()),
            _ => None,
        })
        .expect("rank 0 records the evaluation");
    assert_eq!(eval.images, 40);
    assert_eq!(eval.confusion.iter().flatten().sum::<u64>(), 40);
    assert!(
        rank1
            .records
            .iter()
            .any(|r| matches!(r, Record::Step(s) if s.rank == 1))
    );

    // TensorBoard's own reader: one value per step 1..=8 (the steps redone after the restart
    // replace the orphaned ones), the test accuracy, and the configuration as text.
    let tb = testkit::read_telemetry(
        &["tensorboard", run_dir.join("tensorboard").to_str().unwrap()],
        None,
    );
    let loss = tb["scalars"]["train/loss"].as_array().unwrap();
    let steps: Vec<u64> = loss.iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>(), "{loss:?}");
    let last_loss = rank0.records.iter().rev().find_map(|r| match r {
        Record::Step(s) => Some(s.loss),
        _ => None,
    });
    assert_eq!(loss[7][1].as_f64().map(|v| v as f32), last_loss);
    for tag in [
        "train/images_per_sec",
        "train/allreduce_seconds",
        "train/accuracy",
    ] {
        assert_eq!(
            tb["scalars"][tag].as_array().map(Vec::len),
            Some(8),
            "{tag}"
        );
    }
    let accuracy = &tb["scalars"]["test/accuracy"][0];
    assert_eq!(accuracy[0], 8);
    assert!((accuracy[1].as_f64().unwrap() - eval.accuracy).abs() < 1e-3);
    let config = tb["text"]["config"].as_str().unwrap();
    assert!(
        config.contains("| batch size per worker | 32 |"),
        "{config}"
    );
    assert!(config.contains("| world size | 2 |"), "{config}");

    // The report: every chart, with the restart marked, inlined in one page.
    let report = run_ok(trainctl().arg("report").arg(&run_dir));
    let dir = run_dir.join("report");
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    let series = |file: &str| -> Vec<(String, u64)> {
        index["charts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["file"] == file)
            .unwrap_or_else(|| panic!("no {file} in {index}"))["series"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["name"].as_str().unwrap().into(),
                    s["points"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let steps_recorded = rank0
        .records
        .iter()
        .filter(|r| matches!(r, Record::Step(_)))
        .count() as u64;
    assert_eq!(
        series("loss.png"),
        [("loss".into(), steps_recorded), ("restart".into(), 1)]
    );
    assert_eq!(
        series("throughput.png"),
        [("images/s".into(), steps_recorded), ("restart".into(), 1)]
    );
    assert_eq!(
        series("step_time.png").len(),
        4,
        "three phases and the restart"
    );
    assert_eq!(series("class_accuracy.png"), [("accuracy".into(), 10)]);
    assert_eq!(series("confusion.png"), [("test images".into(), 100)]);
    for chart in index["charts"].as_array().unwrap() {
        let file = dir.join(chart["file"].as_str().unwrap());
        assert!(text(&report.stdout).contains(file.to_str().unwrap()));
        for s in chart["series"].as_array().unwrap() {
            // The heat map has no one colour; a bar chart of all zeros draws no bar.
            let Some(hex) = s["colour"].as_str() else {
                continue;
            };
            if chart["file"] == "class_accuracy.png" && eval.accuracy == 0.0 {
                continue;
            }
            let rgb = [1, 3, 5].map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap());
            assert!(
                pixels_of(&file, rgb) > 50,
                "{} draws {} in {hex}",
                file.display(),
                s["name"]
            );
        }
    }
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    // Every rank's time before the all-reduce, one line each, with its steps.
    let ranks = series("rank_step_time.png");
    assert_eq!(
        ranks
            .iter()
            .map(|(name, _)| name.as_str())
            .collect::<Vec<_>>(),
        ["rank 0", "rank 1"],
        "{ranks:?}"
    );
    assert!(ranks.iter().all(|(_, points)| *points >= 4), "{ranks:?}");
    assert_eq!(html.matches("src=\"data:image/png;base64,").count(), 6);
    assert!(html.contains("<th>restarts</th><td>1</td>"), "{html}");
    assert!(
        html.contains("<th>regroups in place</th><td>0</td>"),
        "{html}"
    );
    // Every file written is listed, the JSON index too.
    for file in ["report.html", "report.json"] {
        assert!(
            text(&report.stdout).contains(dir.join(file).to_str().unwrap()),
            "{}",
            text(&report.stdout)
        );
    }
    assert!(html.contains(&format!("{:.2} % of 40 images", eval.accuracy)));
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "self-contained"
    );

    // `trainctl eval --confusion-matrix`, as CSV and as a heat map.
    let csv = job.path("confusion.csv");
    let evaluated = run_ok(
        trainctl()
            .args(["eval", "--model"])
            .arg(run_dir.join("model.safetensors"))
            .arg("--data")
            .arg(job.data())
            .arg("--confusion-matrix")
            .arg(&csv),
    );
    let csv = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 11, "{csv}");
    assert_eq!(
        rows[0][1..],
        [
            "plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"
        ]
    );
    let counts: Vec<Vec<u64>> = rows[1..]
        .iter()
        .map(|r| r[1..].iter().map(|c| c.parse().unwrap()).collect())
        .collect();
    assert_eq!(counts, eval.confusion, "the same model, the same matrix");
    let correct: u64 = (0..10).map(|i| counts[i][i]).sum();
    assert!(text(&evaluated.stdout).contains(&format!(
        "Accuracy of the network on the 40 test images: {:.1} %",
        100.0 * correct as f64 / 40.0
    )));
    let png = job.path("confusion.png");
    run_ok(
        trainctl()
            .args(["eval", "--model"])
            .arg(run_dir.join("model.safetensors"))
            .arg("--data")
            .arg(job.data())
            .arg("--confusion-matrix")
            .arg(&png),
    );
    let img = image::open(&png).unwrap();
    assert_eq!((img.width(), img.height()), (720, 640));
}

/// GET `path` from `port` on loopback: (status line, body).
fn http_get(port: u16, path: &str) -> (String, String) {
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(conn, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

/// The value of sample `name` with `labels`, in any family.
fn sample(families: &Value, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    families
        .as_array()?
        .iter()
        .flat_map(|f| f["samples"].as_array().into_iter().flatten())
        .find(|s| s[0] == name && labels.iter().all(|(k, v)| s[1][*k] == *v))?[2]
        .as_f64()
}

#[test]
fn run_serves_prometheus_metrics_while_training() {
    let job = Job::new(256, 20);
    let mut run = Running::start(
        trainctl()
            .args([
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--metrics-port",
                "0",
            ])
            .args(args(&job, "runs", 50))
            .arg("--no-eval"),
    );
    let line = run.wait_for_line(Duration::from_secs(30), |l| {
        l.contains("serving metrics at http://")
    });
    let port: u16 = line
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches("/metrics").parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));

    // Scrape until both workers have stepped past a checkpoint.
    let deadline = Instant::now() + Duration::from_secs(120);
    let families = loop {
        let (status, body) = http_get(port, "/metrics");
        assert_eq!(status, "HTTP/1.1 200 OK");
        let families = testkit::read_telemetry(&["prometheus"], Some(&body));
        let step = |rank| sample(&families, "trainctl_global_step", &[("rank", rank)]);
        if step("0").is_some_and(|s| s >= 3.0)
            && step("1").is_some_and(|s| s >= 3.0)
            && sample(&families, "trainctl_last_checkpoint_age_seconds", &[]).is_some()
        {
            break families;
        }
        assert!(
            Instant::now() < deadline,
            "no steps and checkpoint in /metrics after 120 s:\n{body}\noutput:\n{}",
            run.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let kind = |name: &str| {
        families
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["name"] == name)
            .map(|f| f["type"].as_str().unwrap().to_string())
    };
    assert_eq!(sample(&families, "trainctl_world_size", &[]), Some(2.0));
    assert_eq!(sample(&families, "trainctl_agent_restarts", &[]), Some(0.0));
    assert_eq!(
        sample(&families, "trainctl_agent_regroups_total", &[]),
        Some(0.0)
    );
    assert_eq!(
        sample(&families, "trainctl_agent_worker_starts_total", &[]),
        Some(2.0)
    );
    // prometheus_client names a counter's family without `_total`.
    assert_eq!(kind("trainctl_steps").as_deref(), Some("counter"));
    assert_eq!(kind("trainctl_images_per_second").as_deref(), Some("gauge"));
    for rank in ["0", "1"] {
        assert!(sample(&families, "trainctl_steps_total", &[("rank", rank)]).unwrap() >= 3.0);
        assert!(sample(&families, "trainctl_images_per_second", &[("rank", rank)]).unwrap() > 0.0);
        let phases: BTreeSet<&str> = families
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["name"] == "trainctl_step_seconds")
            .unwrap()["samples"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s[1]["rank"] == rank)
            .map(|s| s[1]["phase"].as_str().unwrap())
            .collect();
        assert_eq!(
            phases,
            BTreeSet::from(["allreduce", "compute", "data", "step"])
        );
    }
    let age = sample(&families, "trainctl_last_checkpoint_age_seconds", &[]).unwrap();
    assert!((0.0..120.0).contains(&age), "{age}");
    assert!(sample(&families, "trainctl_last_checkpoint_step", &[]).unwrap() >= 2.0);
    assert_eq!(http_get(port, "/nothing").0, "HTTP/1.1 404 Not Found");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(run.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = run.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(128 + 15), "{}", run.output());
    // The workers finished their step and checkpointed it before they went.
    assert!(
        run.output().contains("saved a checkpoint"),
        "{}",
        run.output()
    );
    // The endpoint goes with the launcher.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

/// On a terminal (a pty from util-linux's `script`), `trainctl run` draws rank 0's progress
/// bar, and the workers' lines are written above it, whole.
#[test]
fn a_terminal_gets_a_progress_bar_with_the_lines_above_it() {
    let job = Job::new(128, 10);
    let command: Vec<String> = [env!("CARGO_BIN_EXE_trainctl"), "run", "--standalone"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--nproc-per-node".into(), "2".into()])
        .chain(args(&job, "runs", 1))
        .chain(["--no-eval".into()])
        .collect();
    let out = run_ok(
        std::process::Command::new("script")
            .args(["-qec", &command.join(" "), "/dev/null"])
            .env("COLUMNS", "100"),
    );
    let tty = text(&out.stdout);
    // indicatif redraws the bar in place: carriage return, erase line.
    assert!(tty.contains("epoch 1 ["), "{tty}");
    // The bar's loss is a mean over the last steps, as the loss lines' is.
    assert!(tty.contains("2/2 | mean loss "), "{tty}");
    assert!(tty.contains("\x1b[2K"), "{tty:?}");
    // A worker's line is never cut by the bar: it starts on a fresh row and ends its own.
    for line in tty.split(['\r', '\n']).filter(|l| l.contains("[0]:")) {
        let line = line.trim_start_matches("\x1b[2K");
        assert!(line.starts_with("[0]:"), "{line:?} in {tty:?}");
        assert!(!line.contains("epoch 1 ["), "{line:?}");
    }
}

#[test]
fn a_report_of_a_folder_without_metrics_says_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let err = run_failing(trainctl().arg("report").arg(dir.path()));
    assert!(
        err.contains("no metrics records for rank 0") && err.contains("OUT/RUN_ID"),
        "{err}"
    );
    assert!(!dir.path().join("report").exists(), "nothing written");
}
