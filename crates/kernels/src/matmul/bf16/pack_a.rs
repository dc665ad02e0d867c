//! A, the left-hand side, in pairs of `k`: a row-major A row by row, any other pair-major.

use super::super::Mat;
use super::convert::{as_u32_mut, convert_row, interleave};
use super::{available, pair};
use crate::scratch::{Scratch, scratch};

/// A's pairs and how to find pair `p` of row `i`: at `i * row_stride + p * pair_stride`.
pub(in crate::matmul) struct PackedA {
    pub(super) pairs: Scratch,
    pub(super) row_stride: usize,
    pub(super) pair_stride: usize,
}

/// A in pairs: a row-major A row by row, any other pair-major.
///
/// # Safety
/// Needs the features [`available`] checks.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)] // so that a profile shows the packing apart from the products
pub(super) unsafe fn pack_a(a: Mat) -> PackedA {
    let (m, k) = (a.rows, a.cols);
    let k2 = k.div_ceil(2);
    // Every pair is written below: a scratch buffer, neither allocated nor zeroed per product.
    let mut buf = scratch(m * k2);
    let pairs = as_u32_mut(&mut buf);
    if a.col_stride == 1 {
        for (i, out) in pairs.chunks_exact_mut(k2).enumerate() {
            convert_row(&a.data[i * a.row_stride..][..k], out);
        }
        return PackedA {
            pairs: buf,
            row_stride: k2,
            pair_stride: 1,
        };
    }
    let at = |i: usize, p: usize| a.data.get(i * a.row_stride + p * a.col_stride).copied();
    for p in 0..k2 {
        let out = &mut pairs[p * m..(p + 1) * m];
        if a.row_stride == 1 && 2 * p + 1 < k {
            // Both halves are runs of A's transpose: interleave them 16 rows at a time.
            let lo = &a.data[2 * p * a.col_stride..][..m];
            let hi = &a.data[(2 * p + 1) * a.col_stride..][..m];
            interleave(lo, hi, out);
        } else {
            for (i, o) in out.iter_mut().enumerate() {
                let lo = at(i, 2 * p).unwrap_or(0.0);
                let hi = if 2 * p + 1 < k {
                    at(i, 2 * p + 1).unwrap_or(0.0)
                } else {
                    0.0
                };
                *o = pair(lo, hi);
            }
        }
    }
    PackedA {
        pairs: buf,
        row_stride: 1,
        pair_stride: m,
    }
}

/// A (`m × k`, any strides) in pairs, once for the many products that read all of it (the
/// bands of columns of one product, `crate::matmul::par_matmul`).
///
/// Panics unless [`available`].
pub(in crate::matmul) fn pack_lhs(a: Mat) -> PackedA {
    assert!(available(), "bf16 packing on a CPU without AVX512_BF16");
    // SAFETY: the features were checked.
    unsafe { pack_a(a) }
}
