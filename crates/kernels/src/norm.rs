//! Batch normalisation of channels-last rows (`[rows, channels]`, rows = N·H·W): statistics,
//! normalisation and the training gradient, each in one or two passes.
//!
//! Sums run over fixed blocks of rows whose partial sums (f64) are added in block order, so the
//! result never depends on the thread count.

use rayon::prelude::*;

/// Rows per block of the reductions.
const BLOCK_ROWS: usize = 512;

/// The batch's per-channel mean and (biased) variance.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchStats {
    pub mean: Vec<f32>,
    pub var: Vec<f32>,
}

/// Per-channel sums over the rows of `x` of `f(row_values, channel_index)`, deterministic.
fn channel_sums(x: &[f32], channels: usize, f: impl Fn(&mut [f64], &[f32]) + Sync) -> Vec<f64> {
    let partials: Vec<Vec<f64>> = x
        .par_chunks(BLOCK_ROWS * channels)
        .map(|block| {
            let mut acc = vec![0.0f64; channels];
            for row in block.chunks_exact(channels) {
                f(&mut acc, row);
            }
            acc
        })
        .collect();
    let mut total = vec![0.0f64; channels];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

pub fn batch_stats(x: &[f32], channels: usize) -> BatchStats {
    assert!(
        channels > 0 && x.len().is_multiple_of(channels),
        "rows of {channels} channels"
    );
    let rows = (x.len() / channels).max(1) as f64;
    let sum = channel_sums(x, channels, |acc, row| {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += *v as f64;
        }
    });
    let mean: Vec<f64> = sum.iter().map(|s| s / rows).collect();
    let sq = channel_sums(x, channels, |acc, row| {
        for ((a, v), m) in acc.iter_mut().zip(row).zip(&mean) {
            let d = *v as f64 - m;
            *a += d * d;
        }
    });
    BatchStats {
        mean: mean.iter().map(|m| *m as f32).collect(),
        var: sq.iter().map(|s| (s / rows) as f32).collect(),
    }
}

/// `y = (x - mean) / sqrt(var + eps) · gamma + beta`.
pub fn normalize(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    mean: &[f32],
    var: &[f32],
    eps: f64,
) -> Vec<f32> {
    let channels = gamma.len();
    let (scale, shift): (Vec<f32>, Vec<f32>) = (0..channels)
        .map(|c| {
            let inv = 1.0 / (var[c] as f64 + eps).sqrt();
            let a = gamma[c] as f64 * inv;
            (a as f32, (beta[c] as f64 - mean[c] as f64 * a) as f32)
        })
        .unzip();
    let mut y = vec![0.0f32; x.len()];
    y.par_chunks_mut(BLOCK_ROWS * channels)
        .zip(x.par_chunks(BLOCK_ROWS * channels))
        .for_each(|(y, x)| {
            for (yr, xr) in y.chunks_exact_mut(channels).zip(x.chunks_exact(channels)) {
                for (((o, v), a), b) in yr.iter_mut().zip(xr).zip(&scale).zip(&shift) {
                    *o = v * a + b;
                }
            }
        });
    y
}

/// Gradients of training-mode batch norm (statistics from the batch itself).
#[derive(Clone, Debug)]
pub struct NormGrads {
    pub input: Vec<f32>,
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
}

pub fn backward(x: &[f32], gamma: &[f32], stats: &BatchStats, eps: f64, dy: &[f32]) -> NormGrads {
    let channels = gamma.len();
    assert_eq!(x.len(), dy.len(), "batch norm gradient size");
    let rows = (x.len() / channels).max(1) as f64;
    let inv: Vec<f64> = stats
        .var
        .iter()
        .map(|v| 1.0 / (*v as f64 + eps).sqrt())
        .collect();
    let mean: Vec<f64> = stats.mean.iter().map(|m| *m as f64).collect();
    // Σ dy and Σ dy·x̂ in one pass over both.
    let pairs: Vec<(Vec<f64>, Vec<f64>)> = x
        .par_chunks(BLOCK_ROWS * channels)
        .zip(dy.par_chunks(BLOCK_ROWS * channels))
        .map(|(x, dy)| {
            let (mut sd, mut sdx) = (vec![0.0f64; channels], vec![0.0f64; channels]);
            for (xr, gr) in x.chunks_exact(channels).zip(dy.chunks_exact(channels)) {
                for ((((d, dx), &xv), &g), (m, i)) in sd
                    .iter_mut()
                    .zip(sdx.iter_mut())
                    .zip(xr)
                    .zip(gr)
                    .zip(mean.iter().zip(&inv))
                {
                    let g = g as f64;
                    *d += g;
                    *dx += g * (xv as f64 - m) * i;
                }
            }
            (sd, sdx)
        })
        .collect();
    let (mut dbeta, mut dgamma) = (vec![0.0f64; channels], vec![0.0f64; channels]);
    for (sd, sdx) in pairs {
        for c in 0..channels {
            dbeta[c] += sd[c];
            dgamma[c] += sdx[c];
        }
    }
    // dx = gamma·inv/rows · (rows·dy - Σdy - x̂·Σdy·x̂), as x·a + dy·b + c per channel.
    let mut a = vec![0.0f32; channels];
    let mut b = vec![0.0f32; channels];
    let mut k = vec![0.0f32; channels];
    for ch in 0..channels {
        let f = gamma[ch] as f64 * inv[ch];
        let xa = -f * dgamma[ch] * inv[ch] / rows; // coefficient of (x - mean)
        a[ch] = xa as f32;
        b[ch] = f as f32;
        k[ch] = (-f * dbeta[ch] / rows - xa * mean[ch]) as f32;
    }
    let mut dx = vec![0.0f32; x.len()];
    dx.par_chunks_mut(BLOCK_ROWS * channels)
        .zip(
            x.par_chunks(BLOCK_ROWS * channels)
                .zip(dy.par_chunks(BLOCK_ROWS * channels)),
        )
        .for_each(|(dx, (x, dy))| {
            for ((o, xr), gr) in dx
                .chunks_exact_mut(channels)
                .zip(x.chunks_exact(channels))
                .zip(dy.chunks_exact(channels))
            {
                for ((((o, &xv), &g), (&a, &b)), &k) in
                    o.iter_mut().zip(xr).zip(gr).zip(a.iter().zip(&b)).zip(&k)
                {
                    *o = xv * a + g * b + k;
                }
            }
        });
    NormGrads {
        input: dx,
        gamma: dgamma.iter().map(|v| *v as f32).collect(),
        beta: dbeta.iter().map(|v| *v as f32).collect(),
    }
}
