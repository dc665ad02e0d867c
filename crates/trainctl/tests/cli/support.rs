//! Helpers: temporary jobs, the binary, output capture and waiting with deadlines.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use trainer::data::synthetic;

/// `trainctl run --standalone --nproc-per-node 2`: a test adds its launcher flags and program.
pub(crate) fn two_local_workers() -> Command {
    let mut cmd = trainctl();
    cmd.args(["run", "--standalone", "--nproc-per-node", "2"]);
    cmd
}

/// Two local workers on `args` with `--max-restarts 1`; worker 1 is SIGKILLed once a line of
/// output satisfies `when`, and the job must still succeed. Returns its output.
pub(crate) fn two_local_workers_one_killed(args: &[String], when: impl Fn(&str) -> bool) -> String {
    let mut run = Running::start(two_local_workers().args(["--max-restarts", "1"]).args(args));
    run.wait_for_line(Duration::from_secs(120), when);
    run.kill_worker(1, Duration::from_secs(20));
    assert!(
        run.wait(Duration::from_secs(180)).success(),
        "{}",
        run.output()
    );
    run.output()
}

pub(crate) fn trainctl() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainctl"));
    cmd.env_remove("RUST_LOG");
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TRAINCTL_JOB_TOKEN",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// A `.tar.gz` laid out like CIFAR-10's official binary archive (`cifar-10-batches-bin/...`),
/// holding `train` and `test` generated images.
pub(crate) fn cifar_archive(train: usize, test: usize) -> Vec<u8> {
    use std::io::Write;
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    for (name, images) in [
        ("data_batch_1.bin", synthetic::cifar(train, 1)),
        ("test_batch.bin", synthetic::cifar(test, 2)),
    ] {
        let bytes = synthetic::binary_bytes(&images);
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(
            &mut header,
            format!("{}/{name}", trainer::data::cifar::BIN_DIR),
            &bytes[..],
        )
        .unwrap();
    }
    let mut gz = tar.into_inner().unwrap();
    gz.flush().unwrap();
    gz.finish().unwrap()
}

/// A temporary directory with a small learnable data set in `data/`.
pub(crate) struct Job {
    pub dir: tempfile::TempDir,
}

impl Job {
    pub(crate) fn new(train: usize, test: usize) -> Job {
        let dir = tempfile::tempdir().unwrap();
        synthetic::write_binary(
            &dir.path().join("data"),
            &synthetic::cifar(train, 1),
            &synthetic::cifar(test, 2),
        )
        .unwrap();
        Job { dir }
    }

    pub(crate) fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub(crate) fn data(&self) -> PathBuf {
        self.path("data")
    }
}

pub(crate) fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    succeeded(cmd, out)
}

