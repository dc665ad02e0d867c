//! Batch normalisation of channels-last rows (`[rows, channels]`, rows = N·H·W): statistics,
//! normalisation and the training gradient, each in one or two passes. A ResNet block's tail
//! (the residual add and the ReLU after the norm) is fused into the same passes; the fused
//! ReLU leaves a byte per element ([`ReluMask`]) for the backward, which reads it where it
//! would read the output.
//!
//! The per-block loops are compiled for the CPU's widest vectors (multiversion's runtime
//! dispatch). Sums run over fixed blocks of rows, each summed in f32, whose partial sums are
//! added in f64 in block order, so the result never depends on the thread count.

use std::mem::MaybeUninit;

use multiversion::multiversion;
use rayon::prelude::*;

use crate::scratch::{par_written, par_written_pair};

/// Rows per block of the passes and reductions, at most...
const BLOCK_ROWS: usize = 512;
/// ...and values per block, at most: ResNet's deep layers have few rows (32 images of 4×4 or
/// 2×2 pixels: 512 or 128) of many channels, and at 512 rows a block they were one block, run
/// on one thread.
const BLOCK_VALUES: usize = 1 << 16;

/// The values in a block of whole rows: fixed by the shape alone, so that the sums, added in
/// block order, never depend on the thread count.
fn block_len(channels: usize) -> usize {
    (BLOCK_VALUES / channels).clamp(1, BLOCK_ROWS) * channels
}

/// The batch's per-channel mean and (biased) variance.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchStats {
    pub mean: Vec<f32>,
    pub var: Vec<f32>,
}

/// Per-channel sums over the rows of `x`, `block_sums` adding one block of rows into a
/// per-channel accumulator; deterministic. A block (at most [`BLOCK_ROWS`] rows) sums in f32,
/// as PyTorch's CPU kernels do, and the blocks' sums are added in f64, in block order: summed
/// in f64 throughout, the conversions took a tenth of resnet50's norms.
fn channel_sums(
    x: &[f32],
    channels: usize,
    block_sums: impl Fn(&[f32], &mut [f32]) + Sync,
) -> Vec<f64> {
    let partials: Vec<Vec<f32>> = x
        .par_chunks(block_len(channels))
        .map(|block| {
            let mut acc = vec![0.0f32; channels];
            block_sums(block, &mut acc);
            acc
        })
        .collect();
    let mut total = vec![0.0f64; channels];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v as f64;
        }
    }
    total
}

/// Adds each channel's values over a block of rows into `acc`.
#[multiversion(targets = "simd")]
fn add_values(block: &[f32], acc: &mut [f32]) {
    for row in block.chunks_exact(acc.len()) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += *v;
        }
    }
}

/// Adds each channel's squared deviations from `mean` over a block of rows into `acc`.
#[multiversion(targets = "simd")]
fn add_squared_deviations(block: &[f32], mean: &[f32], acc: &mut [f32]) {
    for row in block.chunks_exact(acc.len()) {
        for ((a, v), m) in acc.iter_mut().zip(row).zip(mean) {
            let d = *v - m;
            *a += d * d;
        }
    }
}

pub fn batch_stats(x: &[f32], channels: usize) -> BatchStats {
    assert!(
        channels > 0 && x.len().is_multiple_of(channels),
        "rows of {channels} channels"
    );
    let rows = (x.len() / channels).max(1) as f64;
    let sum = channel_sums(x, channels, add_values);
    let mean: Vec<f64> = sum.iter().map(|s| s / rows).collect();
    let mean32: Vec<f32> = mean.iter().map(|m| *m as f32).collect();
    let sq = channel_sums(x, channels, |block, acc| {
        add_squared_deviations(block, &mean32, acc)
    });
    BatchStats {
        mean: mean.iter().map(|m| *m as f32).collect(),
        var: sq.iter().map(|s| (s / rows) as f32).collect(),
    }
}

