//! Scratch buffers (im2col matrices, transformed tiles, masked gradients) reused across calls
//! and steps: after the first step a training step allocates none of them, so no time goes to
//! the kernel zeroing fresh pages.
//!
//! A process-wide pool rather than per-thread buffers: a kernel holding its scratch may wait in
//! a rayon join, during which its thread runs other chunks that need scratch of their own.

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use rayon::prelude::*;

/// Buffers kept for reuse; more than the live ones of any step of the models trained here.
const KEPT: usize = 32;

/// Buffers not on loan.
struct Pool(Mutex<Vec<Vec<f32>>>);

/// The kernels' pool (tests lend from pools of their own, which no other test touches).
static POOL: Pool = Pool::new();

/// A buffer of `f32`s on loan from a pool (contents unspecified), returned on drop: the first
/// `len` elements of a vector whose own length is every element it ever initialised, so that a
/// loan only zeroes memory no earlier loan has written (zeroing a reused buffer on every loan
/// was a serial memset of each im2col matrix and masked gradient).
pub(crate) struct Scratch {
    buf: Vec<f32>,
    len: usize,
    pool: &'static Pool,
}

/// A buffer of `len` elements from the kernels' pool.
pub(crate) fn scratch(len: usize) -> Scratch {
    POOL.lend(len)
}

impl Pool {
    const fn new() -> Pool {
        Pool(Mutex::new(Vec::new()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Vec<f32>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The smallest kept buffer that holds `len` elements, else a new one.
    fn lend(&'static self, len: usize) -> Scratch {
        let mut pool = self.lock();
        let fit = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let mut buf = match fit {
            Some(i) => pool.swap_remove(i),
            // None fits: grow the largest rather than keep it beside a new one.
            None => match (0..pool.len()).max_by_key(|&i| pool[i].capacity()) {
                Some(i) => pool.swap_remove(i),
                None => Vec::new(),
            },
        };
        drop(pool);
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        Scratch {
            buf,
            len,
            pool: self,
        }
    }
}

impl Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut pool = self.pool.lock();
        if pool.len() < KEPT {
            pool.push(buf);
        } else if let Some(i) = (0..pool.len()).min_by_key(|&i| pool[i].capacity())
            && pool[i].capacity() < buf.capacity()
        {
            pool[i] = buf;
        }
    }
}

/// Elements from which [`zeros`] fills on rayon's threads (about 0.1 ms of one core's memset).
const PARALLEL_ZEROS: usize = 1 << 18;

/// A new vector of `len` zeros, zeroed on rayon's threads when it is large: a kernel's output
/// (an activation, its gradient, a weight's) is zeroed by the allocator in one serial memset
/// otherwise, during which the other threads wait.
pub(crate) fn zeros(len: usize) -> Vec<f32> {
    if len < PARALLEL_ZEROS {
        return vec![0.0; len];
    }
    let mut v = Vec::with_capacity(len);
    v.par_extend(rayon::iter::repeat_n(0.0f32, len));
    v
}

/// A new vector of `len` elements made by `fill`, called on rayon's threads with each run of
/// `chunk` elements (the last one shorter) and its index, to write all of it. Each run is zeroed
/// first by the thread that fills it, just before, while it is in cache: a kernel's output
/// zeroed whole ahead of the kernel went out to memory and came back (about 240 MB a resnet18
/// step at batch 32, on a core that streams 11–17 GB/s). The zeros are what `fill` finds where
/// it writes nothing.
pub(crate) fn par_filled(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(i, run)| {
            run.fill(std::mem::MaybeUninit::new(0.0));
            // SAFETY: every element of `run` was initialised on the line above.
            fill(i, unsafe { run.assume_init_mut() });
        });
    // SAFETY: the runs cover the first `len` elements, within the capacity, and each was
    // initialised (had `fill` panicked, the panic would have left before this line).
    unsafe { v.set_len(len) };
    v
}

/// [`par_filled`] without the zeros, for a `fill` that writes every element of its run (each
/// run lies whole in one of `fill`'s passes: batch norm's, element by element). The zeroing
/// pass, in cache as it is, cost batch norm about 2 ms of a 320 ms resnet50 step at 1 thread.
///
/// # Safety
/// `fill` must initialise every element of the run it is given: the vector is handed out as
/// written.
pub(crate) unsafe fn par_written(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync + Send,
) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(i, run)| fill(i, run));
    // SAFETY: the runs cover the first `len` elements, within the capacity, and the caller
    // vouches that `fill` initialised each (had it panicked, the panic would have left first).
    unsafe { v.set_len(len) };
    v
}

