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

use std::arch::x86_64::*;

use super::Mat;
use crate::scratch::{Scratch, scratch};

/// Columns of C a microkernel call computes: two AVX-512 registers of f32.
pub const NR: usize = 32;
/// Rows of C a microkernel call computes.
pub const MR: usize = 12;
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

/// A's pairs and how to find pair `p` of row `i`: at `i * row_stride + p * pair_stride`.
pub(super) struct PackedA {
    pairs: Scratch,
    row_stride: usize,
    pair_stride: usize,
}

/// A in pairs: a row-major A row by row, any other pair-major.
///
/// # Safety
/// Needs the features [`available`] checks.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)] // so that a profile shows the packing apart from the products
unsafe fn pack_a(a: Mat) -> PackedA {
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
/// bands of columns of one product, `super::par_matmul`).
///
/// Panics unless [`available`].
pub(super) fn pack_lhs(a: Mat) -> PackedA {
    assert!(available(), "bf16 packing on a CPU without AVX512_BF16");
    // SAFETY: the features were checked.
    unsafe { pack_a(a) }
}

/// The index that interleaves the two halves of a 32-lane bf16 vector: lanes 0, 16, 1, 17, ...
#[target_feature(enable = "avx512f,avx512bw")]
fn interleave_index() -> __m512i {
    let idx: [u16; 32] = std::array::from_fn(|j| ((j % 2) * 16 + j / 2) as u16);
    // SAFETY: reads 64 bytes from a 64-byte array.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

/// The 16 floats at `p` under `mask` (zeros elsewhere), by a plain load when all 16 are
/// wanted: on this Zen 5 a masked load or store of memory not in cache ran at a third of a
/// plain one's rate (a conversion pass: 11.6 against 38.6 GB/s), so the masks are for the
/// ends of runs only.
///
/// # Safety
/// The masked elements of `p` must be readable.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load16(p: *const f32, mask: u16) -> __m512 {
    // SAFETY: the caller vouches for the masked elements; all 16 when the mask is full.
    unsafe {
        if mask == u16::MAX {
            _mm512_loadu_ps(p)
        } else {
            _mm512_maskz_loadu_ps(mask, p)
        }
    }
}

/// Stores the 32-bit lanes of `v` under `mask` at `p`, plainly when all 16 are (see
/// [`load16`]).
///
/// # Safety
/// The masked lanes of `p` must be writable.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store16(p: *mut f32, mask: u16, v: __m512) {
    // SAFETY: the caller vouches for the masked lanes; all 16 when the mask is full.
    unsafe {
        if mask == u16::MAX {
            _mm512_storeu_ps(p, v)
        } else {
            _mm512_mask_storeu_ps(p, mask, v)
        }
    }
}

/// `out[j] = pair(lo[j], hi[j])` for the `lo.len()` (== `hi.len()` == `out.len()`) elements.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn interleave(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    let n = out.len();
    assert!(lo.len() == n && hi.len() == n);
    let idx = interleave_index();
    let mut j = 0;
    while j < n {
        let w = (n - j).min(16);
        let mask = mask16(w);
        // SAFETY: the masked loads and store touch elements j..j + w, inside every slice.
        unsafe {
            let l = load16(lo.as_ptr().add(j), mask);
            let h = load16(hi.as_ptr().add(j), mask);
            // Lanes 0..16: lo's bf16; 16..32: hi's. Interleaved: 16 (lo, hi) pairs.
            let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
            let pairs = _mm512_permutexvar_epi16(idx, both);
            store16(
                out.as_mut_ptr().add(j).cast(),
                mask,
                _mm512_castsi512_ps(pairs),
            );
        }
        j += w;
    }
}

/// A row of `k` f32 as `⌈k/2⌉` pairs: its bf16 values in order.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn convert_row(row: &[f32], out: &mut [u32]) {
    let k = row.len();
    let mut j = 0;
    while j < k {
        let w = (k - j).min(32);
        // SAFETY: the masked loads touch row[j..j + w]; the store touches out's pairs
        // j/2..(j + w).div_ceil(2), which exist since out has ⌈k/2⌉.
        unsafe {
            let l = load16(row.as_ptr().add(j), mask16(w.min(16)));
            let h = load16(
                row.as_ptr().wrapping_add(j + 16),
                mask16(w.saturating_sub(16)),
            );
            let both: __m512 = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
            store16(
                out.as_mut_ptr().add(j / 2).cast(),
                mask16(w.div_ceil(2)),
                both,
            );
        }
        j += w;
    }
}

