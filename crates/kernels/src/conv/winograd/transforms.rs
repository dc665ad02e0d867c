//! The transforms of Winograd F(m×m, 3×3), m = 2 or 4 ([`Tile`]): `V = Bᵀ d B` of an input
//! block, `U = G g Gᵀ` of a 3×3 kernel, `y = Aᵀ M A` back to an output tile, and their
//! adjoints for the gradients, for both tiles, from the matrices of Lavin & Gray (2015). On the
//! activations each entry is a vector of channels and the 2-D transforms are 1-D passes down
//! columns then along rows, written by hand per tile (a test holds them to the matrices); on
//! the weights each entry is a vector of [`LANES`] output channels and the matrices are
//! applied as they are.

use multiversion::multiversion;

use crate::conv::{Weight, WeightLayout};
use crate::layout::block as transpose_block;

/// The output tile of a Winograd convolution: F(2×2, 3×3) or F(4×4, 3×3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tile {
    /// 2×2 outputs from a 4×4 input block: 16 products for 4 outputs; exact in its transforms
    /// (coefficients 0, ±½, ±1).
    F2,
    /// 4×4 outputs from a 6×6 input block: 36 products for 16 outputs, 1.78× fewer
    /// multiply-adds than F2; its transforms scale values by up to 8 and the error grows with
    /// them (still a few f32 ulps of the result's scale, docs/PERFORMANCE.md).
    F4,
}

/// The largest input block's side.
pub(super) const MAX_ALPHA: usize = 6;

/// A tile's matrices, row-major: `Bᵀ` (α×α), `G` (α×3), `Aᵀ` (m×α). `G` is applied as it
/// is; `Bᵀ` and `Aᵀ` by hand-written passes ([`Tile::bt`] and the others), which a test holds
/// to these.
struct Matrices {
    /// Outputs per tile side.
    m: usize,
    /// Inputs per block side, `m + 2`.
    alpha: usize,
    #[cfg_attr(not(test), allow(dead_code))]
    bt: &'static [f32],
    g: &'static [f32],
    #[cfg_attr(not(test), allow(dead_code))]
    at: &'static [f32],
}

#[rustfmt::skip]
const F2: Matrices = Matrices {
    m: 2,
    alpha: 4,
    bt: &[
        1.0, 0.0, -1.0, 0.0,
        0.0, 1.0, 1.0, 0.0,
        0.0, -1.0, 1.0, 0.0,
        0.0, 1.0, 0.0, -1.0,
    ],
    g: &[
        1.0, 0.0, 0.0,
        0.5, 0.5, 0.5,
        0.5, -0.5, 0.5,
        0.0, 0.0, 1.0,
    ],
    at: &[
        1.0, 1.0, 1.0, 0.0,
        0.0, 1.0, -1.0, -1.0,
    ],
};

#[rustfmt::skip]
const F4: Matrices = Matrices {
    m: 4,
    alpha: 6,
    bt: &[
        4.0, 0.0, -5.0, 0.0, 1.0, 0.0,
        0.0, -4.0, -4.0, 1.0, 1.0, 0.0,
        0.0, 4.0, -4.0, -1.0, 1.0, 0.0,
        0.0, -2.0, -1.0, 2.0, 1.0, 0.0,
        0.0, 2.0, -1.0, -2.0, 1.0, 0.0,
        0.0, 4.0, 0.0, -5.0, 0.0, 1.0,
    ],
    g: &[
        1.0 / 4.0, 0.0, 0.0,
        -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0,
        -1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0,
        1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0,
        1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0,
        0.0, 0.0, 1.0,
    ],
    at: &[
        1.0, 1.0, 1.0, 1.0, 1.0, 0.0,
        0.0, 1.0, -1.0, 2.0, -2.0, 0.0,
        0.0, 1.0, 1.0, 4.0, 4.0, 0.0,
        0.0, 1.0, -1.0, 8.0, -8.0, 1.0,
    ],
};

