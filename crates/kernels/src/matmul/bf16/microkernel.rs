//! The microkernel: one `ROWS × NR` block of C summed in registers by `vdpbf16ps`.

use std::arch::x86_64::*;

use super::NR;
use super::convert::{load16, store16};

/// One microkernel call: `ROWS` (≤ [`MR`](super::MR)) rows by up to [`NR`] columns of C.
pub(super) struct Tile<'a> {
    pub(super) a: &'a [u32],
    pub(super) a_row_stride: usize,
    pub(super) a_pair_stride: usize,
    pub(super) b: &'a [u32],
    pub(super) c: *mut f32,
    pub(super) c_stride: usize,
    pub(super) pairs: usize,
    pub(super) add: bool,
    pub(super) masks: [u16; 2],
}

impl Tile<'_> {
    /// # Safety
    /// The features [`available`](super::available) checks; `a` holds pair `pairs - 1` of row
    /// `ROWS - 1`; `b` holds `pairs · NR`; the C block (`ROWS` rows, the masks' columns) is this
    /// call's.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn run<const ROWS: usize>(&self) {
        debug_assert!(
            ROWS == 0
                || (ROWS - 1) * self.a_row_stride + (self.pairs - 1) * self.a_pair_stride
                    < self.a.len()
        );
        debug_assert!(self.b.len() >= self.pairs * NR);
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let (a, b) = (self.a.as_ptr(), self.b.as_ptr());
        // SAFETY: every read is inside `a` and `b` per the contract; C's masked accesses are
        // the block's.
        unsafe {
            for p in 0..self.pairs {
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
                let row = a.add(p * self.a_pair_stride);
                for (i, acc) in acc.iter_mut().enumerate() {
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(
                        *row.add(i * self.a_row_stride) as i32,
                    ));
                    acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                for (half, &mask) in self.masks.iter().enumerate() {
                    if mask == 0 {
                        continue;
                    }
                    let c = self.c.add(i * self.c_stride + half * 16);
                    let mut v = acc[half];
                    if self.add {
                        v = _mm512_add_ps(v, load16(c, mask));
                    }
                    store16(c, mask, v);
                }
            }
        }
    }
}