/// `out`, which `cmd` must have succeeded with (else a panic with both outputs).
pub(crate) fn succeeded(cmd: &Command, out: Output) -> Output {
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `cmd`, which must fail with exit code 1 (the job failed), and returns its stderr.
pub(crate) fn run_failing(cmd: &mut Command) -> String {
    run_failing_with(cmd, 1)
}

/// The stderr of `cmd`, which must exit with `code`.
pub(crate) fn run_failing_with(cmd: &mut Command, code: i32) -> String {
    let out = cmd.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(code),
        "{cmd:?}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text(&out.stderr)
}

pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A running process whose stdout and stderr lines arrive on a channel as they are written.
pub(crate) struct Running {
    pub child: Child,
    lines: Receiver<String>,
    pub seen: Vec<String>,
}

impl Running {
    pub(crate) fn start(cmd: &mut Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Running {
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits until a line satisfies `pred`, failing the test after `timeout`.
    pub(crate) fn wait_for_line(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no matching line within {timeout:?}; output so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// A line satisfying `pred` among those already read, else the next one that does
    /// ([`Self::wait_for_line`]): for lines of several processes, whose order is theirs.
    pub(crate) fn seen_or_wait_for_line(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        match self.seen.iter().find(|l| pred(l)) {
            Some(line) => line.clone(),
            None => self.wait_for_line(timeout, pred),
        }
    }

    /// Waits until the launcher has reported `n` started workers; returns `(rank, pid)`s.
    /// (stdout and stderr arrive on separate threads, so their lines may come in any order.)
    pub(crate) fn wait_for_workers(&mut self, n: usize, timeout: Duration) -> Vec<(u32, i32)> {
        while worker_pids(&self.seen).len() < n {
            self.wait_for_line(timeout, |l| l.contains("started rank"));
        }
        worker_pids(&self.seen)
    }

    /// Waits for the process to exit, failing the test after `timeout`; returns the exit status
    /// and drains the remaining output into `seen`.
    pub(crate) fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(500)) {
                    self.seen.push(line);
                }
                return status;
            }
            if Instant::now() > deadline {
                let stacks = live_workers_stacks(&self.seen);
                let _ = self.child.kill();
                panic!(
                    "still running after {timeout:?}; output:\n{}{stacks}",
                    self.seen.join("\n")
                );
            }
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn output(&self) -> String {
        self.seen.join("\n")
    }

    /// SIGKILLs the worker of `rank` (of the latest start reported) once both workers of a
    /// two-worker launch have been reported.
    pub(crate) fn kill_worker(&mut self, rank: u32, timeout: Duration) {
        let pids = self.wait_for_workers(2, timeout);
        let (_, victim) = pids
            .iter()
            .rev()
            .find(|(r, _)| *r == rank)
            .copied()
            .unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }

    pub(crate) fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

/// Pids of the workers, from the launcher's "started rank R (pid P)" lines.
pub(crate) fn worker_pids(lines: &[String]) -> Vec<(u32, i32)> {
    lines
        .iter()
        .filter_map(|l| {
            let rest = l.split("started rank ").nth(1)?;
            let (rank, rest) = rest.split_once(" (pid ")?;
            Some((rank.parse().ok()?, rest.trim_end_matches(')').parse().ok()?))
        })
        .collect()
}

/// Where the workers this output started and that still run are (their Python stacks, read
/// as the launcher's hang watch reads them), for the message of a process that did not end: a
/// hang seen once is read from it.
fn live_workers_stacks(lines: &[String]) -> String {
    let mut out = String::new();
    for (rank, pid) in worker_pids(lines) {
        if !alive(pid) {
            continue;
        }
        let dump = launcher::stacks::dump(pid as u32);
        out.push_str(&format!("\n--- worker rank {rank}, still running: {dump}"));
    }
    out
}

/// Whether a process with this pid exists (a zombie counts as gone: it runs nothing).
pub(crate) fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.split(") ").nth(1).is_some_and(|s| s.starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits until `cond` holds, failing after `timeout`.
pub(crate) fn eventually(timeout: Duration, what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `[epoch, iter] loss: x` lines, in order.
pub(crate) fn losses(output: &str) -> Vec<f32> {
    output
        .lines()
        .filter_map(|l| {
            l.split("loss: ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// `(rank, steps, fingerprint)` from every "rank R finished after N steps; weights fingerprint F".
pub(crate) fn finished(output: &str) -> Vec<(u32, u64, String)> {
    output
        .lines()
        .filter_map(|l| {
            let rest = l.split("rank ").nth(1)?;
            let (rank, rest) = rest.split_once(" finished after ")?;
            let (steps, rest) = rest.split_once(" steps; weights fingerprint ")?;
            let fingerprint = rest.split_whitespace().next()?;
            Some((
                rank.parse().ok()?,
                steps.parse().ok()?,
                fingerprint.to_string(),
            ))
        })
        .collect()
}

pub(crate) fn exists(p: &Path) -> bool {
    p.is_file() && std::fs::metadata(p).map(|m| m.len() > 0).unwrap_or(false)
}

/// `train` with the tests' usual small settings: batch 32, a loss line every step, seed 7, one
/// thread, outputs under the job's `out` folder.
pub(crate) fn train_args(job: &Job, out: &str, epochs: usize) -> Vec<String> {
    train_args_lr(job, out, epochs, "0.001")
}

pub(crate) fn train_args_lr(job: &Job, out: &str, epochs: usize, lr: &str) -> Vec<String> {
    train_args_at(&job.data(), &job.path(out), epochs, lr)
}

/// The same settings on the data at `data`, writing under `out`.
pub(crate) fn train_args_at(data: &Path, out: &Path, epochs: usize, lr: &str) -> Vec<String> {
    [
        "train",
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        &epochs.to_string(),
        "--batch-size",
        "32",
        "--print-freq",
        "1",
        "--learning-rate",
        lr,
        "--seed",
        "7",
        "--threads",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Serves `body` to every GET on 127.0.0.1 until the test ends; returns its URL, ending in
/// `file`.
pub(crate) fn serve(body: Vec<u8>, file: &str) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/{file}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let header = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(header.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    url
}

impl Running {
    /// Kills this launcher outright (no chance to clean up) and waits for its `workers` to
    /// die with it.
    pub(crate) fn kill_launcher(&mut self, workers: usize) {
        let pids = self.wait_for_workers(workers, Duration::from_secs(20));
        self.child.kill().unwrap();
        self.wait(Duration::from_secs(10));
        for (_, pid) in &pids {
            eventually(Duration::from_secs(10), "orphaned workers to die", || {
                !alive(*pid)
            });
        }
    }
}

/// The digest of an epoch that trained each of images `0..n` once (an `epoch` record's
/// `samples_digest`).
pub(crate) fn every_image(n: usize) -> String {
    format!(
        "{:016x}",
        trainer::sampler::digest(&(0..n).collect::<Vec<_>>())
    )
}

/// Each argument of a `--help` text, by section: its spec (`-f, --follow`, `--name <VALUE>`)
/// and its description with clap's own `[default: ...]`-style notes and the line breaks left
/// out, and the subcommands it lists.
pub(crate) fn help_entries(help: &str) -> (Vec<(String, String)>, Vec<String>) {
    let mut entries: Vec<(String, String)> = Vec::new();
    let mut commands = Vec::new();
    let mut section = "";
    let mut open = false;
    for line in help.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            section = line;
            open = false;
            continue;
        }
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() || section.is_empty() {
            open = false;
            continue;
        }
        if section == "Commands:" {
            if indent == 2 {
                commands.extend(trimmed.split_whitespace().next().map(String::from));
            }
            continue;
        }
        // An argument's first line: two spaces, or six for a long flag without a short one;
        // its description follows two spaces later, or on the next lines, indented further.
        if (indent == 2 || indent == 6) && trimmed.starts_with(['-', '<', '[']) {
            let (spec, rest) = trimmed.split_once("  ").unwrap_or((trimmed, ""));
            entries.push((spec.to_string(), rest.trim().to_string()));
            open = true;
        } else if open && let Some((_, description)) = entries.last_mut() {
            description.push(' ');
            description.push_str(trimmed);
        }
    }
    (entries, commands)
}

/// fixtures/loop_patterns.py's flags for every pattern at once: a per-step OneCycleLR,
/// accumulation over two micro-batches, fp16 autocast with a GradScaler, two DataLoader
/// workers, an evaluation every epoch and an EMA (torch's AveragedModel, given as `state=`).
pub(crate) const EVERY_PATTERN: [&str; 10] = [
    "--scheduler",
    "onecycle",
    "--accumulate",
    "2",
    "--amp",
    "--workers",
    "2",
    "--evaluate",
    "--ema",
    "averaged",
];
