//! The Prometheus text exposition format (version 0.0.4) and a minimal HTTP endpoint serving
//! it at `/metrics`.
//!
//! The server is a thread on a std `TcpListener`: one short request at a time, the request head
//! bounded (8 KiB, 5 s), `Connection: close`. That is all a scraper needs, and it keeps an async
//! runtime and an HTTP framework out of the launcher.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One metric family: name, help, type and its samples (labels, value).
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub samples: Vec<(Vec<(&'static str, String)>, f64)>,
}

impl Family {
    pub fn new(name: &'static str, kind: Kind, help: &'static str) -> Self {
        Family {
            name,
            help,
            kind,
            samples: Vec::new(),
        }
    }

    pub fn sample(mut self, labels: Vec<(&'static str, String)>, value: f64) -> Self {
        self.samples.push((labels, value));
        self
    }
}

/// `families` in the text format. Families without samples are left out.
pub fn encode(families: &[Family]) -> String {
    let mut out = String::new();
    for f in families.iter().filter(|f| !f.samples.is_empty()) {
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        let _ = writeln!(out, "# HELP {} {}", f.name, escape(f.help, false));
        let _ = writeln!(out, "# TYPE {} {kind}", f.name);
        for (labels, value) in &f.samples {
            out.push_str(f.name);
            if !labels.is_empty() {
                out.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{k}=\"{}\"", escape(v, true));
                }
                out.push('}');
            }
            let _ = writeln!(out, " {}", number(*value));
        }
    }
    out
}

fn escape(s: &str, quotes: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quotes => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out
}

fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

/// What `trainctl run --metrics-port` serves: the agent's own figures, set by its caller, and
/// the latest record of each local worker. Ages are kept on this process's monotonic clock.
#[derive(Debug, Default)]
pub struct JobGauges {
    /// The workers' restart count (TORCHELASTIC_RESTART_COUNT of the running group).
    pub restart_count: u32,
    /// Rendezvous round (elastic agents), or attempt.
    pub round: u64,
    pub world_size: u32,
    pub worker_starts: u64,
    /// Times this node's workers went on in a new group without restarting.
    pub regroups: u64,
    workers: std::collections::BTreeMap<u32, WorkerGauges>,
    last_checkpoint: Option<(std::time::Instant, u64)>,
    test_accuracy: Option<f64>,
    /// Nodes found slow (their slowdown) or found slow once and no longer (None), as rank 0
    /// recorded them (on rank 0's node).
    stragglers: std::collections::BTreeMap<u32, Option<f64>>,
}

#[derive(Debug)]
struct WorkerGauges {
    /// Steps this agent has seen the worker take (steps redone after a restart count again).
    steps: u64,
    last: crate::Step,
}

impl JobGauges {
    /// Takes in one record from a worker.
    pub fn record(&mut self, record: &crate::Record) {
        use crate::Record;
        match record {
            Record::Step(s) => {
                let w = self.workers.entry(s.rank).or_insert_with(|| WorkerGauges {
                    steps: 0,
                    last: s.clone(),
                });
                w.steps += 1;
                w.last = s.clone();
            }
            Record::Checkpoint(c) => {
                self.last_checkpoint = Some((std::time::Instant::now(), c.step));
            }
            Record::Eval(e) => self.test_accuracy = Some(e.accuracy),
            Record::Straggler(s) => {
                self.stragglers.insert(s.node, s.slow.then_some(s.slowdown));
            }
            Record::Start(_) | Record::Epoch(_) | Record::Regroup(_) => {}
        }
    }

    /// Every family, in the order they are served: the agent's, its workers', the stragglers',
    /// and what the run has produced.
    pub fn families(&self) -> Vec<Family> {
        let mut out = self.agent_families();
        out.extend(self.worker_families());
        out.push(self.straggler_family());
        out.extend(self.result_families());
        out
    }

