//! The GEMM with its inputs in bf16: `C (+)= A · B` where A's and B's elements are rounded to
//! bf16 (to nearest, ties to even, as `vcvtne2ps2bf16` rounds) and the products are summed in
//! f32 by AVX512_BF16's `vdpbf16ps`, which multiplies two pairs of bf16 and adds both products
//! to an f32 lane: twice the multiply-adds per instruction of an f32 FMA. What PyTorch's CPU
//! autocast does to a convolution's or a linear layer's inputs (through oneDNN).
//!
//! Layout. The inner dimension `k` goes in pairs (an odd `k` gets a zero pair half):
//! - A (`m × k`) becomes `m × ⌈k/2⌉` pairs, each a `u32` holding `(A[i][2p], A[i][2p+1])`, the
//!   first in the low half. A row-major A keeps its rows (a row converted to bf16 *is* its
//!   pairs); any other A is packed pair-major (`[p][i]`), so that the kernel's rows for one pair
//!   are adjacent. The kernel broadcasts one pair per row and step.
//! - B (`k × n`) becomes panels of [`NR`] columns, `[panel][p][NR]` pairs
//!   `(B[2p][j], B[2p+1][j])`, unspecified beyond the last column (the kernel computes those
//!   lanes and never stores them).
//!
//! The microkernel keeps an `MR × NR` block of C in 24 of the 32 AVX-512 registers (`MR` = 12
//! rows, `NR` = 32 columns, two registers a row) and runs through [`KC_PAIRS`] pairs of `k` at a
//! time, so that its B panel (`KC_PAIRS · NR` pairs, 32 KiB, this machine's L1) stays in cache
//! while it walks A's rows. Each element of C is summed in one fixed order (pair by pair within
//! a block, blocks in order added to C) fixed by the shape: the result does not depend on the
//! thread count.

mod convert;
mod driver;
mod microkernel;
mod pack_a;
mod pack_b;
#[cfg(test)]
mod tests;

pub(in crate::matmul) use driver::gemm;
pub(in crate::matmul) use pack_a::{PackedA, pack_lhs};
pub use pack_b::{PackedB, PanelView};

/// Columns of C a microkernel call computes: two AVX-512 registers of f32.
pub(crate) const NR: usize = 32;
/// Rows of C a microkernel call computes.
pub(crate) const MR: usize = 12;
/// Pairs of `k` a microkernel call runs through before writing C.
const KC_PAIRS: usize = 256;

/// Whether this CPU runs the bf16 GEMM (AVX512_BF16, with the AVX-512 foundation and byte/word
/// instructions it uses around it).
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

/// Rounds `v` to bf16 (nearest, ties to even; a NaN stays a NaN) as `vcvtne2ps2bf16` does.
pub fn round(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// `(lo, hi)` rounded to bf16 and paired in one `u32`, `lo` in the low half.
fn pair(lo: f32, hi: f32) -> u32 {
    round(lo) as u32 | (round(hi) as u32) << 16
}
