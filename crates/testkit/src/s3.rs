//! A real S3-compatible server for the S3 tests (moto's server mode, with IAM: credentials,
//! signatures and bucket policies are checked), and a fault-injecting HTTP proxy to put in front
//! of it (throttling, cut-off responses, stalls).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::python;

/// Buckets every server starts with; the user's policy allows exactly `train*`.
pub(crate) const BUCKETS: [&str; 2] = ["train-data", "train-models"];
/// A bucket name outside the test user's policy (S3 answers AccessDenied whether or not it exists).
pub const FORBIDDEN_BUCKET: &str = "other-team";
/// A bucket name the policy allows but that does not exist.
pub const MISSING_BUCKET: &str = "train-missing";

fn fixture_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/s3_fixture.py")
}

/// moto's S3 server on a free loopback port, with a user allowed `s3:*` on `train*` buckets and
/// the buckets of `BUCKETS`.
pub struct S3Server {
    child: Child,
    pub endpoint: String,
    pub addr: SocketAddr,
    pub access_key: String,
    pub secret_key: String,
}

impl S3Server {
    pub fn start() -> Self {
        // The server binds a port of the kernel's choosing and prints it: a port picked here and
        // bound by the server later could be taken by another test's server in between, and two
        // tests' set-ups would then meet one server (it happened in CI).
        let mut child = Command::new(python())
            .arg(fixture_script())
            .arg("serve")
            // The set-up's three IAM calls are served unauthenticated; everything after is
            // checked against IAM like AWS does.
            .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("python runs");
        let stdout = child.stdout.take().expect("piped stdout");
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = port_tx.send(line);
        });
        let line = port_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("moto's server to print its port within 60 s");
        let port: u16 = line.trim().parse().unwrap_or_else(|_| {
            let status = child.try_wait().ok().flatten();
            panic!(
                "moto's server printed no port ({line:?}, exit {status:?}): {} lacks moto[server]; \
                 run scripts/test, which installs it into target/pyenv",
                python().display()
            )
        });
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut server = S3Server {
            child,
            endpoint: format!("http://{addr}"),
            addr,
            access_key: String::new(),
            secret_key: String::new(),
        };
        let mut setup = vec!["setup", server.endpoint.as_str()];
        setup.extend(BUCKETS);
        let keys: serde_json::Value =
            serde_json::from_str(&run_fixture(&setup)).expect("setup prints JSON");
        server.access_key = keys["key"].as_str().expect("key").to_string();
        server.secret_key = keys["secret"].as_str().expect("secret").to_string();
        server
    }

    /// The environment a client needs to reach this server as the test user, with `endpoint`
    /// (this server's, or a proxy's in front of it).
    pub fn env_at(&self, endpoint: &str) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", endpoint),
            ("AWS_ACCESS_KEY_ID", &self.access_key),
            ("AWS_SECRET_ACCESS_KEY", &self.secret_key),
            ("AWS_REGION", "us-east-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    pub fn env(&self) -> Vec<(String, String)> {
        self.env_at(&self.endpoint)
    }

    /// Uploads every file under `dir` to `s3://bucket/prefix/...` with boto3, as the AWS CLI
    /// would (no trainctl metadata; ETags are MD5s).
    pub fn put_dir(&self, dir: &Path, bucket: &str, prefix: &str) {
        self.script(&["put", bucket, prefix, &dir.display().to_string()]);
    }

    /// Puts one object holding `text`, with `sha256` as its recorded checksum if given (true
    /// or not: a corrupt object is what some tests need).
    pub fn put_text(&self, bucket: &str, key: &str, text: &str, sha256: Option<&str>) {
        let mut args = vec!["put-text", bucket, key, text];
        args.extend(sha256);
        self.script(&args);
    }

    /// The object's size and user metadata, as boto3 reads them.
    pub fn head(&self, bucket: &str, key: &str) -> serde_json::Value {
        let out = self.script(&["get", bucket, key]);
        serde_json::from_str(&out).expect("get prints JSON")
    }

    /// `s3_fixture.py COMMAND ENDPOINT KEY SECRET ARGS...` as the test user.
    fn script(&self, args: &[&str]) -> String {
        let (command, rest) = args.split_first().expect("a command");
        let mut all = vec![*command, &self.endpoint, &self.access_key, &self.secret_key];
        all.extend(rest);
        run_fixture(&all)
    }
}

