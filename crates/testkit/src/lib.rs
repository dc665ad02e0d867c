//! Fixtures for tests that need real things: an etcd server (Debian's `etcd-server`, which
//! `scripts/test` installs) on free ports, and several hosts as network namespaces joined by a
//! bridge, with links that can be cut; and the reference readers of trainctl's telemetry
//! (TensorBoard, prometheus_client) in a Python environment; an S3 server (`s3`). Test code only: every failure here panics with what to
//! do about it.

// Test fixtures read the test runner's own environment (PATH, TRAINCTL_ETCD, TRAINCTL_PYTHON), not the worker
// contract that collective::world guards.
#![allow(clippy::disallowed_methods)]

pub mod s3;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A port nobody listens on now (on this host's loopback), and one this test process has not
/// handed out before: tests run in parallel, and the kernel may offer a port again while the
/// server it went to is still starting.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free port");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Polls `done` until it holds; panics with `what` after `timeout`.
pub fn eventually(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The etcd binary: `TRAINCTL_ETCD`, else `etcd` on PATH.
pub(crate) fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TRAINCTL_ETCD") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    })
}

/// A Python with TensorBoard and prometheus_client: `TRAINCTL_PYTHON` (set by scripts/test),
/// else the workspace's `target/pyenv`, which scripts/test creates.
pub fn python() -> PathBuf {
    let python = std::env::var_os("TRAINCTL_PYTHON").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/pyenv/bin/python"),
        PathBuf::from,
    );
    assert!(
        python.is_file(),
        "{} not found: run scripts/test (it installs TensorBoard and prometheus_client from PyPI into target/pyenv), or set TRAINCTL_PYTHON",
        python.display()
    );
    python
}

/// A Python with torch and safetensors, for the PyTorch tests: `TRAINCTL_TEST_PYTHON`, the
/// test environment (`TRAINCTL_PYTHON` or `target/pyenv`, where scripts/test installs torch),
/// or `bench/.venv` (made by bench/run.sh). `None` where there is none: the caller says
/// SKIPPED loudly (a plain `cargo test` does not install a multi-GB PyTorch).
pub fn python_with_torch() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let candidates = [
        std::env::var_os("TRAINCTL_TEST_PYTHON").map(PathBuf::from),
        std::env::var_os("TRAINCTL_PYTHON").map(PathBuf::from),
        Some(root.join("target/pyenv/bin/python")),
        Some(root.join("bench/.venv/bin/python")),
    ];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import torch.distributed, safetensors"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Whether `python` imports `modules` (`"transformers, accelerate"`).
pub fn python_imports(python: &Path, modules: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The checkout's Python package (`python/`), for `PYTHONPATH`: the tests run the code they
/// were built with, whatever copy is installed.
pub fn python_package() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python")
}

/// Runs `scripts/read_telemetry.py ARGS` (stdin from `input`) and returns its JSON.
pub fn read_telemetry(args: &[&str], input: Option<&str>) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/read_telemetry.py");
    let mut child = Command::new(python())
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python starts");
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.unwrap_or_default().as_bytes())
            .expect("python reads its input");
    }
    let out = child.wait_with_output().expect("python runs");
    assert!(
        out.status.success(),
        "read_telemetry.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("read_telemetry.py prints JSON")
}

/// A real etcd server with its own data directory; killed when dropped.
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    ip: String,
    client_port: u16,
    peer_port: u16,
    netns: Option<String>,
}

impl EtcdServer {
    /// Starts etcd on 127.0.0.1, free ports.
    pub fn start() -> Self {
        Self::start_at(None, "127.0.0.1", free_port(), free_port())
    }