impl Tile {
    fn matrices(self) -> &'static Matrices {
        match self {
            Tile::F2 => &F2,
            Tile::F4 => &F4,
        }
    }

    /// Outputs per tile side, m.
    pub(super) fn side(self) -> usize {
        self.matrices().m
    }

    /// Inputs per block side, α = m + 2.
    pub(super) fn alpha(self) -> usize {
        self.matrices().alpha
    }

    /// Transformed values per (input, output) channel pair: α².
    pub fn planes(self) -> usize {
        self.alpha() * self.alpha()
    }
}

impl Matrices {
    fn g(&self, i: usize, k: usize) -> f32 {
        self.g[i * 3 + k]
    }
}

/// The four 1-D transforms on channel vectors, each one pass over the channels reading its
/// inputs and writing its outputs (the 2-D transforms apply them down columns, then along
/// rows). Hand-written from [`Matrices`] (a test holds them to it): a loop over the matrix's
/// terms, one pass per term, took half again as long on 64 channels.
impl Tile {
    /// `dst = Bᵀ src`: α vectors to α.
    #[inline(always)]
    pub(super) fn bt(self, dst: &mut [&mut [f32]], src: &[&[f32]]) {
        match self {
            Tile::F2 => by_blocks(dst, src, |[x0, x1, x2, x3]: [f32; 4]| {
                [x0 - x2, x1 + x2, x2 - x1, x1 - x3]
            }),
            Tile::F4 => by_blocks(dst, src, |[x0, x1, x2, x3, x4, x5]: [f32; 6]| {
                let (a, b) = (x4 - 4.0 * x2, x3 - 4.0 * x1);
                let (c, d) = (x4 - x2, 2.0 * (x3 - x1));
                [
                    4.0 * x0 - 5.0 * x2 + x4,
                    a + b,
                    a - b,
                    c + d,
                    c - d,
                    4.0 * x1 - 5.0 * x3 + x5,
                ]
            }),
        }
    }

    /// `dst = B src`, the adjoint of [`Tile::bt`]: α vectors to α.
    #[inline(always)]
    pub(super) fn b(self, dst: &mut [&mut [f32]], src: &[&[f32]]) {
        match self {
            Tile::F2 => by_blocks(dst, src, |[y0, y1, y2, y3]: [f32; 4]| {
                [y0, y1 - y2 + y3, y1 + y2 - y0, -y3]
            }),
            Tile::F4 => by_blocks(dst, src, |[y0, y1, y2, y3, y4, y5]: [f32; 6]| {
                let (s12, d12) = (y1 + y2, y2 - y1);
                let (s34, d34) = (y3 + y4, y4 - y3);
                [
                    4.0 * y0,
                    4.0 * d12 + 2.0 * d34 + 4.0 * y5,
                    -5.0 * y0 - 4.0 * s12 - s34,
                    -d12 - 2.0 * d34 - 5.0 * y5,
                    y0 + s12 + s34,
                    y5,
                ]
            }),
        }
    }

    /// `dst = Aᵀ src`: α vectors to m.
    #[inline(always)]
    pub(super) fn at(self, dst: &mut [&mut [f32]], src: &[&[f32]]) {
        match self {
            Tile::F2 => by_blocks(dst, src, |[m0, m1, m2, m3]: [f32; 4]| {
                [m0 + m1 + m2, m1 - m2 - m3]
            }),
            Tile::F4 => by_blocks(dst, src, |[m0, m1, m2, m3, m4, m5]: [f32; 6]| {
                let (s12, d12) = (m1 + m2, m1 - m2);
                let (s34, d34) = (m3 + m4, m3 - m4);
                [
                    m0 + s12 + s34,
                    d12 + 2.0 * d34,
                    s12 + 4.0 * s34,
                    d12 + 8.0 * d34 + m5,
                ]
            }),
        }
    }

    /// `dst = A src`, the adjoint of [`Tile::at`]: m vectors to α.
    #[inline(always)]
    pub(super) fn a(self, dst: &mut [&mut [f32]], src: &[&[f32]]) {
        match self {
            Tile::F2 => by_blocks(dst, src, |[g0, g1]: [f32; 2]| [g0, g0 + g1, g0 - g1, -g1]),
            Tile::F4 => by_blocks(dst, src, |[g0, g1, g2, g3]: [f32; 4]| {
                let (e, o) = (g0 + g2, g1 + g3);
                let (e2, o2) = (g0 + 4.0 * g2, 2.0 * g1 + 8.0 * g3);
                [g0, e + o, e - o, e2 + o2, e2 - o2, g3]
            }),
        }
    }
}

