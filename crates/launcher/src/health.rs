//! The node's health check before it joins a round: a CPU matrix multiply (0.1 s on one
//! thread) and a 32 MB loopback TCP stream (a few tens of milliseconds), compared with what the
//! nodes already in the job measured. A node far below them (under [`FAR_BELOW`] of their
//! median on either) joins with a warning, or is refused with the figures (`trainctl run
//! --health-check warn|refuse`): with `refuse`, a node that would slow every step never joins
//! a round. Warning is the default: nodes that share a machine with the job (one host, or a
//! test) measure low while the others train, and a slow node that joins is still caught by the
//! ranks' straggler watch (`--stragglers evict`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

pub use rendezvous::Health;

/// A node is far below the others under this share of their median.
pub(crate) const FAR_BELOW: f64 = 0.5;

const GEMM_N: usize = 96;
const GEMM_TIME: Duration = Duration::from_millis(100);
const LOOPBACK_BYTES: usize = 32 << 20;

/// Measures this node: the multiply on the calling thread, the stream through a listener of
/// its own on 127.0.0.1. A loopback that cannot be opened measures 0 (and is said as such).
pub fn probe() -> Health {
    Health {
        gemm_mflops: gemm_mflops(),
        loopback_mbps: loopback_mbps().unwrap_or(0),
    }
}

/// Square `GEMM_N` multiplies repeated for `GEMM_TIME`: the plain triple loop the compiler
/// vectorises, not the trainer's kernels (what matters is the same code on every node).
fn gemm_mflops() -> u64 {
    let n = GEMM_N;
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 * 0.25).collect();
    let mut c = vec![0.0f32; n * n];
    let started = Instant::now();
    let mut rounds = 0u64;
    while started.elapsed() < GEMM_TIME || rounds == 0 {
        for i in 0..n {
            let row = &mut c[i * n..(i + 1) * n];
            row.fill(0.0);
            for k in 0..n {
                let x = a[i * n + k];
                for (out, y) in row.iter_mut().zip(&b[k * n..(k + 1) * n]) {
                    *out += x * y;
                }
            }
        }
        std::hint::black_box(&mut c);
        rounds += 1;
    }
    let flops = 2.0 * (n * n * n) as f64 * rounds as f64;
    (flops / started.elapsed().as_secs_f64() / 1e6) as u64
}

fn loopback_mbps() -> std::io::Result<u64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < LOOPBACK_BYTES {
            match s.read(&mut buf)? {
                0 => break,
                n => got += n,
            }
        }
        Ok(got)
    });
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let chunk = vec![7u8; 1 << 20];
    let started = Instant::now();
    for _ in 0..LOOPBACK_BYTES / chunk.len() {
        s.write_all(&chunk)?;
    }
    drop(s);
    let got = reader
        .join()
        .map_err(|_| std::io::Error::other("the loopback reader panicked"))??;
    Ok((got as f64 / started.elapsed().as_secs_f64() / 1e6) as u64)
}

/// How this node compares with the others.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// No other node measured anything yet.
    Alone,
    Passed(String),
    /// Far below the others on at least one measure: why, with the figures.
    FarBelow(String),
}

/// `mine` against `others` (the nodes already in the job).
pub(crate) fn judge(mine: Health, others: &[Health]) -> Verdict {
    if others.is_empty() {
        return Verdict::Alone;
    }
    let median = |f: fn(&Health) -> u64| {
        let mut v: Vec<u64> = others.iter().map(f).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    let (gemm, loopback) = (median(|h| h.gemm_mflops), median(|h| h.loopback_mbps));
    let figures = format!(
        "matrix multiply {:.1} GFLOP/s against the others' median {:.1}, loopback {} MB/s against {}",
        mine.gemm_mflops as f64 / 1e3,
        gemm as f64 / 1e3,
        mine.loopback_mbps,
        loopback
    );
    let below = |m: u64, median: u64| (m as f64) < median as f64 * FAR_BELOW;
    if below(mine.gemm_mflops, gemm) || below(mine.loopback_mbps, loopback) {
        Verdict::FarBelow(figures)
    } else {
        Verdict::Passed(figures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(gemm: u64, loopback: u64) -> Health {
        Health {
            gemm_mflops: gemm,
            loopback_mbps: loopback,
        }
    }

    #[test]
    fn a_node_far_below_the_others_median_on_either_measure_is_named_with_the_figures() {
        let others = [h(40_000, 3_000), h(42_000, 3_200), h(8_000, 3_100)];
        assert!(matches!(
            judge(h(30_000, 2_000), &others),
            Verdict::Passed(_)
        ));
        let Verdict::FarBelow(why) = judge(h(12_000, 3_000), &others) else {
            panic!("a third of the others' multiply is far below");
        };
        assert!(
            why.contains("12.0 GFLOP/s against the others' median 40.0"),
            "{why}"
        );
        assert!(matches!(
            judge(h(40_000, 900), &others),
            Verdict::FarBelow(_)
        ));
        assert_eq!(judge(h(1, 1), &[]), Verdict::Alone);
    }

    #[test]
    fn the_probe_measures_something() {
        let m = probe();
        assert!(m.gemm_mflops > 0 && m.loopback_mbps > 0, "{m:?}");
    }
}
