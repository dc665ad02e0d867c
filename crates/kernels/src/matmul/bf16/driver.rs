//! The driver: `dst (+)= lhs · rhs` in blocks of [`KC_PAIRS`] pairs, panel by panel, [`MR`]
//! rows at a time, each block one microkernel call.

use super::super::Mat;
use super::convert::{as_u32, mask16};
use super::microkernel::Tile;
use super::pack_a::{PackedA, pack_a};
use super::pack_b::{PanelView, pack_b};
use super::{KC_PAIRS, MR, NR};

/// `dst (+)= lhs · rhs` with bf16 inputs and f32 sums; `dst` row-major, `dst_stride` apart;
/// `packed`, when given, is `rhs` already in panels, `packed_a` `lhs` already in pairs.
///
/// # Safety
/// [`available`](super::available) is true; `lhs` and `rhs` lie inside their slices (checked by
/// the caller), `k` is not 0, `packed` (if any) packs a `k × n` matrix, `packed_a` (if any) packs
/// `lhs`, and the `lhs.rows × rhs.cols` elements at `dst` are valid for reads and writes by this
/// call alone.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(in crate::matmul) unsafe fn gemm(
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
