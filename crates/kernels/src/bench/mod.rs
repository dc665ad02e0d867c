//! The kernels' benchmark behind `trainctl bench --layers`: each convolution of a network (the
//! seed CNN's, or the shapes a ResNet's step used) timed alone by each algorithm that computes
//! it, with the error of Winograd and of the direct convolution against im2col; and behind
//! `trainctl bench --gemm`, the GEMM alone (module `gemm`).

use std::time::Instant;

mod gemm;
pub use gemm::{GemmLine, RESNET_SHAPES, Shape, gemm_report};

use crate::conv::{self, Algorithm, ConvShape, Prepared, Wanted, Weight};
use crate::conv::{direct, winograd};
use crate::matmul::Precision;

/// Forward and backward (both gradients) time of one algorithm on one layer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AlgorithmTimes {
    pub forward_s: f64,
    pub backward_s: f64,
    /// GFLOP/s of im2col's arithmetic (2·MACs over every tap, padding included; the backward
    /// twice the forward): comparable across algorithms, so Winograd and the direct
    /// convolution, which do less of it, can exceed the machine's peak.
    pub gflops_per_s: f64,
}

/// One convolution at its place in the network, by each of trainctl's algorithms that
/// computes it (Winograd: stride-1 3×3 layers only; direct: outputs of at most
/// `direct::MAX_OUTPUT_PIXELS` pixels, beyond which it loses to both).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerTimes {
    pub layer: String,
    /// `[batch, c_in, height, width]`.
    pub input: [usize; 4],
    pub c_out: usize,
    pub kernel: usize,
    pub stride: usize,
    /// What the training step uses for this shape.
    pub chosen: &'static str,
    pub im2col: AlgorithmTimes,
    /// Winograd F(2×2, 3×3) and F(4×4, 3×3).
    pub winograd: Option<AlgorithmTimes>,
    pub winograd4: Option<AlgorithmTimes>,
    pub direct: Option<AlgorithmTimes>,
    /// Largest difference between Winograd's and im2col's forward output and gradients,
    /// relative to the largest magnitude of each.
    pub winograd_error: Option<f64>,
    pub winograd4_error: Option<f64>,
    /// The same for the direct convolution.
    pub direct_error: Option<f64>,
}

/// The seed CNN's convolutions: (name, c_in, c_out, spatial size).
pub const CONV_LAYERS: [(&str, usize, usize, usize); 6] = [
    ("network.0", 3, 32, 32),
    ("network.2", 32, 64, 32),
    ("network.6", 64, 128, 16),
    ("network.8", 128, 128, 16),
    ("network.12", 128, 256, 8),
    ("network.14", 256, 256, 8),
];

/// The seed CNN's convolutions at `batch_size`, named.
pub fn seed_cnn_layers(batch_size: usize) -> Vec<(String, ConvShape)> {
    CONV_LAYERS
        .iter()
        .map(|&(name, c_in, c_out, size)| {
            (
                name.to_string(),
                ConvShape::same_3x3(batch_size, c_in, c_out, size),
            )
        })
        .collect()
}

/// Times each convolution's kernels alone (median of `repeats` after one warm-up), forward with
/// bias and ReLU, backward with both gradients, on random data.
pub fn conv_layers(
    threads: usize,
    layers: &[(String, ConvShape)],
    repeats: usize,
    precision: Precision,
) -> Vec<LayerTimes> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .expect("a thread pool of a few threads");
    pool.install(|| {
        layers
            .iter()
            .map(|(name, shape)| layer_times(name, *shape, repeats, precision))
            .collect()
    })
}

