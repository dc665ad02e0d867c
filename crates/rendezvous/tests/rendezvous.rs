//! Real agents' rendezvous over a real store: trainctl's c10d store on loopback, and a real
//! etcd server (started here, on free ports).

use std::time::Duration;

use rendezvous::{BackendKind, Config, Joined, Limits, Rendezvous, Watch};

fn config(run_id: &str) -> Config {
    let mut cfg = Config::new(run_id, Limits { min: 2, max: 3 });
    cfg.last_call_timeout = Duration::from_millis(300);
    cfg.heartbeat = Duration::from_millis(200);
    cfg.heartbeat_timeout = Duration::from_secs(2);
    cfg.join_timeout = Duration::from_secs(30);
    cfg
}

fn open(kind: &BackendKind, run_id: &str) -> Rendezvous {
    Rendezvous::open(config(run_id), kind, 1, None).expect("open rendezvous")
}

fn join_all(agents: Vec<Rendezvous>) -> Vec<(Rendezvous, rendezvous::Assignment)> {
    let handles: Vec<_> = agents
        .into_iter()
        .map(|mut a| {
            std::thread::spawn(
                move || match a.join(&|| false, &mut |_| {}).expect("join") {
                    Joined::Assigned(x) => (a, x),
                    other => panic!("expected an assignment, got {other:?}"),
                },
            )
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn scenario(kind: BackendKind) {
    let run = format!("r{}", rand_suffix());
    let first = open(&kind, &run);
    let agents = vec![first, open(&kind, &run), open(&kind, &run)];
    let joined = join_all(agents);
    let mut ranks: Vec<u32> = joined.iter().map(|(_, a)| a.node_rank).collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2]);
    let round = joined[0].1.round;
    assert!(
        joined
            .iter()
            .all(|(_, a)| a.round == round && a.nnodes == 3 && a.world_size == 3)
    );

    // One agent leaves (keep the host of a c10d store: it is agent 0).
    let mut agents: Vec<Rendezvous> = joined.into_iter().map(|(r, _)| r).collect();
    let leaver = agents.pop().unwrap();
    drop(leaver);
    for a in agents.iter_mut() {
        testkit::eventually(
            "the survivors to see the round end",
            Duration::from_secs(10),
            || matches!(a.watch().expect("watch"), Watch::Restart(_)),
        );
    }
    let joined = join_all(agents);
    assert!(joined.iter().all(|(_, a)| a.nnodes == 2 && a.round > round));

    // The job ends; a late agent is told so while the job's agents live.
    let mut agents: Vec<Rendezvous> = joined.into_iter().map(|(r, _)| r).collect();
    agents[1].close(true, None).unwrap();
    let mut late = open(&kind, &run);
    match late.join(&|| false, &mut |_| {}).unwrap() {
        Joined::Closed(c) => assert!(c.succeeded),
        other => panic!("a finished job must say so, got {other:?}"),
    }
    assert!(matches!(agents[0].watch().unwrap(), Watch::Closed(_)));
    drop(late);
    if matches!(kind, BackendKind::Etcd { .. }) {
        // The store outlives the job: once its agents are gone, the run id is free again.
        drop(agents);
        let (a, b) = (open(&kind, &run), open(&kind, &run));
        let again = join_all(vec![a, b]);
        assert!(
            again.iter().all(|(_, x)| x.nnodes == 2),
            "a reused run id starts a new job"
        );
    }
}

fn rand_suffix() -> u32 {
    std::process::id()
        ^ (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos())
}

#[test]
fn c10d_rounds_losses_and_the_end_of_the_job() {
    let port = testkit::free_port();
    scenario(BackendKind::C10d {
        host: "127.0.0.1".into(),
        port,
    });
}

#[test]
fn etcd_rounds_losses_the_end_of_the_job_and_a_reused_run_id() {
    let etcd = testkit::EtcdServer::start();
    scenario(BackendKind::Etcd { url: etcd.url() });
}

#[test]
fn a_join_that_cannot_complete_times_out_with_what_to_do() {
    let port = testkit::free_port();
    let kind = BackendKind::C10d {
        host: "127.0.0.1".into(),
        port,
    };
    let mut cfg = config("lonely");
    cfg.join_timeout = Duration::from_millis(500);
    let mut r = Rendezvous::open(cfg, &kind, 1, None).unwrap();
    let err = r.join(&|| false, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("1 of at least 2 node(s) joined"), "{err}");
    assert!(err.contains("--rdzv-endpoint"), "{err}");
}

/// A store that closes the connection before answering (a job's store as its host shuts
/// down) is waited on like a store not there yet, not named a foreign program: here the
/// endpoint's first two connections are dropped unanswered, then a store is hosted there and
/// the agent joins it.
#[test]
fn a_store_that_closes_before_answering_is_waited_for_not_called_foreign() {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut cfg = config("closing");
    cfg.is_host = Some(false);
    cfg.token = "t".into();
    let (run_id, token) = (cfg.run_id.clone(), cfg.token.clone());
    let kind = BackendKind::C10d {
        host: "127.0.0.1".into(),
        port: addr.port(),
    };
    let agent = std::thread::spawn(move || Rendezvous::open(cfg, &kind, 1, None).map(|_| ()));
    // The next connection within 10 s; none when the agent gave up.
    let accept = || {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match listener.accept() {
                Ok((stream, _)) => break Some(stream),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(_) => break None,
            }
        }
    };
    // One closed after its hello is read (end of stream), one reset (its hello unread).
    if let Some(mut first) = accept() {
        first.set_nonblocking(false).unwrap();
        let _ = first.read(&mut [0u8; 64]);
        drop(first);
        if let Some(second) = accept() {
            std::thread::sleep(Duration::from_millis(100));
            drop(second);
        }
    }
    drop(listener);
    let _server = collective::store::StoreServer::bind(addr, &run_id, &token).unwrap();
    if let Err(e) = agent.join().unwrap() {
        panic!("the agent gave up on a store that was closing: {e}");
    }
}

