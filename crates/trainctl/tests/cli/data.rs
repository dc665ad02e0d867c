//! Getting the data: download from a local HTTP server, MD5 checks, missing data; slow,
//! stalled and cut-off downloads, and what a killed one leaves.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    // The folder did not exist: said, in case --data was mistyped.
    assert!(
        err.contains(&format!(
            "downloading CIFAR-10 from {url} into {} (a new folder: it did not exist; check --data",
            data.display()
        )),
        "{err}"
    );
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

/// What the test server does with its n-th request.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// What the range asks for (206), or the whole archive (200) without one.
    Range,
    /// Like `Range`, but the connection is closed after this many bytes.
    CutAfter(usize),
    /// Like `Range`, but the server goes silent after this many bytes, the connection open.
    HoldAfter(usize),
    /// Like `Range`, `chunk` bytes every `every`: a slow link that keeps going.
    Trickle { chunk: usize, every: Duration },
    /// Accepts the connection and never answers.
    Silent,
}

/// Per request: the first byte it asked for (`None`: the whole file) and how long its answer
/// took to send (`Duration::MAX`: the client hung up first).
type Log = Arc<Mutex<Vec<(Option<u64>, Duration)>>>;

/// A real HTTP server on 127.0.0.1 that answers as its plan says, recording the first byte
/// each request asked for and how long each answer took to send.
struct Server {
    url: String,
    log: Log,
}

impl Server {
    fn start(body: Vec<u8>, plan: impl Fn(usize) -> Answer + Send + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!(
            "http://{}/cifar-10-binary.tar.gz",
            listener.local_addr().unwrap()
        );
        let log = Arc::new(Mutex::new(Vec::new()));
        let (seen, body) = (Arc::clone(&log), Arc::new(body));
        std::thread::spawn(move || {
            for (n, stream) in listener.incoming().enumerate() {
                let Ok(stream) = stream else { continue };
                let (body, seen, answer) = (Arc::clone(&body), Arc::clone(&seen), plan(n));
                std::thread::spawn(move || answer_one(stream, &body, answer, &seen));
            }
        });
        Server { url, log }
    }

    /// The first byte each request asked for (`None`: the whole file).
    fn ranges(&self) -> Vec<Option<u64>> {
        self.log.lock().unwrap().iter().map(|(r, _)| *r).collect()
    }

    /// How long each answer took to send, once sent.
    fn sent_in(&self) -> Vec<Duration> {
        self.log.lock().unwrap().iter().map(|(_, d)| *d).collect()
    }
}

fn answer_one(mut stream: TcpStream, body: &[u8], answer: Answer, log: &Log) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut from = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let line = line.trim_end().to_ascii_lowercase();
        if line.is_empty() {
            break;
        }
        if let Some(range) = line.strip_prefix("range: bytes=") {
            from = range.trim_end_matches('-').parse::<u64>().ok();
        }
    }
    let started = Instant::now();
    if let Answer::Silent = answer {
        log.lock().unwrap().push((from, Duration::ZERO));
        // Until the client hangs up.
        let _ = stream.read(&mut [0u8; 1]);
        return;
    }
    let len = body.len();
    let start = from.map_or(0, |f| (f as usize).min(len));
    let header = match from {
        None => format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"),
        Some(_) => format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{len}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            len - 1,
            len - start
        ),
    };
    let rest = &body[start..];
    let sent = stream.write_all(header.as_bytes()).is_ok()
        && match answer {
            Answer::CutAfter(n) => stream.write_all(&rest[..n.min(rest.len())]).is_ok(),
            Answer::HoldAfter(n) => {
                let _ = stream.write_all(&rest[..n.min(rest.len())]);
                // Until the client hangs up.
                let _ = stream.read(&mut [0u8; 1]);
                false
            }
            Answer::Trickle { chunk, every } => rest.chunks(chunk).all(|piece| {
                let ok = stream
                    .write_all(piece)
                    .and_then(|()| stream.flush())
                    .is_ok();
                // The link's pace, not a wait for anything.
                std::thread::sleep(every);
                ok
            }),
            _ => stream.write_all(rest).is_ok(),
        };
    if sent {
        log.lock().unwrap().push((from, started.elapsed()));
    } else {
        log.lock().unwrap().push((from, Duration::MAX));
    }
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The main job's first command on a slow link: the download outlasts the collective timeout
/// (3 s) twice over, and the second worker waits for it, saying so, instead of timing out.
#[test]
fn a_download_slower_than_the_collective_timeout_keeps_the_other_worker_waiting() {
    let (bytes, md5) = archive();
    let chunk = bytes.len() / 30 + 1;
    let server = Server::start(bytes, move |_| Answer::Trickle {
        chunk,
        every: Duration::from_millis(200),
    });
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut run = Running::start(
        two_local_workers()
            .args(["--collective-timeout", "3"])
            .args(train_args_at(&data, &dir.path().join("out"), 1, "0.001"))
            .args(["--download-url", &server.url, "--download-md5", &md5]),
    );
    assert!(
        run.wait(Duration::from_secs(300)).success(),
        "{}",
        run.output()
    );
    let output = run.output();
    let sent_in = server.sent_in();
    assert_eq!(sent_in.len(), 1, "one download for the node: {sent_in:?}");
    assert!(
        sent_in[0] > Duration::from_secs(3),
        "the download took longer than the collective timeout: {sent_in:?}"
    );
    assert!(
        output.contains("waiting for rank 0 (local rank 0) to get the data set"),
        "{output}"
    );
    assert!(output.contains("downloading CIFAR-10:"), "{output}");
    assert_eq!(finished(&output).len(), 2, "{output}");
    assert_eq!(
        names_in(&data),
        ["cifar-10-batches-bin"],
        "nothing else left"
    );
}

