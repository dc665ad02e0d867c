//! Conformance of the Python package's control channel (`python/trainctl/control.py`) to the
//! protocol's one definition, `collective::control`: the real agent-side types encode and
//! decode every message against the Python end, and every kind of malformed frame makes the
//! Python end say what is wrong and stop, never hang or accept it.
//!
//! Needs only `python3` (the channel is torch-free).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use collective::control::{Message, Regrouped, ToAgent, ToWorker};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `control_peer.py MODE` with the worker's end of a fresh socket pair; returns the agent's end.
fn peer(mode: &str) -> (UnixStream, Child) {
    let (agent, worker) = UnixStream::pair().unwrap();
    // Inherited by the child: not close-on-exec (closed here once it has started).
    nix::fcntl::fcntl(
        &worker,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )
    .unwrap();
    let child = Command::new("python3")
        .arg(repo().join("crates/collective/tests/fixtures/control_peer.py"))
        .arg(mode)
        .env("PYTHONPATH", repo().join("python"))
        .env("TRAINCTL_CONTROL_FD", worker.as_raw_fd().to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    drop(worker);
    agent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    (agent, child)
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

/// The JSON lines the Python end printed, once it has exited (within a deadline).
fn lines(mut child: Child) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the Python end did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect()
}

#[test]
fn every_worker_message_from_python_decodes_as_the_agent_reads_it() {
    let (mut agent, child) = peer("send");
    let mut got = Vec::new();
    for _ in 0..6 {
        let mut len = [0u8; 4];
        agent.read_exact(&mut len).unwrap();
        let mut payload = vec![0u8; u32::from_le_bytes(len) as usize];
        agent.read_exact(&mut payload).unwrap();
        got.push(ToAgent::decode(&payload).unwrap());
    }
    assert_eq!(
        got,
        [
            ToAgent::Ready,
            ToAgent::Lost {
                assignments: 7,
                step: 42,
                reason: "peer lost: ünïcode ✓".into()
            },
            ToAgent::Paused {
                assignments: 8,
                step: 43
            },
            ToAgent::Regrouped(Regrouped {
                world_size_before: 3,
                world_size: 2,
                rank: 1,
                step: 44,
                steps_dropped: 0,
                bytes: 12345,
                seconds: 0.25,
                received: true,
                assignments: 9,
            }),
            ToAgent::Straggler {
                slow: true,
                report: "node 2 (ranks 4-5) is a straggler ✓".into()
            },
            ToAgent::Finished,
        ]
    );
    lines(child);
}

#[test]
fn every_agent_message_decodes_in_python_as_it_was_sent() {
    let (mut agent, child) = peer("read");
    let env: Vec<(String, String)> = (0..50)
        .map(|i| (format!("VAR_{i}"), format!("välue {i} ✓")))
        .chain([("EMPTY".to_string(), String::new())])
        .collect();
    for message in [
        ToWorker::Abort,
        ToWorker::Leave,
        ToWorker::Assign(env.clone()),
    ] {
        agent.write_all(&frame(&message.encode())).unwrap();
    }
    // One frame split across writes arrives whole.
    let split = frame(&ToWorker::Leave.encode());
    agent.write_all(&split[..2]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    agent.write_all(&split[2..]).unwrap();
    drop(agent);
    let got = lines(child);
    let env_json: Vec<serde_json::Value> =
        env.iter().map(|(k, v)| serde_json::json!([k, v])).collect();
    assert_eq!(
        got,
        [
            serde_json::json!({"abort": true}),
            serde_json::json!({"leave": true}),
            serde_json::json!({"assign": env_json}),
            serde_json::json!({"leave": true}),
            serde_json::json!({"closed": "the other end of the control channel closed it"}),
        ]
    );
}

/// Frames the protocol does not allow: each is refused with what is wrong (the Rust decoder
/// refuses the same payloads), and the Python end stops instead of waiting.
#[test]
fn malformed_frames_are_refused_by_python_as_by_rust() {
    let mut assign_bad_utf8 = vec![1u8];
    assign_bad_utf8.extend(1u32.to_le_bytes());
    assign_bad_utf8.extend(1u32.to_le_bytes());
    assign_bad_utf8.push(0xFF);
    assign_bad_utf8.extend(0u32.to_le_bytes());
    let mut trailing = ToWorker::Abort.encode();
    trailing.push(0);
    let mut too_many = vec![1u8];
    too_many.extend(u32::MAX.to_le_bytes());
    let truncated = ToWorker::Assign(vec![("A".into(), "B".into())]).encode();
    let truncated = truncated[..truncated.len() - 1].to_vec();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("an unknown kind", vec![9], "unknown message kind 9"),
        (
            "no kind at all",
            vec![],
            "message kind: needs 1 bytes, 0 left",
        ),
        ("bytes left over", trailing, "1 unexpected trailing bytes"),
        (
            "more variables than bytes",
            too_many,
            "4294967295 variables in a message of 5 bytes",
        ),
        ("a value cut short", truncated, "needs 1 bytes, 0 left"),
        (
            "a name that is not UTF-8",
            assign_bad_utf8,
            "not valid UTF-8",
        ),
    ];
    for (what, payload, says) in cases {
        assert!(ToWorker::decode(&payload).is_err(), "Rust accepts {what}");
        let (mut agent, child) = peer("read");
        agent.write_all(&frame(&payload)).unwrap();
        let got = lines(child);
        let error = got
            .last()
            .and_then(|l| l["error"].as_str())
            .unwrap_or_else(|| panic!("{what}: no error: {got:?}"))
            .to_string();
        assert!(error.contains(says), "{what}: {error}");
        drop(agent);
    }
    // A length over the limit: refused from the header alone, before any body is awaited.
    let (mut agent, child) = peer("read");
    agent.write_all(&(64 * 1024 + 1u32).to_le_bytes()).unwrap();
    let got = lines(child);
    assert!(
        got.last()
            .and_then(|l| l["error"].as_str())
            .is_some_and(|e| e.contains("a frame of 65537 bytes is over the limit of 65536")),
        "{got:?}"
    );
}
