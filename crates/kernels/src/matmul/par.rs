//! [`par_matmul`] and its kin: one product shared out to rayon's threads by bands of its
//! destination whose bounds depend only on the shape ([`Tiling`]), so that each element is
//! computed whole, by one thread, in the same order whatever the thread count; in bf16, the
//! operand every band reads whole packed once for all of them.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::bf16;
use super::{Mat, PackedLhs, PackedRhs, Precision, RhsPanels, check_product, gemm_unchecked};

/// Multiply-adds from which a product is worth a second tile (about 10 µs of one core): low
/// enough that the direct kernel's products on resnet18's stride-2 128→256 layer at 8×8 (32
/// rows × 384 × 256) are split...
const TILE_MIN_MACS: usize = 1 << 20;
/// ...and rows or columns below which a tile would pack more than it computes.
const TILE_MIN_SIDE: usize = 128;
/// The most tiles one product is split into.
const MAX_TILES: usize = 8;

/// How [`par_matmul`] splits an `m × n` product with inner dimension `k`: into `tiles` bands of
/// rows (`by_rows`) or of columns, each a multiple of 32 long but the last. A function of the
/// shape alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    pub tiles: usize,
    pub by_rows: bool,
    pub band: usize,
}

impl Tiling {
    pub fn of(m: usize, n: usize, k: usize) -> Self {
        let by_rows = m >= n;
        let side = if by_rows { m } else { n };
        let tiles = (side / TILE_MIN_SIDE)
            .min(m * n * k / TILE_MIN_MACS)
            .clamp(1, MAX_TILES);
        // Multiples of 32: whole bf16 panels, so that a packed weight's panels serve a band.
        let band = side.div_ceil(tiles).next_multiple_of(32).max(1);
        Tiling {
            tiles: side.div_ceil(band).max(1),
            by_rows,
            band,
        }
    }
}

/// [`matmul`](super::matmul) shared out to rayon's threads by the tiles of [`Tiling::of`]:
/// bit-identical to itself whatever the thread count (not necessarily to
/// [`matmul`](super::matmul)).
pub fn par_matmul(
    dst: &mut [f32],
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    accumulate: bool,
    precision: Precision,
) {
    par_matmul_packed(dst, dst_stride, lhs, rhs, None, accumulate, precision)
}

/// [`par_matmul`] with `rhs` already packed, as [`matmul_packed`](super::matmul_packed).
pub fn par_matmul_packed(
    dst: &mut [f32],
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    panels: Option<RhsPanels>,
    accumulate: bool,
    precision: Precision,
) {
    check_product(dst.len(), dst_stride, &lhs, &rhs, panels, precision);
    // SAFETY: checked above; `dst` is borrowed mutably while the inputs are shared borrows.
    unsafe {
        par_gemm_unchecked(
            dst.as_mut_ptr(),
            dst_stride,
            lhs,
            rhs,
            panels,
            accumulate,
            precision,
        )
    }
}

/// [`par_matmul_packed`] (`dst = lhs · rhs`) into memory not yet initialised: it writes every
/// element of the `lhs.rows × rhs.cols` block at `dst` (rows `dst_stride` apart) and reads
/// none. A kernel whose products tile its output whole thus skips zeroing it first (a pass out
/// to memory and back: the direct layers' weight gradients, im2col's outputs).
pub fn par_matmul_uninit(
    dst: &mut [std::mem::MaybeUninit<f32>],
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    panels: Option<RhsPanels>,
    precision: Precision,
) {
    check_product(dst.len(), dst_stride, &lhs, &rhs, panels, precision);
    // SAFETY: checked above; without `accumulate` the products write the block and never read
    // it (gemm with `read_dst` false, the bf16 kernel storing its first block of `k`, zeros
    // for k = 0), so its elements need not be initialised.
    unsafe {
        par_gemm_unchecked(
            dst.as_mut_ptr().cast::<f32>(),
            dst_stride,
            lhs,
            rhs,
            panels,
            false,
            precision,
        )
    }
}