/// An f32 scratch buffer seen as pairs.
fn as_u32(floats: &[f32]) -> &[u32] {
    bytemuck::cast_slice(floats)
}

fn as_u32_mut(floats: &mut [f32]) -> &mut [u32] {
    bytemuck::cast_slice_mut(floats)
}

fn mask16(w: usize) -> u16 {
    if w >= 16 {
        u16::MAX
    } else {
        ((1u32 << w) - 1) as u16
    }
}

/// B as panels of [`NR`] columns, `[panel][p][NR]` pairs, unspecified beyond the last column
/// (the microkernel computes those lanes and never stores them): made once for many products
/// when B is a layer's weight ([`super::PackedRhs`]), else per product. In a scratch buffer,
/// neither allocated nor zeroed each time.
pub struct PackedB {
    panels: Scratch,
    /// Pairs in each panel: `⌈k/2⌉`.
    pairs: usize,
    cols: usize,
}

impl std::fmt::Debug for PackedB {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedB")
            .field("pairs", &self.pairs)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

/// A block of a [`PackedB`]: pairs `pair0..pair0 + pairs` of panels `panel0..`, `cols` columns.
#[derive(Clone, Copy, Debug)]
pub struct PanelView<'a> {
    b: &'a PackedB,
    pair0: usize,
    pairs: usize,
    panel0: usize,
    cols: usize,
}

impl PackedB {
    /// B (`k × n`, any strides) in panels.
    ///
    /// Panics unless [`available`].
    pub fn new(b: Mat) -> Self {
        assert!(available(), "bf16 packing on a CPU without AVX512_BF16");
        // SAFETY: the features were checked.
        unsafe { pack_b_on(b, true) }
    }

    /// The whole of it.
    pub fn view(&self) -> PanelView<'_> {
        PanelView {
            b: self,
            pair0: 0,
            pairs: self.pairs,
            panel0: 0,
            cols: self.cols,
        }
    }
}

impl<'a> PanelView<'a> {
    /// Rows `rows` of this block, `None` unless both ends fall on a pair's boundary (even), or
    /// the end is the block's last row.
    pub fn rows(self, rows: std::ops::Range<usize>, k: usize) -> Option<Self> {
        let ends_well = rows.end.is_multiple_of(2) || rows.end == k;
        (rows.start.is_multiple_of(2) && ends_well && rows.start <= rows.end && rows.end <= k).then(
            || PanelView {
                pair0: self.pair0 + rows.start / 2,
                pairs: rows.end.div_ceil(2) - rows.start / 2,
                ..self
            },
        )
    }

    /// Columns `cols` of this block, `None` unless it starts on a panel's boundary.
    pub fn cols(self, cols: std::ops::Range<usize>) -> Option<Self> {
        (cols.start.is_multiple_of(NR) && cols.start <= cols.end && cols.end <= self.cols).then(
            || PanelView {
                panel0: self.panel0 + cols.start / NR,
                cols: cols.len(),
                ..self
            },
        )
    }

    /// Whether this is a packing of a `k × n` matrix.
    pub(super) fn fits(&self, k: usize, n: usize) -> bool {
        self.pairs == k.div_ceil(2) && self.cols == n
    }

    /// Panel `panel`'s pairs `p0..p0 + count`.
    fn block(&self, panel: usize, p0: usize, count: usize) -> &'a [u32] {
        let start = ((self.panel0 + panel) * self.b.pairs + self.pair0 + p0) * NR;
        &as_u32(&self.b.panels)[start..start + count * NR]
    }
}

/// Pairs from which [`PackedB::new`] packs its panels on rayon's threads (a layer's weight);
/// below, and inside a product, on the calling thread.
const PARALLEL_PACK_PAIRS: usize = 1 << 16;

/// # Safety
/// The features [`available`] checks.
unsafe fn pack_b_on(b: Mat, parallel: bool) -> PackedB {
    let k2 = b.rows.div_ceil(2);
    let panels = b.cols.div_ceil(NR);
    let mut buf = scratch(panels * k2 * NR);
    let out = as_u32_mut(&mut buf);
    // SAFETY (both): the caller has the features.
    if parallel && out.len() >= PARALLEL_PACK_PAIRS {
        use rayon::prelude::*;
        // A few runs of panels per thread, so that each walks its rows in long runs.
        let per_run = panels.div_ceil(4 * rayon::current_num_threads()).max(1);
        out.par_chunks_mut(per_run * k2 * NR)
            .enumerate()
            .for_each(|(run, dst)| unsafe { pack_panels(b, run * per_run, dst) });
    } else {
        unsafe { pack_panels(b, 0, out) };
    }
    PackedB {
        panels: buf,
        pairs: k2,
        cols: b.cols,
    }
}