    /// The agent's own figures: restarts, round, workers started, regroups, world size.
    fn agent_families(&self) -> Vec<Family> {
        vec![
            Family::new(
                "trainctl_agent_restarts",
                Kind::Gauge,
                "Restart count of this node's workers (failures counted against --max-restarts).",
            )
            .sample(vec![], self.restart_count as f64),
            Family::new(
                "trainctl_agent_round",
                Kind::Gauge,
                "Rendezvous round (elastic) or attempt of the running workers.",
            )
            .sample(vec![], self.round as f64),
            Family::new(
                "trainctl_agent_worker_starts_total",
                Kind::Counter,
                "Workers this agent has started.",
            )
            .sample(vec![], self.worker_starts as f64),
            Family::new(
                "trainctl_agent_regroups_total",
                Kind::Counter,
                "Times this node's workers went on in a new group (a node lost or joined) without a restart.",
            )
            .sample(vec![], self.regroups as f64),
            Family::new(
                "trainctl_world_size",
                Kind::Gauge,
                "Workers in the job (all nodes).",
            )
            .sample(vec![], self.world_size as f64),
        ]
    }

    /// Each local worker's latest figures, one sample per rank: steps, global step, epoch,
    /// loss, throughput, the last step's time by phase, and its slowdown.
    fn worker_families(&self) -> Vec<Family> {
        let per_worker = |name, kind, help, f: fn(&WorkerGauges) -> f64| {
            self.workers
                .iter()
                .fold(Family::new(name, kind, help), |fam, (r, w)| {
                    fam.sample(rank(r), f(w))
                })
        };
        vec![
            per_worker(
                "trainctl_steps_total",
                Kind::Counter,
                "Steps this node's worker has taken since the agent started.",
                |w| w.steps as f64,
            ),
            per_worker(
                "trainctl_global_step",
                Kind::Gauge,
                "The job's global step after the worker's last step.",
                |w| w.last.step as f64,
            ),
            per_worker("trainctl_epoch", Kind::Gauge, "Current epoch (1-based).", |w| {
                w.last.epoch as f64
            }),
            per_worker(
                "trainctl_loss",
                Kind::Gauge,
                "Mean training loss of the last step.",
                |w| w.last.loss as f64,
            ),
            per_worker(
                "trainctl_images_per_second",
                Kind::Gauge,
                "Images per second of the whole job at the last step.",
                |w| w.last.images_per_sec,
            ),
            self.step_seconds(),
            self.workers.iter().fold(
                Family::new(
                    "trainctl_rank_slowdown",
                    Kind::Gauge,
                    "The worker's time before the all-reduce (data and compute) at its last step over the median rank's: 1 as fast as most, 2 twice as slow.",
                ),
                |fam, (r, w)| match w.last.slowdown {
                    Some(x) => fam.sample(rank(r), x),
                    None => fam,
                },
            ),
        ]
    }

    /// Each worker's last step's wall time, by phase.
    fn step_seconds(&self) -> Family {
        let mut step_seconds = Family::new(
            "trainctl_step_seconds",
            Kind::Gauge,
            "Wall time of the worker's last step, by phase (step = all of it).",
        );
        for (r, w) in &self.workers {
            for (phase, v) in [
                ("step", w.last.step_s),
                ("data", w.last.data_s),
                ("compute", w.last.compute_s),
                ("allreduce", w.last.allreduce_s),
            ] {
                step_seconds = step_seconds.sample(
                    vec![("rank", r.to_string()), ("phase", phase.to_string())],
                    v,
                );
            }
        }
        step_seconds
    }

    /// The nodes rank 0 found slow, by their slowdown (0 once no longer slow).
    fn straggler_family(&self) -> Family {
        self.stragglers.iter().fold(
            Family::new(
                "trainctl_straggler_slowdown",
                Kind::Gauge,
                "A node rank 0 found slow: its slowdown over the other nodes' median; 0 once it is no longer slow.",
            ),
            |fam, (node, slowdown)| {
                fam.sample(vec![("node", node.to_string())], slowdown.unwrap_or(0.0))
            },
        )
    }

