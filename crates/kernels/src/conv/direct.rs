//! Convolutions of small images computed output pixel by output pixel, skipping the taps that
//! fall in the padding. On a ResNet's deep layers (3×3 at 2×2 with padding 1) 5 of each
//! window's 9 taps are padding, and im2col multiplies their zeros all the same: 36
//! multiply-adds per channel pair and image where 16 are needed.
//!
//! For an output pixel `p` and a kernel row, the taps inside the image are a run of
//! consecutive columns, and their input pixels a run of consecutive pixels of one image row
//! (a [`Span`]). With the images as the rows of every matrix (NHWC as it lies: image `n`'s
//! pixel `q` is columns `q·c_in..` of row `n`), each span is one GEMM over the whole batch:
//!
//! - forward: `Y[:, p] += X[:, q..q+len] · Wᵀ[taps]`;
//! - input gradient: `dX[:, q..q+len] += G[:, p] · W[taps]`;
//! - weight gradient, tap by tap: `dW[tap] = Σ G[:, p]ᵀ · X[:, q]` over the pixel pairs the
//!   tap links, their images stacked into one product (each element of dW written once).
//!
//! The products run one after the other in a fixed order, each shared out by [`par_matmul`]'s
//! shape-fixed tiles with every element's sum done whole by one thread: the result is
//! bit-identical whatever the thread count. The weight is im2col's
//! [`PackedWeight`] (`[c_out][(ky, kx, c_in)]`), whose columns a span's taps are a run of.

use rayon::prelude::*;

use super::shared::{
    ConvGrads, ForwardRhs, PackedWeight, Wanted, check_backward_sizes, chunk_gradient,
    relu_in_place, tap_range, unpack,
};
use super::{Algorithm, ConvShape};
use crate::matmul::{Mat, PackedRhs, par_matmul_packed, par_matmul_uninit};
use crate::phases;
use crate::scratch::{scratch, zeros};

/// This module's algorithm, whose passes it names in [`crate::phases`].
const ALGORITHM: Algorithm = Algorithm::Direct;

/// Output pixels up to which the per-pixel GEMMs, whose rows are the batch, beat im2col's
/// (measured on a ResNet's layers at 64 px: the stride-2 3×3 from 8×8 to 4×4 still gains about
/// 20 % over im2col, docs/PERFORMANCE.md).
pub(crate) const MAX_OUTPUT_PIXELS: usize = 16;
/// Images below which a per-pixel GEMM has too few rows to run at gemm's speed.
const MIN_BATCH: usize = 16;

/// Whether [`Prepared::new`](crate::conv::Prepared::new) may compute `s` pixel by pixel: a
/// small output, a batch of [`MIN_BATCH`] images or more, and taps in the padding to skip.
pub fn pays(s: &ConvShape) -> bool {
    let [oh, ow] = s.out_size();
    oh * ow <= MAX_OUTPUT_PIXELS
        && s.batch >= MIN_BATCH
        && useful_taps(s) < oh * ow * s.kernel[0] * s.kernel[1]
}

/// Taps inside the image, summed over the output pixels of one image.
pub(crate) fn useful_taps(s: &ConvShape) -> usize {
    spans(s).iter().map(|span| span.len).sum()
}

/// One GEMM: output pixel `p`, input pixels `q..q + len` of one image row, linked by the
/// kernel's taps `tap..tap + len` (row-major `(ky, kx)`).
#[derive(Clone, Copy, Debug)]
struct Span {
    p: usize,
    q: usize,
    tap: usize,
    len: usize,
}

/// Every span of `s`, output pixel by output pixel, kernel row by kernel row.
fn spans(s: &ConvShape) -> Vec<Span> {
    let [oh, ow] = s.out_size();
    let [kh, kw] = s.kernel;
    let mut spans = Vec::new();
    for oy in 0..oh {
        for ox in 0..ow {
            let (lo, hi, ix) = tap_range(ox, s.stride[1], s.padding[1], kw, s.width);
            if hi == lo {
                continue;
            }
            for ky in 0..kh {
                let Some(iy) = (oy * s.stride[0] + ky).checked_sub(s.padding[0]) else {
                    continue;
                };
                if iy >= s.height {
                    continue;
                }
                spans.push(Span {
                    p: oy * ow + ox,
                    q: iy * s.width + ix,
                    tap: ky * kw + lo,
                    len: hi - lo,
                });
            }
        }
    }
    spans
}