/// Pairs of rows a row-major B's panels take in turn ([`pack_panels`]): B is read 2 · this many
/// rows at a time, each row from end to end.
const ROW_PAIRS_AT_ONCE: usize = 8;

/// Panels `first..` of B into `dst` (whole panels, `⌈k/2⌉ × NR` pairs each): each element a
/// copy, rounded.
///
/// In the order B lies, so that the hardware sees long runs: a weight read panel by panel
/// took 128 bytes from each row in turn, one page after another, and ran at a quarter of
/// memory's bandwidth (docs/PERFORMANCE.md).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn pack_panels(b: Mat, first: usize, dst: &mut [u32]) {
    let (k, n) = (b.rows, b.cols);
    let k2 = k.div_ceil(2);
    let panel_len = k2 * NR;
    if b.col_stride == 1 {
        // Row-major: a few pairs of rows at a time, each across all the panels.
        let zeros = [0.0f32; NR];
        for p0 in (0..k2).step_by(ROW_PAIRS_AT_ONCE) {
            for (i, panel) in dst.chunks_exact_mut(panel_len).enumerate() {
                let j0 = (first + i) * NR;
                let w = NR.min(n - j0);
                for p in p0..k2.min(p0 + ROW_PAIRS_AT_ONCE) {
                    let lo = &b.data[2 * p * b.row_stride + j0..][..w];
                    let hi = if 2 * p + 1 < k {
                        &b.data[(2 * p + 1) * b.row_stride + j0..][..w]
                    } else {
                        &zeros[..w]
                    };
                    interleave(lo, hi, &mut panel[p * NR..][..w]);
                }
            }
        }
        return;
    }
    for (i, panel) in dst.chunks_exact_mut(panel_len).enumerate() {
        let j0 = (first + i) * NR;
        if b.row_stride == 1 && n - j0 >= NR {
            // SAFETY: the panel's columns are whole (`j0 + NR <= n`).
            unsafe { pack_transposed_panel(b, j0, panel) };
        } else {
            pack_panel(b, first + i, panel);
        }
    }
}