/// Channels a 1-D transform takes at once, one vector register's worth.
const BLOCK: usize = 16;

/// `dst[o][l] = f(src[..][l])[o]` for every channel `l`, [`BLOCK`] channels at a time through
/// local arrays: with `I + O` slices that might overlap, the compiler vectorised the plain loop
/// behind run-time overlap checks it then failed, and ran it a channel at a time.
#[inline(always)]
fn by_blocks<const I: usize, const O: usize>(
    dst: &mut [&mut [f32]],
    src: &[&[f32]],
    f: impl Fn([f32; I]) -> [f32; O],
) {
    let n = dst[0].len();
    let mut start = 0;
    while start + BLOCK <= n {
        let mut x = [[0.0f32; BLOCK]; I];
        for (x, s) in x.iter_mut().zip(src) {
            x.copy_from_slice(&s[start..start + BLOCK]);
        }
        let mut y = [[0.0f32; BLOCK]; O];
        for l in 0..BLOCK {
            let out = f(std::array::from_fn(|k| x[k][l]));
            for (y, v) in y.iter_mut().zip(out) {
                y[l] = v;
            }
        }
        for (d, y) in dst.iter_mut().zip(&y) {
            d[start..start + BLOCK].copy_from_slice(y);
        }
        start += BLOCK;
    }
    for l in start..n {
        let out = f(std::array::from_fn(|k| src[k][l]));
        for (d, v) in dst.iter_mut().zip(out) {
            d[l] = v;
        }
    }
}

/// `len`-long pieces of `buf` at `at`, `at + step`, ... (`n` of them, the rest empty). Filled
/// by a plain loop: `std::array::from_fn` was not inlined, and took a twentieth of a layer.
#[inline(always)]
pub(super) fn pieces(
    buf: &[f32],
    n: usize,
    at: usize,
    step: usize,
    len: usize,
) -> [&[f32]; MAX_ALPHA] {
    let mut out: [&[f32]; MAX_ALPHA] = [&[]; MAX_ALPHA];
    for (k, piece) in out.iter_mut().enumerate().take(n) {
        *piece = &buf[at + k * step..][..len];
    }
    out
}

/// The same, mutable (the pieces must not overlap: `step >= len`).
#[inline(always)]
pub(super) fn pieces_mut(
    buf: &mut [f32],
    n: usize,
    at: usize,
    step: usize,
    len: usize,
) -> [&mut [f32]; MAX_ALPHA] {
    assert!(step >= len && n <= MAX_ALPHA, "pieces overlap");
    let mut out: [&mut [f32]; MAX_ALPHA] = Default::default();
    let mut rest = &mut buf[at..];
    for (k, piece) in out.iter_mut().enumerate().take(n) {
        let (head, tail) =
            std::mem::take(&mut rest).split_at_mut(if k + 1 < n { step } else { len });
        *piece = &mut head[..len];
        rest = tail;
    }
    out
}

/// Channels the weight's transforms take at once: [`LANES`] output channels side by side in
/// vector lanes, and blocks of [`LANES`] input channels, whose taps in PyTorch's layout are one
/// run for each output channel. Element by element (each pair's 9 taps read, its 16 values
/// written `c_out` apart) the two transforms took a fifth of resnet18's 256→256 layer at 4×4.
pub(super) const LANES: usize = 16;

/// A value of the transforms for each of [`LANES`] output channels.
type Lanes = [f32; LANES];

/// `dst[..lanes] = src[..lanes]`: a whole vector's copy inlined when all lanes are used (the
/// copy of a length known only at run time is a call to `memmove`, which took as long as the
/// transform itself).
#[inline(always)]
fn copy_lanes(dst: &mut [f32], src: &[f32], lanes: usize) {
    if lanes == LANES {
        dst[..LANES].copy_from_slice(&src[..LANES]);
    } else {
        dst[..lanes].copy_from_slice(&src[..lanes]);
    }
}

