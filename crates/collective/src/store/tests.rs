//! The store over real TCP on 127.0.0.1.

use std::time::{Duration, Instant};

use super::*;
use crate::CollectiveError;
use crate::wire::{Hello, Role};
use proptest::prelude::*;

fn hello(token: &str) -> Hello {
    Hello {
        role: Role::StoreClient,
        run_id: "r".into(),
        token: token.into(),
        rank: 1,
    }
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (".{0,20}", proptest::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(key, value)| Request::Set { key, value }),
        (".{0,20}", any::<u64>()).prop_map(|(key, timeout_ms)| Request::Get { key, timeout_ms }),
        (".{0,20}", any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        (proptest::collection::vec(".{0,10}", 0..5), any::<u64>())
            .prop_map(|(keys, timeout_ms)| Request::Wait { keys, timeout_ms }),
        (
            ".{0,20}",
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..32)),
            proptest::collection::vec(any::<u8>(), 0..32)
        )
            .prop_map(|(key, expected, value)| Request::CompareSet {
                key,
                expected,
                value
            }),
        ".{0,20}".prop_map(|key| Request::TryGet { key }),
        (".{0,20}", any::<u64>()).prop_map(|(key, ttl_ms)| Request::Heartbeat { key, ttl_ms }),
        (".{0,20}", proptest::option::of(any::<u64>()))
            .prop_map(|(prefix, known)| Request::Alive { prefix, known }),
        ".{0,20}".prop_map(|key| Request::Forget { key }),
        ".{0,20}".prop_map(|prefix| Request::Scan { prefix }),
        (".{0,20}", any::<u64>(), any::<u64>()).prop_map(|(key, known, timeout_ms)| {
            Request::GetChanged {
                key,
                known,
                timeout_ms,
            }
        }),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        Just(Response::Done),
        Just(Response::TimedOut),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Response::Value),
        any::<i64>().prop_map(Response::Counter),
        (
            any::<bool>(),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..32))
        )
            .prop_map(|(swapped, current)| Response::Swapped { swapped, current }),
        proptest::option::of(proptest::collection::vec(any::<u8>(), 0..32))
            .prop_map(Response::Maybe),
        proptest::collection::vec(".{0,10}", 0..5).prop_map(Response::Keys),
        proptest::collection::vec(
            (".{0,10}", proptest::collection::vec(any::<u8>(), 0..16)),
            0..5
        )
        .prop_map(Response::Pairs),
    ]
}

proptest! {
    #[test]
    fn requests_round_trip(req in request()) {
        prop_assert_eq!(Request::decode(&req.encode()).unwrap(), req);
    }

    #[test]
    fn responses_round_trip(resp in response()) {
        prop_assert_eq!(Response::decode(&resp.encode()).unwrap(), resp);
    }

    #[test]
    fn garbage_requests_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
        let _ = Request::decode(&bytes);
        let _ = Response::decode(&bytes);
    }
}

#[test]
fn set_get_add_wait_across_clients() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let port = server.local_addr().port();
    let mut a =
        StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
    let mut b =
        StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
    let waiter = std::thread::spawn(move || {
        b.wait(&["k"]).unwrap();
        b.get("k").unwrap()
    });
    a.set("k", b"v").unwrap();
    assert_eq!(waiter.join().unwrap(), b"v");
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert_eq!(a.add("n", 3).unwrap(), 5);
}

#[test]
fn compare_set_writes_only_over_the_expected_value() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let port = server.local_addr().port();
    let mut c =
        StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
    assert_eq!(c.try_get("k").unwrap(), None);
    assert_eq!(
        c.compare_set("k", None, b"1").unwrap(),
        (true, Some(b"1".to_vec()))
    );
    assert_eq!(
        c.compare_set("k", None, b"2").unwrap(),
        (false, Some(b"1".to_vec())),
        "an absent expectation fails once the key exists"
    );
    assert_eq!(
        c.compare_set("k", Some(b"0"), b"2").unwrap(),
        (false, Some(b"1".to_vec()))
    );
    assert_eq!(
        c.compare_set("k", Some(b"1"), b"2").unwrap(),
        (true, Some(b"2".to_vec()))
    );
    assert_eq!(c.try_get("k").unwrap(), Some(b"2".to_vec()));
}