    /// Starts etcd inside network namespace `netns` (if any) on `ip`.
    pub fn start_at(netns: Option<&str>, ip: &str, client_port: u16, peer_port: u16) -> Self {
        let mut server = EtcdServer {
            child: None,
            dir: tempfile::tempdir().expect("temp dir"),
            ip: ip.to_string(),
            client_port,
            peer_port,
            netns: netns.map(str::to_string),
        };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let etcd = etcd_binary().expect(
            "etcd not found: run scripts/test (it installs Debian's etcd-server), or set TRAINCTL_ETCD",
        );
        let client = format!("http://{}:{}", self.ip, self.client_port);
        let peer = format!("http://{}:{}", self.ip, self.peer_port);
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&etcd);
                c
            }
            None => Command::new(&etcd),
        };
        cmd.arg("--name")
            .arg("test")
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(self.dir.path().join("etcd.log"))
                    .map(Stdio::from)
                    .unwrap_or(Stdio::null()),
            );
        self.child = Some(cmd.spawn().expect("cannot start etcd"));
        let ready = || self.health().is_some_and(|body| body.contains("\"true\""));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready() {
            if Instant::now() > deadline {
                let log =
                    std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
                panic!("etcd did not become healthy within 20 s; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// GET /health, from this process's namespace (loopback only).
    fn health(&self) -> Option<String> {
        if self.netns.is_some() {
            // bash's /dev/tcp: nothing to install inside the namespace.
            let script = format!(
                "exec 3<>/dev/tcp/{}/{} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && timeout 1 cat <&3",
                self.ip, self.client_port
            );
            let out = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    self.netns.as_deref()?,
                    "bash",
                    "-c",
                    &script,
                ])
                .output()
                .ok()?;
            return Some(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        let mut s = TcpStream::connect((self.ip.as_str(), self.client_port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        s.write_all(b"GET /health HTTP/1.0\r\n\r\n").ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        Some(body)
    }

    pub fn url(&self) -> String {
        format!("http://{}:{}", self.ip, self.client_port)
    }

    /// Kills the server (its data stays) and starts it again on the same ports.
    pub fn restart(&mut self, down_for: Duration) {
        self.kill();
        std::thread::sleep(down_for);
        self.launch();
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Hosts as network namespaces on one bridge, addresses 198.18.0.1, .2, ... (RFC 2544's test
/// range); traffic never leaves this machine. Everything is removed when dropped.
pub struct Network {
    switch: String,
    hosts: Vec<String>,
    ports: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Network {
    /// Creates `n` hosts; `Err` when this kernel or user may not create namespaces.
    pub fn create(n: usize) -> Result<Network, String> {
        static COUNT: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "t{}x{}",
            std::process::id() % 100_000,
            COUNT.fetch_add(1, Ordering::SeqCst)
        );
        let mut net = Network {
            switch: format!("{tag}sw"),
            hosts: Vec::new(),
            ports: Vec::new(),
        };
        ip(&["netns", "add", &net.switch])?;
        let sw = net.switch.clone();
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 1..=n {
            let host = format!("{tag}h{i}");
            let (inner, outer) = (format!("{tag}i{i}"), format!("{tag}o{i}"));
            ip(&["netns", "add", &host])?;
            net.hosts.push(host.clone());
            ip(&[
                "link", "add", &inner, "type", "veth", "peer", "name", &outer,
            ])?;
            ip(&["link", "set", &inner, "netns", &host])?;
            ip(&["link", "set", &outer, "netns", &sw])?;
            net.ports.push(outer.clone());
            ip(&["-n", &sw, "link", "set", &outer, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &host,
                "addr",
                "add",
                &format!("198.18.0.{i}/24"),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &host, "link", "set", &inner, "up"])?;
            ip(&["-n", &host, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Namespace name of host `i` (0-based).
    pub fn host(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    pub fn addr(&self, i: usize) -> String {
        format!("198.18.0.{}", i + 1)
    }

    /// `program` to run inside host `i`.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.host(i)]).arg(program);
        c
    }

    /// Gives every host the same `/etc/hosts`: `names[k]` resolves to host `k`'s address (as
    /// Kubernetes DNS gives pods and Services names). `ip netns exec` bind-mounts
    /// `/etc/netns/NS/hosts` over `/etc/hosts` for what it runs; removed when dropped.
    pub fn name_hosts(&self, names: &[(&str, usize)]) {
        let mut text = String::from("127.0.0.1 localhost\n");
        for (name, host) in names {
            text.push_str(&format!("{} {name}\n", self.addr(*host)));
        }
        for ns in &self.hosts {
            let dir = Path::new("/etc/netns").join(ns);
            std::fs::create_dir_all(&dir).expect("create /etc/netns/NS");
            std::fs::write(dir.join("hosts"), &text).expect("write /etc/netns/NS/hosts");
        }
    }

    /// Cuts host `i`'s link: its packets go nowhere, no connection is reset.
    pub fn cut(&self, i: usize) {
        ip(&["-n", &self.switch, "link", "set", &self.ports[i], "down"]).expect("cut link");
    }

    /// Mends host `i`'s link after [`Network::cut`].
    pub fn mend(&self, i: usize) {
        ip(&["-n", &self.switch, "link", "set", &self.ports[i], "up"]).expect("mend link");
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "del", ns]);
            let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(ns));
        }
    }
}