/// [`par_written`] for two vectors of `len` elements each (of any types: batch norm's input
/// gradient and its residual's, or its output and its ReLU's mask) that `fill` writes run by
/// run together.
///
/// # Safety
/// `fill` must initialise every element of both runs it is given.
pub(crate) unsafe fn par_written_pair<A: Send, B: Send>(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<A>], &mut [MaybeUninit<B>]) + Sync + Send,
) -> (Vec<A>, Vec<B>) {
    let (mut a, mut b) = (Vec::with_capacity(len), Vec::with_capacity(len));
    a.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .zip(b.spare_capacity_mut()[..len].par_chunks_mut(chunk.max(1)))
        .enumerate()
        .for_each(|(i, (ra, rb))| fill(i, ra, rb));
    // SAFETY: as in `par_written`, for each of the two.
    unsafe {
        a.set_len(len);
        b.set_len(len);
    }
    (a, b)
}

/// Runs `f` with three scratch buffers of `sizes` elements (contents unspecified).
pub(crate) fn with_scratch<R>(
    sizes: [usize; 3],
    f: impl FnOnce(&mut [f32], &mut [f32], &mut [f32]) -> R,
) -> R {
    let [mut a, mut b, mut c] = sizes.map(scratch);
    f(&mut a, &mut b, &mut c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_buffer_is_lent_again_and_resized() {
        static OWN: Pool = Pool::new();
        let first = {
            let mut s = OWN.lend(1000);
            s[999] = 7.0;
            s.as_ptr()
        };
        let again = OWN.lend(10);
        assert_eq!(again.len(), 10);
        assert_eq!(again.as_ptr(), first, "the buffer was not reused");
        let beside = OWN.lend(10);
        assert_ne!(beside.as_ptr(), first, "a buffer on loan was lent twice");
    }

    #[test]
    fn a_loan_zeroes_only_what_no_earlier_loan_wrote() {
        static OWN: Pool = Pool::new();
        let first = {
            let mut s = OWN.lend(3000);
            s.fill(7.0);
            s.as_ptr()
        };
        // A shorter loan, then a longer one within what the first wrote: no zeroing either time.
        assert_eq!(OWN.lend(1000).as_ptr(), first, "not reused");
        let longer = OWN.lend(2000);
        assert_eq!(longer.as_ptr(), first, "not reused");
        assert!(
            longer.iter().all(|&v| v == 7.0),
            "a reused buffer was zeroed again"
        );
        // Beyond what was ever written, a loan reads zeros.
        let grown = {
            drop(longer);
            OWN.lend(4000)
        };
        assert!(grown[3000..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn large_zeros_are_zeros() {
        let len = PARALLEL_ZEROS * 3 + 5;
        let v = zeros(len);
        assert_eq!(v.len(), len);
        assert!(v.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn a_filled_vector_holds_what_each_run_wrote_and_zeros_elsewhere() {
        let len = 10_007;
        let v = par_filled(len, 1000, |i, run| {
            assert!(run.iter().all(|&x| x == 0.0), "run {i} handed over zeroed");
            assert_eq!(run.len(), if i == 10 { 7 } else { 1000 });
            // Every run writes all but its last element.
            let written = run.len() - 1;
            for (j, x) in run.iter_mut().enumerate().take(written) {
                *x = (i * 1000 + j) as f32 + 1.0;
            }
        });
        assert_eq!(v.len(), len);
        for (at, x) in v.iter().enumerate() {
            let last_of_run = at % 1000 == 999 || at == len - 1;
            let want = if last_of_run { 0.0 } else { at as f32 + 1.0 };
            assert_eq!(*x, want, "element {at}");
        }
    }

    #[test]
    fn nested_loans_on_one_thread_are_distinct() {
        // (Per-thread buffers would be lent twice here, or refused.)
        with_scratch([4, 4, 4], |a, b, c| {
            with_scratch([4, 0, 0], |d, _, _| {
                for (i, buf) in [&mut *a, &mut *b, &mut *c, &mut *d].into_iter().enumerate() {
                    buf.fill(i as f32);
                }
                assert_eq!([a[0], b[0], c[0], d[0]], [0.0, 1.0, 2.0, 3.0]);
            });
        });
    }
}