#[test]
fn liveness_keys_expire_and_die_with_their_connection() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let port = server.local_addr().port();
    let connect =
        || StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
    let (mut watcher, mut a, mut b) = (connect(), connect(), connect());
    a.heartbeat("alive/a", Duration::from_secs(60)).unwrap();
    b.heartbeat("alive/b", Duration::from_millis(200)).unwrap();
    watcher
        .heartbeat("other/w", Duration::from_secs(60))
        .unwrap();
    assert_eq!(watcher.alive("alive/").unwrap(), ["alive/a", "alive/b"]);
    // b stops beating: gone after its TTL.
    let deadline = Instant::now() + Duration::from_secs(5);
    while watcher.alive("alive/").unwrap() != ["alive/a"] {
        assert!(Instant::now() < deadline, "alive/b never expired");
        std::thread::sleep(Duration::from_millis(20));
    }
    // a's connection closes (its process died): gone without waiting for the TTL.
    drop(a);
    while !watcher.alive("alive/").unwrap().is_empty() {
        assert!(Instant::now() < deadline, "alive/a outlived its connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    b.heartbeat("alive/b", Duration::from_secs(60)).unwrap();
    b.forget("alive/b").unwrap();
    assert!(watcher.alive("alive/").unwrap().is_empty());
}

#[test]
fn get_of_a_missing_key_times_out() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let mut c = StoreClient::connect(
        "127.0.0.1",
        server.local_addr().port(),
        &hello("t"),
        Duration::from_millis(700),
    )
    .unwrap();
    let err = c.get("never").unwrap_err();
    assert!(matches!(err, CollectiveError::Timeout { .. }), "{err}");
}

#[test]
fn wrong_token_is_refused() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let err = StoreClient::connect(
        "127.0.0.1",
        server.local_addr().port(),
        &hello("wrong"),
        Duration::from_secs(5),
    )
    .err()
    .expect("a wrong token must be refused");
    assert!(err.to_string().contains("job token mismatch"), "{err}");
}

#[test]
fn polls_of_an_unchanged_value_or_key_set_answer_without_it_and_a_change_wakes_them() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let port = server.local_addr().port();
    let connect =
        || StoreClient::connect("127.0.0.1", port, &hello("t"), Duration::from_secs(5)).unwrap();
    let (mut a, mut b) = (connect(), connect());
    // Absent and unchanged: nothing new.
    let absent = super::fingerprint(None);
    assert_eq!(a.get_changed("k", absent, Duration::ZERO).unwrap(), None);
    // Another fingerprint: the value now, absent included.
    assert_eq!(a.get_changed("k", 7, Duration::ZERO).unwrap(), Some(None));
    // A waiting poll returns as soon as the value changes, with it.
    let waiter = std::thread::spawn(move || {
        let started = Instant::now();
        let got = b.get_changed("k", absent, Duration::from_secs(4)).unwrap();
        (got, started.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    a.set("k", b"v1").unwrap();
    let (got, waited) = waiter.join().unwrap();
    assert_eq!(got, Some(Some(b"v1".to_vec())));
    assert!(waited < Duration::from_secs(3), "woke after {waited:?}");
    let v1 = super::fingerprint(Some(b"v1"));
    assert_eq!(
        a.get_changed("k", v1, Duration::from_millis(50)).unwrap(),
        None
    );
    // Liveness keys: the set, then nothing while it stays the same, then the new set.
    a.heartbeat("alive/a", Duration::from_secs(60)).unwrap();
    let keys = a.alive_changed("alive/", &[]).unwrap().unwrap();
    assert_eq!(keys, ["alive/a"]);
    assert_eq!(a.alive_changed("alive/", &keys).unwrap(), None);
    let mut c = connect();
    c.heartbeat("alive/c", Duration::from_secs(60)).unwrap();
    assert_eq!(
        a.alive_changed("alive/", &keys).unwrap().unwrap(),
        ["alive/a", "alive/c"]
    );
}

#[test]
fn scan_lists_the_keys_under_a_prefix_with_their_values() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "r", "t").unwrap();
    let mut c = StoreClient::connect(
        "127.0.0.1",
        server.local_addr().port(),
        &hello("t"),
        Duration::from_secs(5),
    )
    .unwrap();
    c.set("w/2/b", b"B").unwrap();
    c.set("w/2/a", b"A").unwrap();
    c.set("w/3/c", b"C").unwrap();
    assert_eq!(
        c.scan("w/2/").unwrap(),
        [
            ("w/2/a".to_string(), b"A".to_vec()),
            ("w/2/b".to_string(), b"B".to_vec())
        ]
    );
    assert!(c.scan("none/").unwrap().is_empty());
}