/// The whole panel of columns `j0..j0 + NR` of a transposed B (a weight `[c_out][k]` read as
/// `[k][c_out]`: column j is a contiguous run whose pairs are adjacent floats): 16 columns'
/// next 16 pairs converted into 16 registers, transposed there, stored as 16 rows of the panel.
///
/// # Safety
/// `j0 + NR <= b.cols`, `b.row_stride == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_transposed_panel(b: Mat, j0: usize, dst: &mut [u32]) {
    use crate::layout::avx::transpose16_registers;
    let k = b.rows;
    let k2 = k.div_ceil(2);
    debug_assert!(b.row_stride == 1 && j0 + NR <= b.cols && dst.len() == k2 * NR);
    for p0 in (0..k2).step_by(16) {
        let pairs = (k2 - p0).min(16);
        // Floats of each column in this block: 2 · pairs, less one when k is odd at the end.
        let floats = (k - 2 * p0).min(32);
        let (lo_mask, hi_mask) = (mask16(floats.min(16)), mask16(floats.saturating_sub(16)));
        for half in 0..NR / 16 {
            let rows: [__m512; 16] = std::array::from_fn(|c| {
                let column = &b.data[(j0 + 16 * half + c) * b.col_stride + 2 * p0..];
                // SAFETY: the masked loads touch the column's floats 2·p0..2·p0 + floats,
                // inside it (k long).
                unsafe {
                    let l = load16(column.as_ptr(), lo_mask);
                    let h = load16(column.as_ptr().wrapping_add(16), hi_mask);
                    std::mem::transmute::<__m512bh, __m512>(_mm512_cvtne2ps_pbh(h, l))
                }
            });
            let columns = transpose16_registers(rows);
            for (q, v) in columns.into_iter().enumerate().take(pairs) {
                // SAFETY: pair p0 + q < k2 of the panel, lanes 16·half..16·half + 16 < NR.
                unsafe {
                    _mm512_storeu_ps(dst.as_mut_ptr().add((p0 + q) * NR + 16 * half).cast(), v)
                };
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn pack_b(b: Mat) -> PackedB {
    // SAFETY: the features are enabled here.
    unsafe { pack_b_on(b, false) }
}

/// Panel `panel` of B (`⌈k/2⌉ × NR` pairs) into `dst`, each element a copy, rounded, where
/// [`pack_panels`] has no faster way: a transposed B's last panel when it is partial, and any
/// B whose rows and columns are both strided.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn pack_panel(b: Mat, panel: usize, dst: &mut [u32]) {
    let (k, n) = (b.rows, b.cols);
    let k2 = k.div_ceil(2);
    let j0 = panel * NR;
    let w = NR.min(n - j0);
    if b.row_stride == 1 {
        // Column j is a contiguous run whose pairs are adjacent floats: converted as a run,
        // then spread into its lane of the panel.
        let mut buf = scratch(k2);
        let run = as_u32_mut(&mut buf);
        for lane in 0..w {
            convert_row(&b.data[(j0 + lane) * b.col_stride..][..k], run);
            for (p, pair) in run.iter().enumerate() {
                dst[p * NR + lane] = *pair;
            }
        }
        return;
    }
    for (p, dst) in dst.chunks_exact_mut(NR).enumerate() {
        for (j, d) in dst[..w].iter_mut().enumerate() {
            let at = |r: usize| b.data[r * b.row_stride + (j0 + j) * b.col_stride];
            *d = pair(at(2 * p), if 2 * p + 1 < k { at(2 * p + 1) } else { 0.0 });
        }
    }
}

/// `dst (+)= lhs · rhs` with bf16 inputs and f32 sums; `dst` row-major, `dst_stride` apart;
/// `packed`, when given, is `rhs` already in panels, `packed_a` `lhs` already in pairs.
///
/// # Safety
/// [`available`] is true; `lhs` and `rhs` lie inside their slices (checked by the caller), `k`
/// is not 0, `packed` (if any) packs a `k × n` matrix, `packed_a` (if any) packs `lhs`, and the
/// `lhs.rows × rhs.cols` elements at `dst` are valid for reads and writes by this call alone.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn gemm(
    dst: *mut f32,
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    packed: Option<PanelView>,
    packed_a: Option<&PackedA>,
    accumulate: bool,
) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    let k2 = k.div_ceil(2);
    let own_a;
    let a = match packed_a {
        Some(a) => a,
        None => {
            // SAFETY: the caller checked the features.
            own_a = unsafe { pack_a(lhs) };
            &own_a
        }
    };
    let own;
    let b = match packed {
        Some(view) => {
            debug_assert!(view.fits(k, n));
            view
        }
        None => {
            own = pack_b(rhs);
            own.view()
        }
    };
    let mut p0 = 0;
    while p0 < k2 {
        let kc = KC_PAIRS.min(k2 - p0);
        let add = accumulate || p0 > 0;
        for panel in 0..n.div_ceil(NR) {
            let j0 = panel * NR;
            let w = NR.min(n - j0);
            let masks = [mask16(w.min(16)), mask16(w.saturating_sub(16))];
            let b_block = b.block(panel, p0, kc);
            let mut i = 0;
            while i < m {
                let rows = MR.min(m - i);
                let tile = Tile {
                    a: &as_u32(&a.pairs)[i * a.row_stride + p0 * a.pair_stride..],
                    a_row_stride: a.row_stride,
                    a_pair_stride: a.pair_stride,
                    b: b_block,
                    // SAFETY: row i, column j0 of the destination, inside it per the contract.
                    c: unsafe { dst.add(i * dst_stride + j0) },
                    c_stride: dst_stride,
                    pairs: kc,
                    add,
                    masks,
                };
                // SAFETY: the features are there; the tile's rows of A, its panel of B and its
                // block of C lie inside them (rows ≤ MR rows left, w ≤ NR columns left).
                unsafe {
                    match rows {
                        12 => tile.run::<12>(),
                        11 => tile.run::<11>(),
                        10 => tile.run::<10>(),
                        9 => tile.run::<9>(),
                        8 => tile.run::<8>(),
                        7 => tile.run::<7>(),
                        6 => tile.run::<6>(),
                        5 => tile.run::<5>(),
                        4 => tile.run::<4>(),
                        3 => tile.run::<3>(),
                        2 => tile.run::<2>(),
                        _ => tile.run::<1>(),
                    }
                }
                i += rows;
            }
        }
        p0 += kc;
    }
}

