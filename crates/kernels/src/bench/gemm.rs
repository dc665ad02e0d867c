//! `trainctl bench --gemm`: the GEMM alone on the shapes the ResNets' convolutions give it, in
//! fp32 and bf16, against this core's multiply-add peak measured by a loop of independent
//! multiply-adds (not computed from a clock and a datasheet: this machine's AVX-512 FMA turned
//! out to run at the AVX2 rate, half what the datasheet figure assumed).

use std::time::Instant;

use super::{median, random};
use crate::matmul::{Mat, Precision, matmul};

/// One GEMM of a ResNet's step at batch 32 and 64×64 images, as the kernels call it.
pub struct Shape {
    pub name: &'static str,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// The left-hand side transposed, as the weight gradients take it (`dYᵀ · patches`).
    pub lhs_transposed: bool,
}

/// The GEMMs that take most of a ResNet step (docs/PERFORMANCE.md's layer table): Winograd's
/// 16 or 36 per chunk (rows: 2×2 or 4×4 tiles of a chunk of images; fp32 takes 4×4 tiles from
/// 8×8 outputs, bf16 2×2 everywhere), the direct layers' per-span products (rows: the batch),
/// im2col's stem and the 1×1 layers (rows: output pixels of a chunk).
pub const RESNET_SHAPES: [Shape; 11] = [
    shape("resnet18 winograd 64->64 at 16x16", 2048, 64, 64, false),
    shape("resnet18 winograd 128->128 at 8x8", 512, 128, 128, false),
    shape("resnet18 winograd4 64->64 at 16x16", 320, 64, 64, false),
    shape("resnet18 winograd4 128->128 at 8x8", 128, 128, 128, false),
    shape("resnet18 winograd 256->256 at 4x4", 128, 256, 256, false),
    shape(
        "resnet18 direct 512->512 at 2x2, a span",
        32,
        512,
        1024,
        false,
    ),
    shape(
        "resnet18 direct 512->512 weight gradient",
        512,
        512,
        128,
        true,
    ),
    shape("resnet18 stem 7x7/2 (im2col)", 4096, 64, 147, false),
    shape("resnet50 1x1 64->256 at 16x16", 4096, 256, 64, false),
    shape("resnet50 1x1 256->64 at 16x16", 4096, 64, 256, false),
    shape("resnet50 1x1 weight gradient 256->64", 64, 256, 4096, true),
];

const fn shape(name: &'static str, m: usize, n: usize, k: usize, lhs_transposed: bool) -> Shape {
    Shape {
        name,
        m,
        n,
        k,
        lhs_transposed,
    }
}

/// One line of `trainctl bench --gemm`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(untagged)]
pub enum GemmLine {
    /// One core's multiply-add peak, GFLOP/s (2 per multiply-add).
    Peak {
        fp32_peak_gflops: f64,
        bf16_peak_gflops: Option<f64>,
    },
    /// One shape, one thread.
    Shape {
        gemm: &'static str,
        m: usize,
        n: usize,
        k: usize,
        fp32_gflops: f64,
        fp32_of_peak: f64,
        bf16_gflops: Option<f64>,
        bf16_of_peak: Option<f64>,
        bf16_over_fp32: Option<f64>,
    },
}

/// The peaks, then each of [`RESNET_SHAPES`] timed on the calling thread (median of `repeats`
/// runs of at least 50 ms each), fp32 and, where the CPU has it, bf16.
pub fn gemm_report(repeats: usize) -> Vec<GemmLine> {
    let bf16 = crate::matmul::available(Precision::Bf16);
    let fp32_peak = peak(Precision::F32).unwrap_or(f64::NAN);
    let bf16_peak = bf16.then(|| peak(Precision::Bf16)).flatten();
    let mut lines = vec![GemmLine::Peak {
        fp32_peak_gflops: fp32_peak,
        bf16_peak_gflops: bf16_peak,
    }];
    for s in &RESNET_SHAPES {
        let fp32 = gflops(s, Precision::F32, repeats);
        let low = bf16.then(|| gflops(s, Precision::Bf16, repeats));
        lines.push(GemmLine::Shape {
            gemm: s.name,
            m: s.m,
            n: s.n,
            k: s.k,
            fp32_gflops: fp32,
            fp32_of_peak: fp32 / fp32_peak,
            bf16_gflops: low,
            bf16_of_peak: low.zip(bf16_peak).map(|(g, p)| g / p),
            bf16_over_fp32: low.map(|g| g / fp32),
        });
    }
    lines
}