    /// What the run has produced, once it has: the last checkpoint's age and step, and the
    /// finished model's test accuracy.
    fn result_families(&self) -> Vec<Family> {
        let mut out = Vec::new();
        if let Some((at, step)) = self.last_checkpoint {
            out.push(
                Family::new(
                    "trainctl_last_checkpoint_age_seconds",
                    Kind::Gauge,
                    "Seconds since rank 0 last wrote a checkpoint (reported to this agent).",
                )
                .sample(vec![], at.elapsed().as_secs_f64()),
            );
            out.push(
                Family::new(
                    "trainctl_last_checkpoint_step",
                    Kind::Gauge,
                    "Global step of the last checkpoint.",
                )
                .sample(vec![], step as f64),
            );
        }
        if let Some(acc) = self.test_accuracy {
            out.push(
                Family::new(
                    "trainctl_test_accuracy_percent",
                    Kind::Gauge,
                    "Test-set accuracy of the finished model.",
                )
                .sample(vec![], acc),
            );
        }
        out
    }
}

/// The label that names a worker's rank.
fn rank(r: &u32) -> Vec<(&'static str, String)> {
    vec![("rank", r.to_string())]
}

pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running `/metrics` endpoint; stopped and joined on drop.
pub struct Server {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves `render()` at `http://LISTENER/metrics` until dropped.
    pub fn start(
        listener: TcpListener,
        render: impl Fn() -> String + Send + 'static,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("metrics endpoint".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopping.load(Ordering::Acquire) {
                        break;
                    }
                    if let Ok(mut conn) = conn {
                        let _ = answer(&mut conn, &render);
                        let _ = linger(&mut conn);
                    }
                }
            })?;
        Ok(Server {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// Closes our side, then reads what the client still sends (bounded): closing with unread
/// bytes would reset the connection and could destroy the response in flight.
fn linger(conn: &mut TcpStream) -> std::io::Result<()> {
    conn.shutdown(std::net::Shutdown::Write)?;
    let mut buf = [0u8; 4096];
    let mut left = 1usize << 20;
    while left > 0 {
        match conn.read(&mut buf)? {
            0 => break,
            n => left = left.saturating_sub(n),
        }
    }
    Ok(())
}

fn answer(conn: &mut TcpStream, render: &dyn Fn() -> String) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST_HEAD {
            return respond(
                conn,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            );
        }
    }
    let first = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = first.split(|&b| b == b' ');
    let (method, target) = (parts.next(), parts.next());
    let path = target.map(|t| t.split(|&b| b == b'?').next().unwrap_or_default());
    match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => respond(conn, "200 OK", CONTENT_TYPE, &render()),
        (Some(b"GET"), Some(b"/")) => respond(
            conn,
            "200 OK",
            "text/plain",
            "trainctl metrics: GET /metrics\n",
        ),
        (Some(b"GET"), _) => respond(conn, "404 Not Found", "text/plain", "try /metrics\n"),
        _ => respond(conn, "405 Method Not Allowed", "text/plain", ""),
    }
}

fn respond(
    conn: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_escapes_and_spells_special_values() {
        let text = encode(&[
            Family::new(
                "trainctl_loss",
                Kind::Gauge,
                "Loss of the last step.\nMean.",
            )
            .sample(vec![("rank", "0".into())], 2.5)
            .sample(vec![("rank", "a\"b\\c".into())], f64::NAN),
            Family::new("trainctl_steps_total", Kind::Counter, "Steps.")
                .sample(vec![], f64::INFINITY),
            Family::new("trainctl_unused", Kind::Gauge, "Never set."),
        ]);
        assert_eq!(
            text,
            "# HELP trainctl_loss Loss of the last step.\\nMean.\n\
             # TYPE trainctl_loss gauge\n\
             trainctl_loss{rank=\"0\"} 2.5\n\
             trainctl_loss{rank=\"a\\\"b\\\\c\"} NaN\n\
             # HELP trainctl_steps_total Steps.\n\
             # TYPE trainctl_steps_total counter\n\
             trainctl_steps_total +Inf\n"
        );
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest() {
        let server = Server::start(TcpListener::bind("127.0.0.1:0").unwrap(), || {
            "up 1\n".to_string()
        })
        .unwrap();
        let get = |request: &str| {
            let mut c = TcpStream::connect(server.addr()).unwrap();
            c.write_all(request.as_bytes()).unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).unwrap();
            out
        };
        let ok = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains(CONTENT_TYPE) && ok.ends_with("\r\n\r\nup 1\n"),
            "{ok}"
        );
        assert!(get("GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
        assert!(get(&huge).starts_with("HTTP/1.1 431"));
        drop(server);
    }
}