/// A failed download (here a stalled server) is reported by rank 0 naming the URL, and by
/// rank 1 as rank 0's failure, not as a peer that did not answer.
#[test]
fn a_failed_download_is_named_by_every_worker() {
    let (bytes, md5) = archive();
    let server = Server::start(bytes, |_| Answer::Silent);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut run = Running::start(
        two_local_workers()
            .args(["--collective-timeout", "3"])
            .args(train_args_at(&data, &dir.path().join("out"), 1, "0.001"))
            .args(["--download-url", &server.url, "--download-md5", &md5])
            .args(["--download-stall-timeout", "0.5"]),
    );
    let status = run.wait(Duration::from_secs(120));
    let output = run.output();
    assert_eq!(status.code(), Some(1), "{output}");
    let stalled = format!(
        "download of {0} failed: no data from {0} for 0.5 s",
        server.url
    );
    assert!(
        output
            .lines()
            .any(|l| l.contains("[0]") && l.contains(&stalled)),
        "rank 0 names the download: {output}"
    );
    assert!(
        output.lines().any(|l| l.contains("[1]")
            && l.contains("rank 0, which gets it for this node, failed")
            && l.contains(&stalled)),
        "rank 1 reports rank 0's failure: {output}"
    );
    assert!(!output.contains("did not answer"), "{output}");
    assert_eq!(server.ranges().len(), 4, "4 tries: {output}");
}

/// `data fetch` against a server that accepts and never answers: an error that says so after
/// the stall timeout and its retries, each said, not a silent wait.
#[test]
fn a_server_that_never_answers_is_a_stall_that_says_so() {
    let server = Server::start(Vec::new(), |_| Answer::Silent);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut run = Running::start(trainctl().args([
        "data",
        "fetch",
        "--data",
        data.to_str().unwrap(),
        "--download-url",
        &server.url,
        "--download-stall-timeout",
        "1",
    ]));
    let status = run.wait(Duration::from_secs(120));
    let output = run.output();
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains(&format!(
            "download of {0} failed: no data from {0} for 1 s (4 tries in a row brought no new byte)",
            server.url
        )) && output.contains("--download-stall-timeout to wait longer"),
        "{output}"
    );
    let retries = output.matches("trying again in").count();
    assert_eq!(retries, 3, "each retry is said: {output}");
    assert_eq!(server.ranges().len(), 4);
    assert!(
        names_in(&data).is_empty(),
        "nothing kept: {:?}",
        names_in(&data)
    );
}

/// A connection cut mid-way: the retry asks for the rest (a range), and the archive that results
/// passes its MD5 check.
#[test]
fn a_download_cut_mid_way_resumes_by_range_and_checks_its_md5() {
    let (bytes, md5) = archive();
    let cut = bytes.len() / 3;
    let server = Server::start(bytes, move |n| {
        if n == 0 {
            Answer::CutAfter(cut)
        } else {
            Answer::Range
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = run_ok(trainctl().args([
        "data",
        "fetch",
        "--data",
        data.to_str().unwrap(),
        "--download-url",
        &server.url,
        "--download-md5",
        &md5,
    ]));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("trying again in 1s from byte {cut}")),
        "{err}"
    );
    assert_eq!(server.ranges(), [None, Some(cut as u64)], "{err}");
    assert_eq!(names_in(&data), ["cifar-10-batches-bin"]);
}

/// A download killed mid-way (SIGKILL: no chance to clean up) leaves its part file; the next
/// one resumes from it, and removes what an older trainctl's killed download left.
#[test]
fn a_killed_download_is_resumed_by_the_next() {
    let (bytes, md5) = archive();
    let third = bytes.len() / 3;
    let stuck = Server::start(bytes.clone(), move |_| Answer::HoldAfter(third));
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let fetch = |url: &str| {
        let mut cmd = trainctl();
        cmd.args(["data", "fetch", "--data", data.to_str().unwrap()])
            .args(["--download-url", url, "--download-md5", &md5]);
        cmd
    };
    let mut killed = Running::start(&mut fetch(&stuck.url));
    let part = data.join(".cifar-10-binary.tar.gz.part");
    eventually(
        Duration::from_secs(60),
        "a third of the archive on disk",
        || std::fs::metadata(&part).is_ok_and(|m| m.len() == third as u64),
    );
    killed.child.kill().unwrap();
    assert!(!killed.wait(Duration::from_secs(20)).success());
    let kept = std::fs::metadata(&part).unwrap().len();
    assert_eq!(kept, third as u64);
    // What trainctl before resumable downloads left: a private part, long abandoned.
    let old = data.join(".cifar-10-binary.tar.gz.part.4242.0badf00d");
    std::fs::write(&old, &bytes[..1000]).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&old)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();

    let fast = Server::start(bytes, |_| Answer::Range);
    run_ok(&mut fetch(&fast.url));
    assert_eq!(fast.ranges(), [Some(kept)], "only the rest was asked for");
    assert_eq!(names_in(&data), ["cifar-10-batches-bin"], "no part left");
}