/// # Safety
/// As [`gemm_unchecked`], for the whole `lhs.rows × rhs.cols` block at `dst`.
unsafe fn par_gemm_unchecked(
    dst: *mut f32,
    dst_stride: usize,
    lhs: Mat,
    rhs: Mat,
    panels: Option<RhsPanels>,
    accumulate: bool,
    precision: Precision,
) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    let plan = Tiling::of(m, n, k);
    if plan.tiles == 1 {
        // SAFETY: per the contract.
        return unsafe {
            gemm_unchecked(
                dst,
                dst_stride,
                lhs,
                rhs,
                (panels, None),
                accumulate,
                precision,
            )
        };
    }
    // In bf16, the operand every band reads whole is packed once, not once a band: B for bands
    // of rows (unless it came packed), A for bands of columns (packing's share of resnet50's
    // bf16 step: 26.7 % of the samples with a packing a band, 23.7 % with this).
    let shared = SharedOperands::new(lhs, rhs, panels, plan.by_rows, precision);
    let panels = shared.panels(panels, k, n);
    let dst = SharedDst(dst);
    (0..plan.tiles).into_par_iter().for_each(|tile| {
        let start = tile * plan.band;
        let side = if plan.by_rows { m } else { n };
        let band = start..(start + plan.band).min(side);
        let (offset, lhs, rhs, panels, packed_lhs) = if plan.by_rows {
            (
                band.start * dst_stride,
                lhs.row_range(band),
                rhs,
                panels,
                None,
            )
        } else {
            // A band of whole panels keeps its panels (bands are multiples of 32 columns).
            let panels = panels.and_then(|p| p.cols(band.clone()));
            (band.start, lhs, rhs.col_range(band), panels, shared.lhs())
        };
        // SAFETY: the tiles are disjoint bands (rows or columns) of the block the contract
        // covers, so no element is written by two threads, and nothing else reads or writes
        // the block until every tile has finished (`for_each` joins them). `packed_lhs` packs
        // the whole `lhs`, which a band of columns reads.
        unsafe {
            gemm_unchecked(
                dst.at(offset),
                dst_stride,
                lhs,
                rhs,
                (panels, packed_lhs),
                accumulate,
                precision,
            )
        }
    });
}

/// What [`par_gemm_unchecked`] packs once for all its bands (bf16 only): the right-hand side
/// for bands of rows, the left-hand side for bands of columns.
struct SharedOperands {
    rhs: Option<PackedRhs>,
    lhs: Option<PackedLhs>,
}

impl SharedOperands {
    fn new(
        lhs: Mat,
        rhs: Mat,
        panels: Option<RhsPanels>,
        by_rows: bool,
        precision: Precision,
    ) -> Self {
        let bf16 = precision == Precision::Bf16;
        #[cfg(not(target_arch = "x86_64"))]
        let _ = lhs;
        SharedOperands {
            rhs: (bf16 && by_rows && panels.is_none()).then(|| PackedRhs::new(rhs, precision)),
            #[cfg(target_arch = "x86_64")]
            lhs: (bf16 && !by_rows).then(|| bf16::pack_lhs(lhs)),
            #[cfg(not(target_arch = "x86_64"))]
            lhs: None,
        }
    }

    /// The panels the bands read: those given, or this packing of the whole `k × n` rhs.
    fn panels<'a>(
        &'a self,
        given: Option<RhsPanels<'a>>,
        k: usize,
        n: usize,
    ) -> Option<RhsPanels<'a>> {
        given.or_else(|| self.rhs.as_ref()?.view(0..k, 0..n))
    }

    fn lhs(&self) -> Option<&PackedLhs> {
        self.lhs.as_ref()
    }
}

/// The destination pointer, shared by tiles that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedDst(*mut f32);
// SAFETY: see `par_matmul`: every thread writes its own elements only.
unsafe impl Send for SharedDst {}
unsafe impl Sync for SharedDst {}

impl SharedDst {
    fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: `offset` is the first element of a tile inside the checked destination.
        unsafe { self.0.add(offset) }
    }
}