/// One convolution timed by each algorithm that applies, and each one's largest error against
/// im2col's.
fn layer_times(name: &str, shape: ConvShape, repeats: usize, precision: Precision) -> LayerTimes {
    let (c_in, c_out) = (shape.c_in, shape.c_out);
    let x = random(shape.input_len(), 1);
    let w: Vec<f32> = random(shape.weight_len(), 2)
        .iter()
        .map(|v| v / (shape.k() as f32).sqrt())
        .collect();
    let bias = random(c_out, 3);
    let dy = random(shape.output_len(), 4);
    let flops = 2.0 * (shape.output_len() * shape.k()) as f64;
    let time = |prepared: &Prepared| {
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for i in 0..repeats + 1 {
            let t0 = Instant::now();
            let y = conv::forward(&shape, &x, prepared, Some(&bias), true);
            let t1 = Instant::now();
            let g = conv::backward(&shape, &x, prepared, Some(&y), &dy, Wanted::ALL);
            let t2 = Instant::now();
            assert!(g.weight.iter().all(|v| v.is_finite()));
            if i > 0 {
                fwd.push((t1 - t0).as_secs_f64());
                bwd.push((t2 - t1).as_secs_f64());
            }
        }
        let (forward_s, backward_s) = (median(fwd), median(bwd));
        AlgorithmTimes {
            forward_s,
            backward_s,
            gflops_per_s: 3.0 * flops / (forward_s + backward_s) / 1e9,
        }
    };
    // Each algorithm in the precision it would run in (F(4×4) in fp32 always).
    let prepare = |algorithm: Algorithm| {
        Prepared::with(algorithm, &shape, Weight::torch(&w))
            .in_precision(algorithm.precision(precision))
    };
    let im2col = prepare(Algorithm::Im2col);
    let winograd = |algorithm| winograd::applies(&shape, 1).then(|| prepare(algorithm));
    let (winograd, winograd4) = (
        winograd(Algorithm::Winograd),
        winograd(Algorithm::Winograd4),
    );
    let [oh, ow] = shape.out_size();
    let direct = (oh * ow <= direct::MAX_OUTPUT_PIXELS).then(|| prepare(Algorithm::Direct));
    // The error without the ReLU: through it, an output of ±1e-7 either side of zero
    // passes the whole upstream gradient or none of it, in either algorithm.
    let plain = |prepared: &Prepared| {
        let y = conv::forward(&shape, &x, prepared, Some(&bias), false);
        let g = conv::backward(&shape, &x, prepared, None, &dy, Wanted::ALL);
        (y, g)
    };
    let (y1, g1) = plain(&im2col);
    let error = |other: &Prepared| {
        let (y2, g2) = plain(other);
        largest_error((&y2, &g2), (&y1, &g1))
    };
    let (winograd_error, winograd4_error, direct_error) = (
        winograd.as_ref().map(error),
        winograd4.as_ref().map(error),
        direct.as_ref().map(error),
    );
    LayerTimes {
        layer: name.to_string(),
        input: [shape.batch, c_in, shape.height, shape.width],
        c_out,
        kernel: shape.kernel[0],
        stride: shape.stride[0],
        chosen: Algorithm::of(&shape).name(),
        im2col: time(&im2col),
        winograd: winograd.as_ref().map(time),
        winograd4: winograd4.as_ref().map(time),
        direct: direct.as_ref().map(time),
        winograd_error,
        winograd4_error,
        direct_error,
    }
}

/// The largest difference between `other`'s output and gradients and `reference`'s, relative
/// to the largest value of the reference's.
fn largest_error(other: (&[f32], &conv::ConvGrads), reference: (&[f32], &conv::ConvGrads)) -> f64 {
    let relative = |a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max)
            / scale
    };
    let (y2, g2) = other;
    let (y1, g1) = reference;
    [
        relative(y2, y1),
        relative(
            g2.input.as_deref().unwrap_or(&[]),
            g1.input.as_deref().unwrap_or(&[]),
        ),
        relative(&g2.weight, &g1.weight),
        relative(
            g2.bias.as_deref().unwrap_or(&[]),
            g1.bias.as_deref().unwrap_or(&[]),
        ),
    ]
    .into_iter()
    .fold(0.0f32, f32::max) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Uniform in [-1, 1), reproducible from `seed` (a 64-bit LCG: no dependency; benchmarks and
/// the kernels' tests need no better).
pub(crate) fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}
