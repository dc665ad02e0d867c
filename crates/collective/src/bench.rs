//! The collective's benchmark behind `trainctl bench`: the ring all-reduce across threads on
//! loopback, against a plain loopback TCP copy (the ceiling the ring works under).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use crate::{CollectiveError, ProcessGroup, World};

#[derive(Debug, Clone, serde::Serialize)]
pub struct AllReduceTimes {
    pub ranks: usize,
    pub floats: usize,
    pub repeats: usize,
    pub median_s: f64,
    /// NCCL's bus bandwidth: 2(n-1)/n · bytes / time, comparable across world sizes.
    pub bus_gbytes_per_s: f64,
}

/// Times the ring all-reduce of `floats` values across `ranks` threads on 127.0.0.1.
pub fn all_reduce(
    ranks: usize,
    floats: usize,
    repeats: usize,
) -> Result<AllReduceTimes, CollectiveError> {
    let rank0 = on_threads(ranks, move |group| {
        let mut buf = vec![1.0f32; floats];
        let mut times = Vec::new();
        for _ in 0..repeats + 1 {
            group.barrier()?;
            let t = Instant::now();
            group.all_reduce_sum(&mut buf)?;
            times.push(t.elapsed().as_secs_f64());
        }
        Ok(times[1..].to_vec())
    })?;
    let median_s = median(rank0);
    let bytes = (floats * 4) as f64;
    Ok(AllReduceTimes {
        ranks,
        floats,
        repeats,
        median_s,
        bus_gbytes_per_s: 2.0 * (ranks as f64 - 1.0) / ranks as f64 * bytes / median_s / 1e9,
    })
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BroadcastTimes {
    pub ranks: usize,
    pub bytes: usize,
    pub repeats: usize,
    /// From the start (all ranks past a barrier) until the last rank holds every byte.
    pub median_s: f64,
    pub gbytes_per_s: f64,
}

/// Times the broadcast of `bytes` from rank 0 (a joiner's state stream) across `ranks` threads
/// on 127.0.0.1: the time until the last rank has it all.
pub fn broadcast(
    ranks: usize,
    bytes: usize,
    repeats: usize,
) -> Result<BroadcastTimes, CollectiveError> {
    let rank0 = on_threads(ranks, move |group| {
        let mut buf = vec![group.rank() as u8; bytes];
        let mut times = Vec::new();
        for _ in 0..repeats + 1 {
            group.barrier()?;
            let t = Instant::now();
            group.broadcast_bytes(&mut buf, 0)?;
            let mine = t.elapsed().as_secs_f64();
            // The slowest rank's time, known to all.
            let all = group.all_gather_u64((mine * 1e9) as u64)?;
            times.push(all.into_iter().max().unwrap_or(0) as f64 / 1e9);
        }
        Ok(times[1..].to_vec())
    })?;
    let median_s = median(rank0);
    Ok(BroadcastTimes {
        ranks,
        bytes,
        repeats,
        median_s,
        gbytes_per_s: bytes as f64 / median_s / 1e9,
    })
}

/// Runs `timed` on `ranks` threads, each a rank of one group on 127.0.0.1; returns rank 0's
/// times.
fn on_threads(
    ranks: usize,
    timed: impl Fn(&mut ProcessGroup) -> Result<Vec<f64>, CollectiveError> + Clone + Send + 'static,
) -> Result<Vec<f64>, CollectiveError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let handles: Vec<_> = (0..ranks)
        .map(|rank| {
            let timed = timed.clone();
            std::thread::spawn(move || -> Result<Vec<f64>, CollectiveError> {
                let world = World::loopback(rank as u32, ranks as u32, port, "bench");
                timed(&mut ProcessGroup::join(&world)?)
            })
        })
        .collect();
    let mut rank0 = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let times = h
            .join()
            .map_err(|_| CollectiveError::PeerLost("a bench rank panicked".into()))??;
        if i == 0 {
            rank0 = times;
        }
    }
    Ok(rank0)
}

/// GB/s of a plain copy of `bytes` through one loopback TCP connection: the ceiling the ring
/// works under on this machine.
pub fn loopback_copy(bytes: usize, repeats: usize) -> std::io::Result<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..repeats + 1 {
            s.read_exact(&mut buf)?;
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let buf = vec![7u8; bytes];
    let mut times = Vec::new();
    let mut ack = [0u8; 1];
    for _ in 0..repeats + 1 {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut ack)?;
        times.push(t.elapsed());
    }
    reader
        .join()
        .map_err(|_| std::io::Error::other("reader panicked"))??;
    let t = median(times[1..].iter().map(Duration::as_secs_f64).collect());
    Ok(bytes as f64 / t / 1e9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