/// `out = Σ_k coef(k) · x(k)` lane-wise over the non-zero coefficients.
#[inline(always)]
fn lanes_combine<'a>(
    n: usize,
    coef: impl Fn(usize) -> f32,
    x: impl Fn(usize) -> &'a Lanes,
) -> Lanes {
    let mut out = [0.0f32; LANES];
    for k in 0..n {
        let a = coef(k);
        if a != 0.0 {
            let x = x(k);
            for l in 0..LANES {
                out[l] += a * x[l];
            }
        }
    }
    out
}

/// `U` of input channels `c0..` (`u`'s rows of `planes · c_out` values then `row_pad`) for
/// every output channel, from `weight` in either layout: the block's taps for [`LANES`] output
/// channels transposed to a vector per tap, `G g Gᵀ` lane-wise, written as runs.
#[multiversion(targets = "simd")]
pub(super) fn transform_weights(
    tile: Tile,
    weight: Weight,
    ci: usize,
    co: usize,
    c0: usize,
    row_pad: usize,
    u: &mut [f32],
) {
    let t = tile.matrices();
    let alpha = t.alpha;
    let row = alpha * alpha * co + row_pad;
    let cs = u.len() / row;
    let mut taps = [0.0f32; LANES * 9 * LANES];
    for o0 in (0..co).step_by(LANES) {
        let lanes = LANES.min(co - o0);
        // Into `[(c, tap)][lane]`.
        match weight.layout {
            WeightLayout::Torch => {
                let block = &weight.values[(o0 * ci + c0) * 9..];
                transpose_block(block, ci * 9, &mut taps, LANES, lanes, cs * 9);
            }
            WeightLayout::TapsFirst => {
                for tap in 0..9 {
                    let block = &weight.values[(o0 * 9 + tap) * ci + c0..];
                    transpose_block(
                        block,
                        9 * ci,
                        &mut taps[tap * LANES..],
                        9 * LANES,
                        lanes,
                        cs,
                    );
                }
            }
        }
        for c in 0..cs {
            let g = |k: usize| -> &Lanes {
                taps[(c * 9 + k) * LANES..][..LANES]
                    .try_into()
                    .expect("LANES floats per tap")
            };
            // G g (α×3), then (G g) Gᵀ (α×α).
            let mut gg = [[[0.0f32; LANES]; 3]; MAX_ALPHA];
            for (i, row) in gg.iter_mut().enumerate().take(alpha) {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = lanes_combine(3, |k| t.g(i, k), |k| g(k * 3 + j));
                }
            }
            let u = &mut u[c * row..];
            for (i, row) in gg.iter().enumerate().take(alpha) {
                for j in 0..alpha {
                    let v = lanes_combine(3, |k| t.g(j, k), |k| &row[k]);
                    copy_lanes(&mut u[(i * alpha + j) * co + o0..], &v, lanes);
                }
            }
        }
    }
}

/// Input channels ahead of the one being read whose dU lines are fetched early.
const PREFETCH_AHEAD: usize = 2;

/// Asks for the cache line of `v[i]` (nothing past the end).
#[inline(always)]
fn prefetch(v: &[f32], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if i < v.len() {
        // SAFETY: a prefetch of an address inside `v`; it reads nothing.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                v.as_ptr().add(i).cast(),
            )
        };
    }
}