#[test]
fn a_garbage_record_is_refused_not_trusted() {
    let etcd = testkit::EtcdServer::start();
    let http = reqwest::blocking::Client::new();
    use base64::Engine;
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    http.post(format!("{}/v3/kv/put", etcd.url()))
        .body(format!(
            r#"{{"key":"{}","value":"{}"}}"#,
            b64(b"/trainctl/junk/state"),
            b64(b"\x00\xffnot json")
        ))
        .send()
        .unwrap()
        .error_for_status()
        .unwrap();
    let mut r = Rendezvous::open(
        config("junk"),
        &BackendKind::Etcd { url: etcd.url() },
        1,
        None,
    )
    .unwrap();
    let err = r.watch().unwrap_err().to_string();
    assert!(
        err.contains("/trainctl/junk/state is not a trainctl record"),
        "{err}"
    );
}

/// Waits up to 10 s for `done`, failing with `what`.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The etcd backend reads from a copy its watch keeps current: another agent's write and
/// liveness reach it, a wait for a change wakes on one, and after etcd restarts (the stream
/// ends) the copy is read afresh and follows the writes made since.
#[test]
fn the_etcd_mirror_follows_writes_wakes_waits_and_recovers_after_a_restart() {
    use rendezvous::backend::{Backend, Etcd};
    use rendezvous::state::State;
    let mut etcd = testkit::EtcdServer::start();
    let run = format!("mirror{}", rand_suffix());
    let timeout = Duration::from_secs(2);
    let mut writer = Etcd::open(&etcd.url(), &run, timeout).unwrap();
    let mut reader = Etcd::open(&etcd.url(), &run, timeout).unwrap();
    assert!(reader.read().unwrap().state.is_none());
    let record = |round| State {
        round,
        ..State::default()
    };
    // Let the watch start and read its first copy, then read from it: a wait now returns on
    // a change only.
    std::thread::sleep(Duration::from_millis(500));
    reader.read().unwrap();
    // A write by another agent wakes the reader's wait at once (without the watch it would
    // wait its whole 5 s).
    let woke = std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let started = std::time::Instant::now();
            reader.wait_change(Duration::from_secs(5));
            started.elapsed()
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(writer.write(None, &record(1)).unwrap());
        waiting.join().unwrap()
    });
    assert!(
        woke >= Duration::from_millis(250) && woke < Duration::from_secs(4),
        "the wait woke after {woke:?}, not when the record was written (0.3 s)"
    );
    eventually("the reader to see round 1", || {
        reader.read().unwrap().state.map(|s| s.round) == Some(1)
    });
    // Liveness: the writer's lease key reaches the reader's copy, and goes when revoked.
    writer.heartbeat("node-w", Duration::from_secs(5)).unwrap();
    eventually("node-w alive", || {
        reader.alive().unwrap().contains("node-w")
    });
    // etcd restarts (its data kept): the watch ends, the copy is read afresh, and a write made
    // after the restart reaches the reader.
    etcd.restart(Duration::from_millis(300));
    eventually("a write after the restart", || {
        let read = writer.read();
        matches!(read, Ok(r) if r.state.as_ref().is_some_and(|s| s.round == 1)
            && writer.write(r.token.as_deref(), &record(2)).unwrap_or(false))
            || writer
                .read()
                .is_ok_and(|r| r.state.is_some_and(|s| s.round == 2))
    });
    eventually("the reader to see round 2", || {
        reader
            .read()
            .is_ok_and(|r| r.state.is_some_and(|s| s.round == 2))
    });
    writer.forget("node-w").unwrap();
    eventually("node-w gone", || {
        reader.alive().is_ok_and(|a| !a.contains("node-w"))
    });
}