/// One microkernel call: `ROWS` (≤ [`MR`]) rows by up to [`NR`] columns of C.
struct Tile<'a> {
    a: &'a [u32],
    a_row_stride: usize,
    a_pair_stride: usize,
    b: &'a [u32],
    c: *mut f32,
    c_stride: usize,
    pairs: usize,
    add: bool,
    masks: [u16; 2],
}

impl Tile<'_> {
    /// # Safety
    /// The features [`available`] checks; `a` holds pair `pairs - 1` of row `ROWS - 1`; `b`
    /// holds `pairs · NR`; the C block (`ROWS` rows, the masks' columns) is this call's.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn run<const ROWS: usize>(&self) {
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

#[cfg(test)]
mod tests {
    use super::super::{Precision, matmul, par_matmul};
    use super::*;

    fn skip() -> bool {
        if !available() {
            eprintln!("SKIPPED: this CPU has no AVX512_BF16");
        }
        !available()
    }

    fn to_f32(b: u16) -> f64 {
        f32::from_bits((b as u32) << 16) as f64
    }

    /// The product of the bf16-rounded inputs, in f64.
    fn reference(lhs: Mat, rhs: Mat) -> Vec<f64> {
        let mut out = vec![0.0; lhs.rows * rhs.cols];
        for i in 0..lhs.rows {
            for j in 0..rhs.cols {
                out[i * rhs.cols + j] = (0..lhs.cols)
                    .map(|p| {
                        to_f32(round(lhs.data[i * lhs.row_stride + p * lhs.col_stride]))
                            * to_f32(round(rhs.data[p * rhs.row_stride + j * rhs.col_stride]))
                    })
                    .sum();
            }
        }
        out
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104729) % 997) as f32 / 499.0 - 1.0) * 1.37)
            .collect()
    }

    #[test]
    fn rounding_is_to_nearest_even_like_the_hardware() {
        assert_eq!(round(1.0), 0x3f80);
        // 1 + 2⁻⁸ lies halfway between two bf16 values: ties go to the even one (1.0)...
        assert_eq!(round(1.0 + 1.0 / 256.0), 0x3f80);
        // ...and 1 + 3·2⁻⁸ rounds up to the even 1 + 2⁻⁶.
        assert_eq!(round(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(to_f32(round(f32::NAN)).is_nan());
        assert_eq!(round(f32::INFINITY), 0x7f80);
        if skip() {
            return;
        }
        let row = values(37, 3);
        let mut pairs = vec![0u32; 19];
        // SAFETY: the features are there (checked above).
        unsafe { convert_row(&row, &mut pairs) };
        for (i, v) in row.iter().enumerate() {
            let half = (pairs[i / 2] >> (16 * (i % 2))) as u16;
            assert_eq!(half, round(*v), "element {i}: {v}");
        }
        assert_eq!(pairs[18] >> 16, 0, "the odd k's missing half is zero");
    }

    #[test]
    fn products_match_the_rounded_inputs_product_on_every_edge_and_layout() {
        if skip() {
            return;
        }
        // Rows not a multiple of MR, columns not of NR, odd k, k over one block of pairs;
        // row-major, transposed and strided views on both sides; with and without accumulation.
        for (m, n, k) in [
            (1, 1, 1),
            (13, 33, 7),
            (25, 70, 600),
            (12, 32, 513),
            (40, 16, 2),
        ] {
            for layout in 0..4 {
                let (a, b) = (values(m * k * 2, m), values(k * n * 2, n));
                let lhs = match layout {
                    0 | 2 => Mat::rows(&a, m, k),
                    1 => Mat::rows(&a, k, m).t(),
                    _ => Mat {
                        data: &a,
                        rows: m,
                        cols: k,
                        row_stride: 2 * k,
                        col_stride: 2,
                    },
                };
                let rhs = match layout {
                    0 | 1 => Mat::rows(&b, k, n),
                    _ => Mat::rows(&b, n, k).t(),
                };
                let want = reference(lhs, rhs);
                let scale: f64 = k as f64 * 1.4 * 1.4;
                for accumulate in [false, true] {
                    let mut dst = vec![0.5f32; m * (n + 2)];
                    matmul(&mut dst, n + 2, lhs, rhs, accumulate, Precision::Bf16);
                    for i in 0..m {
                        for j in 0..n + 2 {
                            let got = dst[i * (n + 2) + j] as f64;
                            let expected = if j >= n {
                                0.5
                            } else {
                                want[i * n + j] + if accumulate { 0.5 } else { 0.0 }
                            };
                            assert!(
                                (got - expected).abs() <= 1e-6 * scale,
                                "{m}×{n}×{k} layout {layout} accumulate {accumulate} ({i}, {j}): {got} vs {expected}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every pair of every panel is the two elements of B it packs, rounded, whichever way B
    /// lies (row-major, read as a transpose, any strides), with an odd `k`, a partial last
    /// panel, and large enough to be packed on several threads in runs of panels.
    #[test]
    fn panels_hold_each_pair_of_b_whatever_its_layout() {
        if skip() {
            return;
        }
        for (k, n) in [(7, 5), (33, 64), (601, 70), (4608, 96), (1025, 512)] {
            let data = values(k * (2 * n + 1) + 2 * n, k + n);
            for layout in 0..3 {
                let b = match layout {
                    0 => Mat::rows(&data, k, n),
                    1 => Mat::rows(&data, n, k).t(),
                    _ => Mat {
                        data: &data,
                        rows: k,
                        cols: n,
                        row_stride: 2 * n + 1,
                        col_stride: 2,
                    },
                };
                let packed = PackedB::new(b);
                let panels = as_u32(&packed.panels);
                let at = |r: usize, j: usize| b.data[r * b.row_stride + j * b.col_stride];
                for j in 0..n {
                    for p in 0..k.div_ceil(2) {
                        let hi = if 2 * p + 1 < k { at(2 * p + 1, j) } else { 0.0 };
                        let got = panels[((j / NR) * k.div_ceil(2) + p) * NR + j % NR];
                        assert_eq!(
                            got,
                            pair(at(2 * p, j), hi),
                            "{k}×{n} layout {layout}: column {j}, pair {p}"
                        );
                    }
                }
            }
        }
    }

    /// A block of a weight packed once gives bit for bit the product of the block packed on its
    /// own; a block that does not start on a pair of rows or a panel of columns has no view.
    #[test]
    fn a_block_of_packed_panels_gives_the_blocks_own_product() {
        if skip() {
            return;
        }
        use super::super::{PackedRhs, matmul_packed};
        let (k, n, m) = (300, 96, 20);
        let (a, w) = (values(m * k, 5), values(k * n, 6));
        for transposed in [false, true] {
            let whole = if transposed {
                Mat::rows(&w, n, k).t()
            } else {
                Mat::rows(&w, k, n)
            };
            let packed = PackedRhs::new(whole, Precision::Bf16);
            assert!(packed.view(1..10, 0..n).is_none() && packed.view(0..k, 16..n).is_none());
            for (rows, cols) in [(0..k, 0..n), (64..200, 32..96), (2..k, 0..40)] {
                let block = whole.row_range(rows.clone()).col_range(cols.clone());
                let lhs = Mat::rows(&a, m, rows.len());
                let (mut own, mut from_whole) =
                    (vec![0.0; m * cols.len()], vec![0.0; m * cols.len()]);
                matmul(&mut own, cols.len(), lhs, block, false, Precision::Bf16);
                let view = packed.view(rows.clone(), cols.clone());
                assert!(view.is_some(), "{rows:?} {cols:?}");
                matmul_packed(
                    &mut from_whole,
                    cols.len(),
                    lhs,
                    block,
                    view,
                    false,
                    Precision::Bf16,
                );
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&own) == bits(&from_whole),
                    "{rows:?} {cols:?} transposed {transposed}"
                );
            }
        }
    }

    #[test]
    fn tiled_bf16_products_are_bit_identical_at_any_thread_count() {
        if skip() {
            return;
        }
        for (m, n, k, transposed) in [(700, 40, 300, false), (30, 900, 200, true)] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let lhs = if transposed {
                Mat::rows(&a, k, m).t()
            } else {
                Mat::rows(&a, m, k)
            };
            let rhs = Mat::rows(&b, k, n);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut dst = vec![0.0; m * n];
                pool.install(|| par_matmul(&mut dst, n, lhs, rhs, false, Precision::Bf16));
                dst.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let one = run(1);
            for threads in [2, 3] {
                assert!(
                    run(threads) == one,
                    "{m}×{n}×{k} differs at {threads} threads"
                );
            }
        }
    }
}