/// GFLOP/s of one shape at `precision` on the calling thread.
fn gflops(s: &Shape, precision: Precision, repeats: usize) -> f64 {
    let a = random(s.m * s.k, 1);
    let b = random(s.k * s.n, 2);
    let lhs = if s.lhs_transposed {
        Mat::rows(&a, s.k, s.m).t()
    } else {
        Mat::rows(&a, s.m, s.k)
    };
    let rhs = Mat::rows(&b, s.k, s.n);
    let mut c = vec![0.0; s.m * s.n];
    let flops = 2.0 * (s.m * s.n * s.k) as f64;
    let reps = ((1e8 / flops).ceil() as usize).max(1);
    let mut rates = Vec::new();
    for i in 0..repeats.max(1) + 1 {
        let t = Instant::now();
        for _ in 0..reps {
            matmul(&mut c, s.n, lhs, rhs, false, precision);
        }
        if i > 0 {
            rates.push(flops * reps as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    std::hint::black_box(&c);
    median(rates)
}

/// One core's multiply-add peak at `precision` (GFLOP/s): 24 independent chains of the widest
/// multiply-add this CPU has, so that neither latency nor memory limits it.
fn peak(precision: Precision) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let iterations = 20_000_000;
        let (flops_per_iteration, run): (f64, unsafe fn(usize) -> f32) = match precision {
            Precision::Bf16 if crate::matmul::available(Precision::Bf16) => {
                (24.0 * 64.0, x86::bf16_chains)
            }
            Precision::F32 if std::arch::is_x86_feature_detected!("avx512f") => {
                (24.0 * 32.0, x86::avx512_chains)
            }
            Precision::F32
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma") =>
            {
                (12.0 * 16.0, x86::avx2_chains)
            }
            _ => return None,
        };
        let mut best = 0.0f64;
        for _ in 0..3 {
            let t = Instant::now();
            // SAFETY: the match above checked the features each loop needs.
            std::hint::black_box(unsafe { run(iterations) });
            best = best.max(flops_per_iteration * iterations as f64 / t.elapsed().as_secs_f64());
        }
        Some(best / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = precision;
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512_chains(iterations: usize) -> f32 {
        // Inputs the compiler cannot see, so that it cannot fold the chains away.
        let mut r = [_mm512_set1_ps(black_box(1.0)); 24];
        let (a, b) = (_mm512_set1_ps(black_box(0.999_999)), _mm512_set1_ps(1e-7));
        for _ in 0..iterations {
            for r in r.iter_mut() {
                *r = _mm512_fmadd_ps(*r, a, b);
            }
        }
        _mm512_reduce_add_ps(
            r.iter()
                .fold(_mm512_setzero_ps(), |s, v| _mm512_add_ps(s, *v)),
        )
    }

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2_chains(iterations: usize) -> f32 {
        let mut r = [_mm256_set1_ps(black_box(1.0)); 12];
        let (a, b) = (_mm256_set1_ps(black_box(0.999_999)), _mm256_set1_ps(1e-7));
        for _ in 0..iterations {
            for r in r.iter_mut() {
                *r = _mm256_fmadd_ps(*r, a, b);
            }
        }
        let mut out = [0.0f32; 8];
        let sum = r
            .iter()
            .fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v));
        // SAFETY: 8 floats into an array of 8.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }

    /// # Safety
    /// AVX512_BF16 (with AVX-512F).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_chains(iterations: usize) -> f32 {
        // Inputs the compiler cannot see: with constants it folds the whole loop (1 + 2e-14
        // rounds back to 1, a fixed point).
        let mut r = [_mm512_set1_ps(black_box(1.0)); 24];
        let tiny = _mm512_set1_ps(black_box(1e-7));
        let small = _mm512_cvtne2ps_pbh(tiny, tiny);
        for _ in 0..iterations {
            for r in r.iter_mut() {
                *r = _mm512_dpbf16_ps(*r, small, small);
            }
        }
        _mm512_reduce_add_ps(
            r.iter()
                .fold(_mm512_setzero_ps(), |s, v| _mm512_add_ps(s, *v)),
        )
    }
}
