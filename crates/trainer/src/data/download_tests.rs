//! Downloads from a real HTTP server on 127.0.0.1 that cuts connections, stalls, ignores
//! ranges or answers errors, as a plan says for each request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use md5::{Digest, Md5};

use super::*;

/// What the server does with its n-th request.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// What the range asks for (206), or the whole body (200) without one.
    Range,
    /// The whole body (200), whatever the range.
    Whole,
    /// Like `Range`, but the connection is closed after this many bytes of the body.
    CutAfter(usize),
    /// Like `Range`, but the server goes silent after this many bytes of the body.
    StallAfter(usize),
    /// Accepts the connection and never answers.
    Silent,
    Status(u16),
}

struct Server {
    url: String,
    /// The first byte each request asked for (`None`: no range).
    ranges: Arc<Mutex<Vec<Option<u64>>>>,
}

impl Server {
    fn ranges(&self) -> Vec<Option<u64>> {
        self.ranges.lock().unwrap().clone()
    }
}

fn serve(body: &[u8], plan: impl Fn(usize) -> Answer + Send + 'static) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/archive.tar.gz", listener.local_addr().unwrap());
    let ranges = Arc::new(Mutex::new(Vec::new()));
    let (seen, body) = (Arc::clone(&ranges), Arc::new(body.to_vec()));
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let Ok(stream) = stream else { continue };
            let (body, seen, answer) = (Arc::clone(&body), Arc::clone(&seen), plan(n));
            std::thread::spawn(move || answer_one(stream, &body, answer, &seen));
        }
    });
    Server { url, ranges }
}

/// Holds a connection open until the client hangs up.
fn hold(mut stream: TcpStream) {
    let _ = stream.read(&mut [0u8; 1]);
}

fn answer_one(mut stream: TcpStream, body: &[u8], answer: Answer, seen: &Mutex<Vec<Option<u64>>>) {
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
    seen.lock().unwrap().push(from);
    let len = body.len();
    let start = match (answer, from) {
        (Answer::Silent, _) => return hold(stream),
        (Answer::Status(code), _) => {
            let _ = write!(
                stream,
                "HTTP/1.1 {code} Status\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            return;
        }
        (Answer::Whole, _) | (_, None) => None,
        (_, Some(from)) if from as usize >= len => {
            let _ = write!(
                stream,
                "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            return;
        }
        (_, Some(from)) => Some(from as usize),
    };
    let header = match start {
        None => format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"),
        Some(s) => format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {s}-{}/{len}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            len - 1,
            len - s
        ),
    };
    let rest = &body[start.unwrap_or(0)..];
    let _ = stream.write_all(header.as_bytes());
    match answer {
        Answer::CutAfter(n) => {
            let _ = stream.write_all(&rest[..n.min(rest.len())]);
        }
        Answer::StallAfter(n) => {
            let _ = stream.write_all(&rest[..n.min(rest.len())]);
            let _ = stream.flush();
            hold(stream);
        }
        _ => {
            let _ = stream.write_all(rest);
        }
    }
}

fn body(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn md5_hex(bytes: &[u8]) -> String {
    format!("{:x}", Md5::digest(bytes))
}

fn options(server: &Server, body: &[u8], stall: Duration) -> DownloadOptions {
    DownloadOptions {
        enabled: true,
        url: server.url.clone(),
        md5: md5_hex(body),
        size: Some(body.len() as u64),
        stall_timeout: stall,
        turn_on: None,
    }
}

/// Downloads into `dir` with the server's plan; returns the result, the part's md5 and the
/// progress reported.
fn fetch(
    dir: &Path,
    opts: &DownloadOptions,
) -> (Result<u64>, Option<String>, Vec<DataProgress>, bool) {
    let part = Part::take(dir, "archive.tar.gz").unwrap();
    let mut told = Vec::new();
    let result = download(opts, &part, &mut |p| told.push(p));
    let md5 = result.is_ok().then(|| part.md5().unwrap().0);
    let resumable = part.resumable;
    part.discard();
    (result, md5, told, resumable)
}

/// Runs `f` on a thread of its own, failing the test if it has not returned within `limit`
/// (a download that never gives up).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    result
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("still downloading after {limit:?}"))
}