/// `y = conv(x, w) + bias`, then ReLU when `relu`; `x` and `y` NHWC.
pub fn forward(
    s: &ConvShape,
    x: &[f32],
    weight: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    let (ci, co) = (s.c_in, s.c_out);
    let (image_in, image_out) = (s.input_len() / s.batch, s.output_len() / s.batch);
    // `[(ky, kx, c_in)][c_out]`: a span's taps are a run of its rows.
    let rhs = phases::timed(ALGORITHM.phase(s, "weight layout"), || {
        ForwardRhs::new(s, x, weight)
    });
    let mut out = zeros(s.output_len());
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(co) {
            row.copy_from_slice(b);
        }
    }
    let x = Mat::rows(x, s.batch, image_in);
    let mut written = vec![bias.is_some(); image_out / co];
    phases::timed(ALGORITHM.phase(s, "products"), || {
        for span in spans(s) {
            let taps = span.tap * ci..(span.tap + span.len) * ci;
            par_matmul_packed(
                &mut out[span.p * co..],
                image_out,
                x.col_range(span.q * ci..(span.q + span.len) * ci),
                rhs.mat().row_range(taps.clone()),
                rhs.panels(taps),
                written[span.p],
                weight.precision,
            );
            written[span.p] = true;
        }
    });
    if relu {
        relu_in_place(&mut out);
    }
    out
}

/// Gradients of [`forward`]; with the ReLU fused, `relu_output` is the forward's output.
pub fn backward(
    s: &ConvShape,
    x: &[f32],
    weight: &PackedWeight<'_>,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    wanted: Wanted,
) -> ConvGrads {
    check_backward_sizes(s, x, relu_output, dy);
    let (ci, co, k) = (s.c_in, s.c_out, s.k());
    let (image_in, image_out) = (s.input_len() / s.batch, s.output_len() / s.batch);
    let mut masked = scratch(dy.len());
    let mut db = vec![0.0f32; wanted.bias_len(co)];
    let gs = chunk_gradient(dy, relu_output, 0..dy.len(), &mut masked, &mut db);
    let g = Mat::rows(gs, s.batch, image_out);
    let w = Mat::rows(&weight.data, co, k);
    let spans = spans(s);

    // dW tap by tap: the (output pixel, input pixel) pairs a tap links, their images stacked
    // along the inner dimension, so that each tap's block of dW is one GEMM, written once.
    let taps = s.kernel[0] * s.kernel[1];
    let pairs_of = |tap: usize| -> Vec<(usize, usize)> {
        spans
            .iter()
            .filter(|sp| (sp.tap..sp.tap + sp.len).contains(&tap))
            .map(|sp| (sp.p, sp.q + tap - sp.tap))
            .collect()
    };
    let most = (0..taps).map(|t| pairs_of(t).len()).max().unwrap_or(0);
    // Written block by block below, never zeroed as a whole first.
    let mut dw = Vec::with_capacity(s.weight_len());
    phases::timed(
        ALGORITHM.phase(s, "weight gradient (gathers, products)"),
        || {
            let (mut g_pairs, mut x_pairs) =
                (scratch(most * s.batch * co), scratch(most * s.batch * ci));
            let blocks = &mut dw.spare_capacity_mut()[..s.weight_len()];
            for tap in 0..taps {
                let pairs = pairs_of(tap);
                if pairs.is_empty() {
                    // The tap only ever meets padding: its gradient is zero.
                    for row in blocks.chunks_exact_mut(k) {
                        row[tap * ci..][..ci].fill(std::mem::MaybeUninit::new(0.0));
                    }
                    continue;
                }
                let rows = pairs.len() * s.batch;
                g_pairs[..rows * co]
                    .par_chunks_mut(s.batch * co)
                    .zip(x_pairs[..rows * ci].par_chunks_mut(s.batch * ci))
                    .zip(&pairs)
                    .for_each(|((gp, xp), &(p, q))| {
                        for n in 0..s.batch {
                            gp[n * co..][..co].copy_from_slice(&gs[n * image_out + p * co..][..co]);
                            xp[n * ci..][..ci].copy_from_slice(&x[n * image_in + q * ci..][..ci]);
                        }
                    });
                par_matmul_uninit(
                    &mut blocks[tap * ci..],
                    k,
                    Mat::rows(&g_pairs[..rows * co], rows, co).t(),
                    Mat::rows(&x_pairs[..rows * ci], rows, ci),
                    None,
                    weight.precision,
                );
            }
        },
    );
    // SAFETY: the taps' blocks (columns `tap·ci..(tap + 1)·ci` of each of the `c_out` rows of
    // `k`) tile the whole weight gradient, and the loop wrote each whole: a product writes
    // every element of its `c_out × c_in` block, the others were filled with zeros.
    unsafe { dw.set_len(s.weight_len()) };
    let dx = wanted.input.then(|| {
        phases::timed(ALGORITHM.phase(s, "input gradient products"), || {
            let mut dx = zeros(s.input_len());
            // In bf16, W packed once for every span's product (each a run of its columns).
            let packed = PackedRhs::new(w, weight.precision);
            for span in &spans {
                let taps = span.tap * ci..(span.tap + span.len) * ci;
                par_matmul_packed(
                    &mut dx[span.q * ci..],
                    image_in,
                    g.col_range(span.p * co..(span.p + 1) * co),
                    w.col_range(taps.clone()),
                    packed.view(0..co, taps),
                    true,
                    weight.precision,
                );
            }
            dx
        })
    });
    ConvGrads {
        input: dx,
        weight: unpack(s, dw, weight.layout),
        bias: wanted.bias.then_some(db),
    }
}