/// Output channels `o0..` of the weight gradient `dW = Gᵀ dU G` into `w_out` (in `layout`)
/// from dU (`[planes][c_in][c_out]`): a block of input channels at a time, computed lane-wise
/// into `[(c, tap)][lane]`, then transposed into each output channel's run.
#[multiversion(targets = "simd")]
pub(super) fn weight_grad_block(
    tile: Tile,
    du: &[f32],
    ci: usize,
    o0: usize,
    layout: WeightLayout,
    w_out: &mut [f32],
) {
    let t = tile.matrices();
    let alpha = t.alpha;
    let co = du.len() / (alpha * alpha * ci);
    let lanes = w_out.len() / (9 * ci);
    let mut taps = [0.0f32; LANES * 9 * LANES];
    for c0 in (0..ci).step_by(LANES) {
        let cs = LANES.min(ci - c0);
        for c in 0..cs {
            let mut m = [[0.0f32; LANES]; MAX_ALPHA * MAX_ALPHA];
            for (xi, m) in m.iter_mut().enumerate().take(alpha * alpha) {
                copy_lanes(m, &du[(xi * ci + c0 + c) * co + o0..], lanes);
                prefetch(du, (xi * ci + c0 + c + PREFETCH_AHEAD) * co + o0);
            }
            // Gᵀ dU (3×α), then (Gᵀ dU) G (3×3).
            let mut gm = [[[0.0f32; LANES]; MAX_ALPHA]; 3];
            for (k, row) in gm.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate().take(alpha) {
                    *v = lanes_combine(alpha, |i| t.g(i, k), |i| &m[i * alpha + j]);
                }
            }
            for (k, row) in gm.iter().enumerate() {
                for l in 0..3 {
                    let v = lanes_combine(alpha, |j| t.g(j, l), |j| &row[j]);
                    taps[(c * 9 + k * 3 + l) * LANES..][..LANES].copy_from_slice(&v);
                }
            }
        }
        match layout {
            WeightLayout::Torch => {
                transpose_block(&taps, LANES, &mut w_out[c0 * 9..], ci * 9, cs * 9, lanes)
            }
            WeightLayout::TapsFirst => {
                for tap in 0..9 {
                    let w = &mut w_out[tap * ci + c0..];
                    transpose_block(&taps[tap * LANES..], 9 * LANES, w, 9 * ci, cs, lanes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Pass = fn(Tile, &mut [&mut [f32]], &[&[f32]]);

    /// `pass` on `ins` vectors, into `outs`.
    fn apply(pass: Pass, tile: Tile, ins: &[Vec<f32>], outs: usize) -> Vec<Vec<f32>> {
        let len = ins[0].len();
        let mut out = vec![vec![0.0f32; len]; outs];
        let src: Vec<&[f32]> = ins.iter().map(|v| &v[..]).collect();
        let mut dst: Vec<&mut [f32]> = out.iter_mut().map(|v| &mut v[..]).collect();
        pass(tile, &mut dst, &src);
        out
    }

    /// `Σ_k coef(i, k) · x[k]` for `i < outs`.
    fn product(coef: impl Fn(usize, usize) -> f32, x: &[Vec<f32>], outs: usize) -> Vec<Vec<f32>> {
        (0..outs)
            .map(|i| {
                (0..x[0].len())
                    .map(|l| (0..x.len()).map(|k| coef(i, k) * x[k][l]).sum())
                    .collect()
            })
            .collect()
    }

    /// Integers in, integer coefficients (and ½ in F2's `G`, not tested here): every sum is
    /// exact, so the passes must equal the matrices' products to the bit.
    #[test]
    fn the_hand_written_passes_are_the_matrices_and_their_adjoints() {
        for tile in [Tile::F2, Tile::F4] {
            let t = tile.matrices();
            let (a, m) = (t.alpha, t.m);
            let vectors = |n: usize| -> Vec<Vec<f32>> {
                (0..n)
                    .map(|k| {
                        (0..19)
                            .map(|i| ((k * 7 + i * 3) % 11) as f32 - 5.0)
                            .collect()
                    })
                    .collect()
            };
            let bt = |i: usize, k: usize| t.bt[i * a + k];
            let at = |i: usize, k: usize| t.at[i * a + k];
            let (x, g) = (vectors(a), vectors(m));
            assert_eq!(
                apply(Tile::bt, tile, &x, a),
                product(bt, &x, a),
                "{tile:?} Bᵀ"
            );
            assert_eq!(
                apply(Tile::b, tile, &x, a),
                product(|i, k| bt(k, i), &x, a),
                "{tile:?} B"
            );
            assert_eq!(
                apply(Tile::at, tile, &x, m),
                product(at, &x, m),
                "{tile:?} Aᵀ"
            );
            assert_eq!(
                apply(Tile::a, tile, &g, a),
                product(|i, k| at(k, i), &g, a),
                "{tile:?} A"
            );
        }
    }
}
