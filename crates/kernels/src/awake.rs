//! The compute pool's threads kept awake through one step's many parallel loops.
//!
//! A rayon worker that finds no work yields 32 times, then sleeps; the next loop's work wakes it
//! (a futex and an interrupt to the other core, dearer still in a virtual machine). A training
//! step is hundreds of short loops with serial work between them, so at 2 threads a resnet18
//! step slept and woke about 170 times and its threads were busy 1.75 of 2 cores. OpenMP's
//! threads, PyTorch's, spin between loops instead. [`with_threads_awake`] does the same for the
//! length of one call: every other thread of the pool runs a loop that takes the pool's work as
//! it appears ([`rayon::yield_now`]) and spins while there is none.
//!
//! A keeper leaves when the call is done, or after [`IDLE_LIMIT`] without work: a call that
//! waits on something else does not hold a core for longer, and two calls from different
//! threads cannot hold each other up (each one's keeper may sit on the stack of the other's
//! thread; with nothing to run, it gives the thread back).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a keeper spins without finding work before it leaves its thread to rayon's own
/// sleep. Longer than the serial gaps inside a step (loss, autodiff bookkeeping: tens of µs).
pub(crate) const IDLE_LIMIT: Duration = Duration::from_millis(2);

/// Runs `f` on a thread of the current pool (rayon's global pool from outside any), the caller
/// waiting, with the pool's other threads spinning for its parallel loops' work until it
/// returns. For compute only: what `f` waits on, the other threads would spin through (up to
/// [`IDLE_LIMIT`]).
pub fn with_threads_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    with_threads_awake_counted(f).0
}

/// [`with_threads_awake`], and how many pieces of work the keepers ran (for tests).
fn with_threads_awake_counted<R: Send>(f: impl FnOnce() -> R + Send) -> (R, usize) {
    let done = AtomicBool::new(false);
    let ran = AtomicUsize::new(0);
    let result = rayon::scope(|scope| {
        let (home, done, ran) = (rayon::current_thread_index(), &done, &ran);
        // Every thread gets one; on `f`'s own thread it returns at once.
        scope.spawn_broadcast(move |_, thread| {
            if Some(thread.index()) != home {
                ran.fetch_add(keep_awake(done), Ordering::Relaxed);
            }
        });
        let result = f();
        done.store(true, Ordering::Release);
        result
    });
    (result, ran.into_inner())
}

/// Runs the pool's work as it appears until `done` or [`IDLE_LIMIT`] without any: the pieces
/// it ran.
fn keep_awake(done: &AtomicBool) -> usize {
    let mut ran = 0;
    let mut idle_since: Option<Instant> = None;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {
                ran += 1;
                idle_since = None;
            }
            Some(rayon::Yield::Idle) => {
                if idle_since.get_or_insert_with(Instant::now).elapsed() > IDLE_LIMIT {
                    break;
                }
                // To whatever else this core has to run (a data loader's thread).
                std::thread::yield_now();
            }
            None => break,
        }
    }
    ran
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::mpsc;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// Work of about `micros` µs.
    fn busy(micros: u64) -> u64 {
        let start = Instant::now();
        let mut x = 1u64;
        while start.elapsed() < Duration::from_micros(micros) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        x
    }

    /// A step's shape: parallel loops (64 pieces of 5 µs) with serial work between them,
    /// longer than rayon's 32 yields before a thread sleeps.
    fn loops(n: usize) -> u64 {
        (0..n)
            .map(|_| {
                let x: u64 = (0..64)
                    .into_par_iter()
                    .map(|_| busy(5))
                    .reduce(|| 0, u64::wrapping_add);
                x.wrapping_add(busy(300))
            })
            .fold(0, |a, b| a ^ b)
    }

    #[test]
    fn the_other_threads_run_the_loops_work_from_their_keepers() {
        let pool = pool(2);
        // Each of 50 loops hands pieces of its range to the other thread: taken by its keeper,
        // not by a thread woken from sleep. Tests running beside this one can keep the other
        // thread off the cores for a whole call: calls until one shows it, with a deadline.
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut calls, mut most) = (0, 0);
        loop {
            let (value, ran) = pool.install(|| with_threads_awake_counted(|| (7, loops(50))));
            assert_eq!(value.0, 7);
            (calls, most) = (calls + 1, most.max(ran));
            if ran >= 25 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "in {calls} calls of 50 loops each, the keeper ran at most {most} pieces of work"
            );
        }
    }

    #[test]
    fn f_runs_on_a_pool_thread_and_alone_no_keeper_runs() {
        let pool = pool(1);
        let (index, ran) = pool.install(|| with_threads_awake_counted(rayon::current_thread_index));
        assert_eq!(index, Some(0));
        assert_eq!(ran, 0);
    }

    #[test]
    fn calls_from_two_threads_at_once_both_finish() {
        // Each call's keeper can land on the other call's thread, under its stack: the idle
        // limit gives the thread back (without it the two could wait on each other for good).
        let pool = std::sync::Arc::new(pool(2));
        let (tx, rx) = mpsc::channel();
        for caller in 0..2 {
            let (pool, tx) = (pool.clone(), tx.clone());
            std::thread::spawn(move || {
                for _ in 0..20 {
                    pool.install(|| with_threads_awake(|| loops(5)));
                }
                tx.send(caller).unwrap();
            });
        }
        for _ in 0..2 {
            rx.recv_timeout(Duration::from_secs(120))
                .expect("two concurrent calls, each 20 times 5 loops, not done in 120 s");
        }
    }
}