fn retries(told: &[DataProgress]) -> Vec<(String, u64)> {
    told.iter()
        .filter_map(|p| match p {
            DataProgress::Retrying { problem, from, .. } => Some((problem.clone(), *from)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_connection_cut_mid_way_resumes_from_where_it_stopped() {
    let body = body(3 << 20);
    let cut = 1 << 20;
    let server = serve(&body, move |n| {
        if n == 0 {
            Answer::CutAfter(cut)
        } else {
            Answer::Range
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server, &body, Duration::from_secs(30));
    let (result, md5, told, _) = fetch(dir.path(), &opts);
    assert_eq!(result.unwrap(), body.len() as u64);
    assert_eq!(md5.unwrap(), md5_hex(&body));
    assert_eq!(
        server.ranges(),
        [None, Some(cut as u64)],
        "resumed by range"
    );
    let retried = retries(&told);
    assert_eq!(retried.len(), 1, "{told:?}");
    assert_eq!(retried[0].1, cut as u64);
    assert!(
        told.contains(&DataProgress::Downloading {
            done: body.len() as u64,
            total: Some(body.len() as u64)
        }),
        "{told:?}"
    );
}

#[test]
fn a_server_without_ranges_sends_the_whole_file_again() {
    let body = body(2 << 20);
    let server = serve(&body, |n| {
        if n == 0 {
            Answer::CutAfter(700_000)
        } else {
            Answer::Whole
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server, &body, Duration::from_secs(30));
    let (result, md5, _, _) = fetch(dir.path(), &opts);
    assert_eq!(result.unwrap(), body.len() as u64);
    assert_eq!(md5.unwrap(), md5_hex(&body), "started again from zero");
}

#[test]
fn a_stall_mid_way_is_retried_and_resumes() {
    let body = body(2 << 20);
    let server = serve(&body, |n| {
        if n == 0 {
            Answer::StallAfter(500_000)
        } else {
            Answer::Range
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server, &body, Duration::from_millis(500));
    let path = dir.path().to_path_buf();
    let (result, md5, told, _) = within(Duration::from_secs(60), move || fetch(&path, &opts));
    assert_eq!(result.unwrap(), body.len() as u64);
    assert_eq!(md5.unwrap(), md5_hex(&body));
    let retried = retries(&told);
    assert_eq!(
        retried,
        [(format!("no data from {} for 0.5 s", server.url), 500_000)]
    );
    assert_eq!(server.ranges(), [None, Some(500_000)]);
}

#[test]
fn a_server_that_never_answers_is_a_stall_that_says_so() {
    let body = body(1000);
    let server = serve(&body, |_| Answer::Silent);
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server, &body, Duration::from_millis(300));
    // Four stalls and the backoffs between them (1 + 2 + 4 s), not forever.
    let path = dir.path().to_path_buf();
    let (result, _, told, _) = within(Duration::from_secs(60), move || fetch(&path, &opts));
    let message = result.unwrap_err().to_string();
    assert!(
        message.contains(&format!("no data from {} for 0.3 s", server.url))
            && message.contains(&format!("{TRIES} tries in a row"))
            && message.contains("--download-stall-timeout"),
        "{message}"
    );
    assert_eq!(server.ranges().len(), TRIES as usize, "one request a try");
    assert_eq!(retries(&told).len(), TRIES as usize - 1, "each retry said");
}

#[test]
fn a_part_left_by_a_killed_download_is_resumed_and_abandoned_ones_removed() {
    let body = body(2 << 20);
    let server = serve(&body, |_| Answer::Range);
    let dir = tempfile::tempdir().unwrap();
    let kept = 1_234_567;
    std::fs::write(dir.path().join(".archive.tar.gz.part"), &body[..kept]).unwrap();
    // A private part of an older trainctl, killed long ago.
    let old = dir.path().join(".archive.tar.gz.part.4242.0badf00d");
    std::fs::write(&old, &body[..1000]).unwrap();
    let an_hour_ago = SystemTime::now() - Duration::from_secs(3600);
    File::options()
        .write(true)
        .open(&old)
        .unwrap()
        .set_modified(an_hour_ago)
        .unwrap();
    let opts = options(&server, &body, Duration::from_secs(30));
    let (result, md5, _, resumable) = fetch(dir.path(), &opts);
    assert!(resumable);
    assert_eq!(result.unwrap(), body.len() as u64);
    assert_eq!(md5.unwrap(), md5_hex(&body));
    assert_eq!(
        server.ranges(),
        [Some(kept as u64)],
        "only the rest asked for"
    );
    assert!(!old.exists(), "the abandoned private part is removed");
}

#[test]
fn a_part_holding_every_byte_is_taken_as_it_is() {
    let body = body(100_000);
    let server = serve(&body, |_| Answer::Range);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(".archive.tar.gz.part"), &body).unwrap();
    let opts = options(&server, &body, Duration::from_secs(30));
    let (result, md5, _, _) = fetch(dir.path(), &opts);
    assert_eq!(result.unwrap(), body.len() as u64);
    assert_eq!(md5.unwrap(), md5_hex(&body));
    assert_eq!(server.ranges(), [Some(body.len() as u64)]);
}

#[test]
fn a_part_in_use_by_another_download_is_left_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join(".archive.tar.gz.part");
    std::fs::write(&shared, b"someone else's bytes").unwrap();
    let holder = File::open(&shared).unwrap();
    holder.lock().unwrap();
    let part = Part::take(dir.path(), "archive.tar.gz").unwrap();
    assert!(!part.resumable);
    assert_ne!(part.path, shared);
    assert_eq!(part.len().unwrap(), 0);
    let failed = part.end_after(TrainError::Download {
        url: "u".into(),
        problem: "p".into(),
    });
    assert_eq!(failed.to_string(), "download of u failed: p");
    assert_eq!(
        std::fs::read(&shared).unwrap(),
        b"someone else's bytes",
        "untouched"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_failed_download_keeps_its_bytes_for_the_next_and_says_so() {
    let body = body(1 << 20);
    let server = serve(&body, |n| {
        if n == 0 {
            Answer::CutAfter(300_000)
        } else {
            Answer::Silent
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server, &body, Duration::from_millis(200));
    let part = Part::take(dir.path(), "archive.tar.gz").unwrap();
    let path = part.path.clone();
    let message = within(Duration::from_secs(60), move || {
        let failed = download(&opts, &part, &mut |_| {}).unwrap_err();
        part.end_after(failed).to_string()
    });
    assert!(
        message.contains("no data from")
            && message.contains(&format!(
                "the 300000 bytes received are kept in {}, and the next download resumes from them",
                path.display()
            )),
        "{message}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), &body[..300_000]);
}

#[test]
fn an_error_answer_is_not_retried() {
    let body = body(1000);
    let server = serve(&body, |_| Answer::Status(404));
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server, &body, Duration::from_secs(30));
    let (result, _, _, _) = fetch(dir.path(), &opts);
    let message = result.unwrap_err().to_string();
    assert!(
        message.contains("answered 404") && message.contains("--download-url"),
        "{message}"
    );
    assert_eq!(server.ranges().len(), 1);
}

#[test]
fn content_ranges_are_read() {
    assert_eq!(
        parse_content_range("bytes 5-9/10"),
        Some((Some(5), Some(10)))
    );
    assert_eq!(parse_content_range("bytes */10"), Some((None, Some(10))));
    assert_eq!(parse_content_range("bytes 5-9/*"), Some((Some(5), None)));
    assert_eq!(parse_content_range("items 5-9/10"), None);
}
