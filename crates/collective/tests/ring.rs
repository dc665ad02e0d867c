//! Collectives across real TCP connections on 127.0.0.1, one thread per rank.

use std::time::{Duration, Instant};

use collective::{CollectiveError, ProcessGroup, World};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn world(rank: u32, n: u32, port: u16, token: &str, timeout: Duration) -> World {
    World {
        rank,
        world_size: n,
        local_rank: rank,
        local_world_size: n,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        run_id: "ring-test".into(),
        token: token.into(),
        timeout,
        ..World::single()
    }
}

/// Runs `f` on `n` ranks in threads and returns their results in rank order.
fn on_ranks<T: Send + 'static>(
    n: u32,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let group =
                    ProcessGroup::join(&world(rank, n, port, "tok", Duration::from_secs(20)))
                        .expect("join");
                f(group)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 101) as f32 - 50.0)
        .collect()
}

#[test]
fn all_reduce_matches_a_serial_sum_for_1_to_5_ranks() {
    // Lengths that do not divide evenly, shorter than the world, and longer than a segment.
    for n in 1..=5u32 {
        for len in [1usize, 3, 10, 1000, 200_003] {
            let results = on_ranks(n, move |mut g| {
                let mut buf = input(g.rank(), len);
                g.all_reduce_sum(&mut buf).unwrap();
                buf
            });
            let inputs: Vec<Vec<f32>> = (0..n as usize).map(|r| input(r, len)).collect();
            let expected: Vec<f32> = (0..len)
                .map(|i| inputs.iter().map(|x| x[i]).sum())
                .collect();
            for (rank, got) in results.iter().enumerate() {
                assert_eq!(got, &expected, "world {n}, len {len}, rank {rank}");
            }
        }
    }
}

#[test]
fn broadcast_copies_the_root_buffer() {
    for n in [2u32, 3, 4] {
        for root in 0..n as usize {
            let results = on_ranks(n, move |mut g| {
                let mut buf = input(g.rank(), 150_001);
                g.broadcast(&mut buf, root).unwrap();
                g.barrier().unwrap();
                buf
            });
            for got in &results {
                assert_eq!(got, &input(root, 150_001), "world {n}, root {root}");
            }
        }
    }
}

/// Bytes of any length (not a multiple of a float) travel exactly, across segments.
#[test]
fn broadcast_bytes_copies_the_root_bytes() {
    let bytes =
        |rank: usize| -> Vec<u8> { (0..300_001).map(|i| (i * 31 + rank * 7) as u8).collect() };
    for n in [2u32, 3] {
        let results = on_ranks(n, move |mut g| {
            let mut buf = bytes(g.rank());
            g.broadcast_bytes(&mut buf, 1).unwrap();
            g.barrier().unwrap();
            buf
        });
        for got in &results {
            assert_eq!(got, &bytes(1), "world {n}");
        }
    }
}

#[test]
fn all_gather_gives_every_rank_every_value_in_rank_order() {
    for n in [1u32, 2, 4] {
        let results = on_ranks(n, |mut g| {
            let mine = u64::MAX - g.rank() as u64 * 0x1_0000_0001;
            g.all_gather_u64(mine).unwrap()
        });
        let expected: Vec<u64> = (0..n as u64)
            .map(|r| u64::MAX - r * 0x1_0000_0001)
            .collect();
        for got in &results {
            assert_eq!(got, &expected, "world {n}");
        }
    }
}

#[test]
fn repeated_collectives_stay_in_step() {
    let results = on_ranks(3, |mut g| {
        let mut total = 0.0;
        for i in 0..50 {
            let mut buf = vec![(g.rank() + i) as f32; 17];
            g.all_reduce_mean(&mut buf).unwrap();
            total += buf[0];
        }
        total
    });
    let expected: f32 = (0..50).map(|i| (i as f32) + 1.0).sum();
    assert!(
        results.iter().all(|t| (t - expected).abs() < 1e-3),
        "{results:?}"
    );
}

#[test]
fn a_wrong_token_is_refused_with_a_clear_error() {
    let port = free_port();
    let good = std::thread::spawn(move || {
        ProcessGroup::join(&world(0, 2, port, "right", Duration::from_secs(3))).err()
    });
    let bad = ProcessGroup::join(&world(1, 2, port, "wrong", Duration::from_secs(3)))
        .err()
        .expect("a wrong token must not join");
    assert!(bad.to_string().contains("job token mismatch"), "{bad}");
    // Rank 0 never gets its peer, and says so within its timeout instead of hanging.
    assert!(good.join().unwrap().is_some());
}

#[test]
fn a_dead_peer_is_an_error_not_a_hang() {
    let port = free_port();
    let timeout = Duration::from_secs(3);
    let survivor = std::thread::spawn(move || {
        let mut g = ProcessGroup::join(&world(0, 2, port, "t", timeout)).unwrap();
        let start = Instant::now();
        let mut buf = vec![1.0f32; 1000];
        let err = g.all_reduce_sum(&mut buf).unwrap_err();
        (err, start.elapsed())
    });
    let leaver = ProcessGroup::join(&world(1, 2, port, "t", timeout)).unwrap();
    drop(leaver); // the process "dies": its sockets close
    let (err, took) = survivor.join().unwrap();
    assert!(matches!(err, CollectiveError::PeerLost(_)), "{err}");
    assert!(took < timeout * 2, "took {took:?}");
}

#[test]
fn a_silent_peer_times_out() {
    let port = free_port();
    let timeout = Duration::from_millis(1500);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let hung = std::thread::spawn(move || {
        let g = ProcessGroup::join(&world(1, 2, port, "t", timeout)).unwrap();
        let _ = rx.recv(); // holds its sockets open and never calls the collective
        drop(g);
    });
    let mut g = ProcessGroup::join(&world(0, 2, port, "t", timeout)).unwrap();
    let mut buf = vec![1.0f32; 10];
    let err = g.all_reduce_sum(&mut buf).unwrap_err();
    assert!(matches!(err, CollectiveError::Timeout { .. }), "{err}");
    tx.send(()).unwrap();
    hung.join().unwrap();
}