/// Runs `scripts/s3_fixture.py ARGS` and returns what it printed.
fn run_fixture(args: &[&str]) -> String {
    let out = Command::new(python())
        .arg(fixture_script())
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "s3_fixture.py {:?} failed: {}",
        args.first(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the proxy does to the requests it sees.
#[derive(Default)]
struct Faults {
    /// Answer this many next requests with 503 SlowDown.
    throttle: usize,
    /// Cut this many next responses off halfway through their body.
    cut: usize,
    /// Hold every request after this many more have been forwarded, until released.
    hold_after: Option<usize>,
}

struct Shared {
    faults: Mutex<Faults>,
    released: Condvar,
    requests: AtomicUsize,
    throttled: AtomicUsize,
    cut: AtomicUsize,
}

/// An HTTP/1.1 proxy on a free loopback port in front of `upstream`, one request per
/// connection, which injects faults on demand. Clients see real TCP and real status codes.
pub struct FaultProxy {
    pub endpoint: String,
    shared: Arc<Shared>,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        let shared = Arc::new(Shared {
            faults: Mutex::new(Faults::default()),
            released: Condvar::new(),
            requests: AtomicUsize::new(0),
            throttled: AtomicUsize::new(0),
            cut: AtomicUsize::new(0),
        });
        let accepting = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let shared = accepting.clone();
                std::thread::spawn(move || {
                    let _ = serve(client, upstream, &shared);
                });
            }
        });
        FaultProxy { endpoint, shared }
    }

    /// The next `n` requests get 503 SlowDown, as S3 answers when throttling.
    pub fn throttle_next(&self, n: usize) {
        self.faults().throttle = n;
    }

    /// The next `n` responses are cut off halfway through their body (the connection drops).
    pub fn cut_next(&self, n: usize) {
        self.faults().cut = n;
    }

    /// After `n` more requests are forwarded, every further one waits until `release`.
    pub fn hold_after(&self, n: usize) {
        self.faults().hold_after = Some(n);
    }

    pub fn release(&self) {
        self.faults().hold_after = None;
        self.shared.released.notify_all();
    }

    /// Requests seen (including throttled ones).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    pub fn throttled(&self) -> usize {
        self.shared.throttled.load(Ordering::SeqCst)
    }

    pub fn cut(&self) -> usize {
        self.shared.cut.load(Ordering::SeqCst)
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.shared.faults.lock().expect("proxy state")
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.release();
    }
}

enum Fate {
    Throttle,
    Cut,
    Forward,
}

fn serve(client: TcpStream, upstream: SocketAddr, shared: &Shared) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut head = Vec::new();
    let mut content_length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        if line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(value) = lower.strip_prefix("content-length:") {
            content_length = value.trim().parse().unwrap_or(0);
        }
        assert!(
            !lower.starts_with("transfer-encoding: chunked"),
            "the fault proxy forwards only requests with a Content-Length"
        );
        if lower.starts_with("connection:") {
            continue;
        }
        head.extend_from_slice(line.as_bytes());
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    let mut body = vec![0u8; content_length];
    reader.read_exact(&mut body)?;
    shared.requests.fetch_add(1, Ordering::SeqCst);

    let fate = {
        let mut faults = shared.faults.lock().expect("proxy state");
        while faults.hold_after == Some(0) {
            faults = shared.released.wait(faults).expect("proxy state");
        }
        if faults.throttle > 0 {
            faults.throttle -= 1;
            Fate::Throttle
        } else {
            if let Some(n) = faults.hold_after.as_mut() {
                *n -= 1;
            }
            if faults.cut > 0 {
                faults.cut -= 1;
                Fate::Cut
            } else {
                Fate::Forward
            }
        }
    };
    let mut client = client;
    if let Fate::Throttle = fate {
        shared.throttled.fetch_add(1, Ordering::SeqCst);
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                    <Message>Please reduce your request rate.</Message></Error>";
        write!(
            client,
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )?;
        return client.shutdown(Shutdown::Both);
    }
    let mut server = TcpStream::connect(upstream)?;
    server.set_read_timeout(Some(Duration::from_secs(60)))?;
    server.write_all(&head)?;
    server.write_all(&body)?;
    let mut response = Vec::new();
    server.read_to_end(&mut response)?;
    if let Fate::Cut = fate {
        shared.cut.fetch_add(1, Ordering::SeqCst);
        let body_start = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(0, |p| p + 4);
        let keep = body_start + (response.len() - body_start) / 2;
        client.write_all(&response[..keep])?;
    } else {
        client.write_all(&response)?;
    }
    client.shutdown(Shutdown::Both)
}