/// Which elements of a fused ReLU's output are positive (the ones its gradient passes): a byte
/// each, 1 or 0, written by [`normalize`] beside the output. [`backward`] reads it instead of
/// the output, a quarter of the bytes: reading the output in both of the backward's passes, at
/// 4 bytes an element, was a third of its time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReluMask(Vec<u8>);

impl ReluMask {
    #[cfg(test)]
    /// The mask of an output `y` that a ReLU made: where `y > 0` (a NaN does not pass).
    pub(crate) fn of_output(y: &[f32]) -> Self {
        ReluMask(y.iter().map(|v| u8::from(*v > 0.0)).collect())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `y = (x - mean) / sqrt(var + eps) · gamma + beta`, plus `residual` when there is one, then
/// ReLU when `relu`: a ResNet block's tail in one pass. With the ReLU, also its mask, which is
/// exactly where `y > 0`.
pub fn normalize(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    stats: &BatchStats,
    eps: f64,
    residual: Option<&[f32]>,
    relu: bool,
) -> (Vec<f32>, Option<ReluMask>) {
    let channels = gamma.len();
    assert!(
        channels > 0 && x.len().is_multiple_of(channels),
        "rows of {channels} channels"
    );
    if let Some(r) = residual {
        assert_eq!(r.len(), x.len(), "batch norm residual size");
    }
    let (scale, shift): (Vec<f32>, Vec<f32>) = (0..channels)
        .map(|c| {
            let inv = 1.0 / (stats.var[c] as f64 + eps).sqrt();
            let a = gamma[c] as f64 * inv;
            (a as f32, (beta[c] as f64 - stats.mean[c] as f64 * a) as f32)
        })
        .unzip();
    let block = block_len(channels);
    let inputs = |i: usize, len: usize| {
        let x = &x[i * block..][..len];
        (x, residual.map(|r| &r[i * block..][..len]))
    };
    // SAFETY (both): `tail` and `tail_relu` write every element of their runs: their loops go
    // over the runs' whole rows (`block` and the length are multiples of `channels`, so every
    // run is whole rows).
    unsafe {
        if relu {
            let (y, mask) = par_written_pair(x.len(), block, |i, y, m| match inputs(i, y.len()) {
                (x, None) => tail_relu::<false>(y, m, x, x, &scale, &shift),
                (x, Some(r)) => tail_relu::<true>(y, m, x, r, &scale, &shift),
            });
            (y, Some(ReluMask(mask)))
        } else {
            let y = par_written(x.len(), block, |i, y| match inputs(i, y.len()) {
                (x, None) => tail::<false>(y, x, x, &scale, &shift),
                (x, Some(r)) => tail::<true>(y, x, r, &scale, &shift),
            });
            (y, None)
        }
    }
}

/// `y = x·scale + shift` per channel, `+ r` when `ADD`: one pass, one loop per case.
#[multiversion(targets = "simd")]
fn tail<const ADD: bool>(
    y: &mut [MaybeUninit<f32>],
    x: &[f32],
    r: &[f32],
    scale: &[f32],
    shift: &[f32],
) {
    let channels = scale.len();
    for ((yr, xr), rr) in y
        .chunks_exact_mut(channels)
        .zip(x.chunks_exact(channels))
        .zip(r.chunks_exact(channels))
    {
        for ((((o, v), rv), a), b) in yr.iter_mut().zip(xr).zip(rr).zip(scale).zip(shift) {
            o.write(if ADD { v * a + b + rv } else { v * a + b });
        }
    }
}

/// [`tail`], then the ReLU, its mask into `m`.
#[multiversion(targets = "simd")]
fn tail_relu<const ADD: bool>(
    y: &mut [MaybeUninit<f32>],
    m: &mut [MaybeUninit<u8>],
    x: &[f32],
    r: &[f32],
    scale: &[f32],
    shift: &[f32],
) {
    let channels = scale.len();
    for (((yr, mr), xr), rr) in y
        .chunks_exact_mut(channels)
        .zip(m.chunks_exact_mut(channels))
        .zip(x.chunks_exact(channels))
        .zip(r.chunks_exact(channels))
    {
        for (((((o, mo), v), rv), a), b) in
            yr.iter_mut().zip(mr).zip(xr).zip(rr).zip(scale).zip(shift)
        {
            let value = if ADD { v * a + b + rv } else { v * a + b };
            // `<`, not `max`: a NaN stays a NaN, as in PyTorch. The mask is `y > 0`: neither a
            // NaN, nor a zero (of either sign) passes.
            o.write(if value < 0.0 { 0.0 } else { value });
            mo.write(u8::from(value > 0.0));
        }
    }
}

/// Gradients of training-mode batch norm (statistics from the batch itself).
#[derive(Clone, Debug)]
pub struct NormGrads {
    pub input: Vec<f32>,
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
    /// The residual's gradient (the upstream gradient through the ReLU), when asked for.
    pub residual: Option<Vec<f32>>,
}

/// Gradients of [`normalize`] given `dy`. With the ReLU fused, `relu` is the forward's mask:
/// the gradient passes where the output was positive. `residual`: whether the forward added
/// one (its gradient is then returned too).
pub fn backward(
    x: &[f32],
    gamma: &[f32],
    stats: &BatchStats,
    eps: f64,
    dy: &[f32],
    relu: Option<&ReluMask>,
    residual: bool,
) -> NormGrads {
    let channels = gamma.len();
    assert!(
        channels > 0 && x.len().is_multiple_of(channels),
        "rows of {channels} channels"
    );
    assert_eq!(x.len(), dy.len(), "batch norm gradient size");
    if let Some(mask) = relu {
        assert_eq!(mask.len(), dy.len(), "batch norm ReLU mask size");
    }
    let block = block_len(channels);
    // Without the ReLU, `dy`'s bytes stand in for the mask (as long, or longer; never read).
    let (mask, masked) = match relu {
        Some(mask) => (&mask.0[..], true),
        None => (bytemuck::cast_slice(dy), false),
    };
    let rows = (x.len() / channels).max(1) as f64;
    let inv: Vec<f64> = stats
        .var
        .iter()
        .map(|v| 1.0 / (*v as f64 + eps).sqrt())
        .collect();
    let mean: Vec<f64> = stats.mean.iter().map(|m| *m as f64).collect();
    // Σ g and Σ g·(x - mean) in one pass, g the upstream gradient through the ReLU; each block
    // in f32, the blocks added in f64 (as `channel_sums`).
    let pairs: Vec<(Vec<f32>, Vec<f32>)> = x
        .par_chunks(block)
        .zip(dy.par_chunks(block).zip(mask.par_chunks(block)))
        .map(|(x, (dy, mask))| {
            let (mut sd, mut sdx) = (vec![0.0f32; channels], vec![0.0f32; channels]);
            if masked {
                gradient_sums::<true>(x, dy, mask, &stats.mean, &mut sd, &mut sdx);
            } else {
                gradient_sums::<false>(x, dy, mask, &stats.mean, &mut sd, &mut sdx);
            }
            (sd, sdx)
        })
        .collect();
    let (mut dbeta, mut dgamma) = (vec![0.0f64; channels], vec![0.0f64; channels]);
    for (sd, sdx) in pairs {
        for c in 0..channels {
            dbeta[c] += sd[c] as f64;
            dgamma[c] += sdx[c] as f64;
        }
    }
    // Σ g·x̂ = Σ g·(x - mean) / σ.
    for (d, i) in dgamma.iter_mut().zip(&inv) {
        *d *= i;
    }
    // dx = gamma·inv/rows · (rows·g - Σg - x̂·Σg·x̂), as x·a + g·b + c per channel.
    let mut coefficients = [
        vec![0.0f32; channels],
        vec![0.0f32; channels],
        vec![0.0f32; channels],
    ];
    for ch in 0..channels {
        let f = gamma[ch] as f64 * inv[ch];
        let xa = -f * dgamma[ch] * inv[ch] / rows; // coefficient of (x - mean)
        coefficients[0][ch] = xa as f32;
        coefficients[1][ch] = f as f32;
        coefficients[2][ch] = (-f * dbeta[ch] / rows - xa * mean[ch]) as f32;
    }
    let write = |i: usize, dx: &mut [MaybeUninit<f32>], dr: Option<&mut [MaybeUninit<f32>]>| {
        let [x, dy] = [x, dy].map(|v| &v[i * block..][..dx.len()]);
        let mask = &mask[i * block..][..dx.len()];
        if masked {
            input_gradient::<true>(dx, dr, x, dy, mask, &coefficients);
        } else {
            input_gradient::<false>(dx, dr, x, dy, mask, &coefficients);
        }
    };
    // The residual's gradient is g itself: written in the same pass.
    // SAFETY: `input_gradient` writes every element of its runs: its loops go over the runs'
    // whole rows (`block` and the length are multiples of `channels`), and over all of `dr`.
    let (dx, dr) = unsafe {
        if residual {
            let (dx, dr) = par_written_pair(x.len(), block, |i, dx, dr| write(i, dx, Some(dr)));
            (dx, Some(dr))
        } else {
            (
                par_written(x.len(), block, |i, dx| write(i, dx, None)),
                None,
            )
        }
    };
    NormGrads {
        input: dx,
        gamma: dgamma.iter().map(|v| *v as f32).collect(),
        beta: dbeta.iter().map(|v| *v as f32).collect(),
        residual: dr,
    }
}

/// `dy` where the output passed the ReLU (`mask` not 0) when `MASK`, else `dy`.
#[inline(always)]
fn through_relu<const MASK: bool>(dy: f32, mask: u8) -> f32 {
    if !MASK || mask != 0 { dy } else { 0.0 }
}

/// Adds Σ g and Σ g·(x - mean) per channel over a block of rows to `sd` and `sdx`.
#[multiversion(targets = "simd")]
fn gradient_sums<const MASK: bool>(
    x: &[f32],
    dy: &[f32],
    mask: &[u8],
    mean: &[f32],
    sd: &mut [f32],
    sdx: &mut [f32],
) {
    let channels = mean.len();
    for ((xr, gr), mr) in x
        .chunks_exact(channels)
        .zip(dy.chunks_exact(channels))
        .zip(mask.chunks_exact(channels))
    {
        for ((((s, sx), (&xv, &d)), &pass), m) in sd
            .iter_mut()
            .zip(sdx.iter_mut())
            .zip(xr.iter().zip(gr))
            .zip(mr)
            .zip(mean)
        {
            let g = through_relu::<MASK>(d, pass);
            *s += g;
            *sx += g * (xv - m);
        }
    }
}

/// `dx = x·a + g·b + k` per channel over a block of rows, `[a, b, k]` the coefficients; `g`
/// into `dr` too when there is one.
#[multiversion(targets = "simd")]
fn input_gradient<const MASK: bool>(
    dx: &mut [MaybeUninit<f32>],
    dr: Option<&mut [MaybeUninit<f32>]>,
    x: &[f32],
    dy: &[f32],
    mask: &[u8],
    [a, b, k]: &[Vec<f32>; 3],
) {
    let channels = a.len();
    for (((o, xr), gr), mr) in dx
        .chunks_exact_mut(channels)
        .zip(x.chunks_exact(channels))
        .zip(dy.chunks_exact(channels))
        .zip(mask.chunks_exact(channels))
    {
        for (((o, &xv), (&d, &pass)), ((a, b), k)) in o
            .iter_mut()
            .zip(xr)
            .zip(gr.iter().zip(mr))
            .zip(a.iter().zip(b).zip(k))
        {
            o.write(xv * a + through_relu::<MASK>(d, pass) * b + k);
        }
    }
    if let Some(dr) = dr {
        assert_eq!(dr.len(), dy.len(), "residual gradient run");
        for ((g, &d), &pass) in dr.iter_mut().zip(dy).zip(mask) {
            g.write(through_relu::<MASK>(d, pass));
        }
    }
}
