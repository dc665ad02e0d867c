//! B, the right-hand side, in panels of [`NR`] columns ([`PackedB`]) and blocks of them
//! ([`PanelView`]): packed in the order B lies, on rayon's threads for a layer's weight.

use std::arch::x86_64::*;

use super::super::Mat;
use super::convert::{as_u32, as_u32_mut, convert_row, interleave, load16, mask16};
use super::{NR, available, pair};
use crate::scratch::{Scratch, scratch};

/// B as panels of [`NR`] columns, `[panel][p][NR]` pairs, unspecified beyond the last column
/// (the microkernel computes those lanes and never stores them): made once for many products
/// when B is a layer's weight ([`crate::matmul::PackedRhs`]), else per product. In a scratch
/// buffer, neither allocated nor zeroed each time.
pub struct PackedB {
    pub(super) panels: Scratch,
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
    pub(in crate::matmul) fn fits(&self, k: usize, n: usize) -> bool {
        self.pairs == k.div_ceil(2) && self.cols == n
    }

    /// Panel `panel`'s pairs `p0..p0 + count`.
    pub(super) fn block(&self, panel: usize, p0: usize, count: usize) -> &'a [u32] {
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
pub(super) fn pack_b(b: Mat) -> PackedB {
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
