//! The kernels against a direct convolution computed in f64, on the seed CNN's shapes and on
//! random ones (batch 1, odd sizes, strides, 1×1 and 7×7 kernels, any padding).

use proptest::prelude::*;

use crate::conv::winograd;
use crate::conv::{self, Algorithm, ConvShape, Prepared, Wanted, Weight};
use crate::matmul;
use crate::matmul::Precision;

/// Direct convolution, NHWC input, PyTorch-layout weight, f64 sums.
fn reference_forward(s: &ConvShape, x: &[f32], w: &[f32], b: &[f32], relu: bool) -> Vec<f64> {
    let [oh, ow] = s.out_size();
    let [kh, kw] = s.kernel;
    let mut out = vec![0.0f64; s.output_len()];
    for n in 0..s.batch {
        for oy in 0..oh {
            for ox in 0..ow {
                for o in 0..s.c_out {
                    let mut acc = b[o] as f64;
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * s.stride[0] + ky) as isize - s.padding[0] as isize;
                            let ix = (ox * s.stride[1] + kx) as isize - s.padding[1] as isize;
                            if iy < 0 || ix < 0 || iy >= s.height as isize || ix >= s.width as isize
                            {
                                continue;
                            }
                            for c in 0..s.c_in {
                                let xv = x[((n * s.height + iy as usize) * s.width + ix as usize)
                                    * s.c_in
                                    + c];
                                let wv = w[((o * s.c_in + c) * kh + ky) * kw + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    out[((n * oh + oy) * ow + ox) * s.c_out + o] =
                        if relu { acc.max(0.0) } else { acc };
                }
            }
        }
    }
    out
}

/// Reference gradients (input, weight in PyTorch's layout, bias) for the upstream gradient `g`
/// (already masked by the ReLU when there is one).
fn reference_backward(
    s: &ConvShape,
    x: &[f32],
    w: &[f32],
    g: &[f32],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let [oh, ow] = s.out_size();
    let [kh, kw] = s.kernel;
    let mut dx = vec![0.0f64; s.input_len()];
    let mut dw = vec![0.0f64; s.weight_len()];
    let mut db = vec![0.0f64; s.c_out];
    for n in 0..s.batch {
        for oy in 0..oh {
            for ox in 0..ow {
                for o in 0..s.c_out {
                    let gv = g[((n * oh + oy) * ow + ox) * s.c_out + o] as f64;
                    db[o] += gv;
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * s.stride[0] + ky) as isize - s.padding[0] as isize;
                            let ix = (ox * s.stride[1] + kx) as isize - s.padding[1] as isize;
                            if iy < 0 || ix < 0 || iy >= s.height as isize || ix >= s.width as isize
                            {
                                continue;
                            }
                            for c in 0..s.c_in {
                                let xi = ((n * s.height + iy as usize) * s.width + ix as usize)
                                    * s.c_in
                                    + c;
                                let wi = ((o * s.c_in + c) * kh + ky) * kw + kx;
                                dx[xi] += gv * w[wi] as f64;
                                dw[wi] += gv * x[xi] as f64;
                            }
                        }
                    }
                }
            }
        }
    }
    (dx, dw, db)
}

fn values(len: usize, seed: u64) -> Vec<f32> {
    crate::bench::random(len, seed)
}

/// Largest |a - b| relative to the largest |b| (at least 1).
fn worst_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max)
        / scale
}

/// f32 against f64 sums over at most a few thousand terms: a few ulps of the scale.
const TOLERANCE: f64 = 1e-5;

fn check(s: ConvShape, relu: bool, seed: u64) {
    check_with(s, relu, seed, Algorithm::of(&s))
}

/// F(4×4, 3×3)'s transforms scale values by up to 8 and 1/24 on the way: its error is 10–20×
/// the others' (1–3e-5 of the scale on ResNet layers, `trainctl bench --layers`), as in
/// every Winograd of that tile size.
const WINOGRAD4_TOLERANCE: f64 = 1e-4;

fn check_with(s: ConvShape, relu: bool, seed: u64, algorithm: Algorithm) {
    let tolerance = match algorithm {
        Algorithm::Winograd4 => WINOGRAD4_TOLERANCE,
        _ => TOLERANCE,
    };
    check_in(s, relu, seed, algorithm, Precision::F32, tolerance)
}

fn check_in(
    s: ConvShape,
    relu: bool,
    seed: u64,
    algorithm: Algorithm,
    precision: Precision,
    tolerance: f64,
) {
    s.validate().unwrap();
    let x = values(s.input_len(), seed);
    let w = values(s.weight_len(), seed + 1);
    let b = values(s.c_out, seed + 2);
    let dy = values(s.output_len(), seed + 3);
    let packed = Prepared::with(algorithm, &s, Weight::torch(&w)).in_precision(precision);

    let y = conv::forward(&s, &x, &packed, Some(&b), relu);
    let want = reference_forward(&s, &x, &w, &b, relu);
    let e = worst_error(&y, &want);
    assert!(e < tolerance, "forward error {e} for {s:?} ({algorithm:?})");

    let grads = conv::backward(&s, &x, &packed, relu.then_some(&y[..]), &dy, Wanted::ALL);
    let g: Vec<f32> = if relu {
        dy.iter()
            .zip(&y)
            .map(|(d, o)| if *o > 0.0 { *d } else { 0.0 })
            .collect()
    } else {
        dy.clone()
    };
    let (dx, dw, db) = reference_backward(&s, &x, &w, &g);
    let e = worst_error(grads.input.as_ref().unwrap(), &dx);
    assert!(
        e < tolerance,
        "input-gradient error {e} for {s:?} ({algorithm:?})"
    );
    let e = worst_error(&grads.weight, &dw);
    assert!(
        e < tolerance,
        "weight-gradient error {e} for {s:?} ({algorithm:?})"
    );
    let e = worst_error(grads.bias.as_deref().expect("wanted"), &db);
    assert!(
        e < tolerance,
        "bias-gradient error {e} for {s:?} ({algorithm:?})"
    );
}

fn shape3x3(batch: usize, c_in: usize, c_out: usize, size: usize) -> ConvShape {
    ConvShape::same_3x3(batch, c_in, c_out, size)
}

/// The multiply-adds each algorithm's GEMMs do, per channel pair and image: a 3×3 layer at
/// 16×16 (padding 1: 46 of the 48 kernel rows and columns a row or column of outputs meets lie
/// inside) and at 2×2 (every output pixel meets 4 of its 9 taps inside the image).
#[test]
fn each_algorithm_counts_the_multiply_adds_its_gemms_do() {
    for (s, [im2col, winograd, winograd4, direct]) in [
        (
            shape3x3(3, 64, 32, 16),
            [256 * 9, 64 * 16, 16 * 36, 46 * 46],
        ),
        (shape3x3(2, 512, 256, 2), [4 * 9, 16, 36, 16]),
    ] {
        let pairs = s.batch * s.c_in * s.c_out;
        for (algorithm, per_pair) in [
            (Algorithm::Im2col, im2col),
            (Algorithm::Winograd, winograd),
            (Algorithm::Winograd4, winograd4),
            (Algorithm::Direct, direct),
        ] {
            assert_eq!(
                algorithm.multiply_adds(&s),
                per_pair * pairs,
                "{} at {}×{}",
                algorithm.name(),
                s.height,
                s.width
            );
        }
    }
}

#[test]
fn seed_cnn_layers_match_the_direct_convolution() {
    // The seed CNN's six convolutions, at a small batch (the reference is slow).
    for (c_in, c_out, size) in [
        (3, 32, 32),
        (32, 64, 32),
        (64, 128, 16),
        (128, 128, 16),
        (128, 256, 8),
        (256, 256, 8),
    ] {
        check(shape3x3(2, c_in, c_out, size), true, c_in as u64);
        check_with(
            shape3x3(2, c_in, c_out, size),
            true,
            c_in as u64,
            Algorithm::Im2col,
        );
    }
}

#[test]
fn resnet_shapes_match_the_direct_convolution() {
    // The 7×7 stride-2 stem, a 1×1 stride-2 projection, a 3×3 stride-2 downsampling.
    let stem = ConvShape {
        kernel: [7, 7],
        stride: [2, 2],
        padding: [3, 3],
        ..shape3x3(2, 3, 8, 20)
    };
    let proj = ConvShape {
        kernel: [1, 1],
        stride: [2, 2],
        padding: [0, 0],
        ..shape3x3(3, 16, 32, 9)
    };
    let down = ConvShape {
        stride: [2, 2],
        ..shape3x3(2, 8, 16, 11)
    };
    // A bottleneck's 1×1 stride-1 layers: the input is the im2col matrix as it lies.
    let pointwise = ConvShape {
        kernel: [1, 1],
        padding: [0, 0],
        ..shape3x3(3, 24, 40, 7)
    };
    assert!(pointwise.is_pointwise());
    for (i, s) in [stem, proj, down, pointwise].into_iter().enumerate() {
        check(s, false, 100 + i as u64);
    }
}

/// Forward and all gradients of `s` with each algorithm that computes it, at 1 thread and at 2,
/// 3 and 5: bit for bit the same.
fn assert_bit_identical_at_any_thread_count(s: ConvShape) {
    let x = values(s.input_len(), 7);
    let w = values(s.weight_len(), 8);
    let dy = values(s.output_len(), 9);
    let run = |packed: &Prepared, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let y = conv::forward(&s, &x, packed, None, true);
            let g = conv::backward(&s, &x, packed, Some(&y), &dy, Wanted::ALL);
            [y, g.input.unwrap(), g.weight, g.bias.unwrap()]
        })
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut algorithms = vec![Algorithm::Im2col, Algorithm::Direct];
    if winograd::applies(&s, 1) {
        algorithms.extend([Algorithm::Winograd, Algorithm::Winograd4]);
    }
    let precisions = [Precision::F32, Precision::Bf16]
        .into_iter()
        .filter(|p| crate::matmul::available(*p));
    for (algorithm, precision) in precisions.flat_map(|p| algorithms.iter().map(move |a| (*a, p))) {
        let packed = Prepared::with(algorithm, &s, Weight::torch(&w)).in_precision(precision);
        let one = run(&packed, 1);
        for threads in [2, 3, 5] {
            let other = run(&packed, threads);
            for (what, (a, b)) in [
                "forward",
                "input gradient",
                "weight gradient",
                "bias gradient",
            ]
            .iter()
            .zip(one.iter().zip(&other))
            {
                assert!(
                    bits(a) == bits(b),
                    "{what} differs at {threads} threads for {s:?} ({algorithm:?}, {precision:?})"
                );
            }
        }
    }
}

/// bf16 inputs (8 bits of mantissa) with f32 sums: every algorithm within bf16's rounding of
/// the exact result, relative to the largest value.
#[test]
fn bf16_convolutions_stay_within_bf16_rounding_of_the_exact_result() {
    if !crate::matmul::available(Precision::Bf16) {
        eprintln!("SKIPPED: this CPU has no AVX512_BF16");
        return;
    }
    for (s, algorithm) in [
        (shape3x3(2, 3, 32, 8), Algorithm::Im2col),
        (shape3x3(2, 64, 48, 8), Algorithm::Winograd),
        (shape3x3(16, 32, 40, 2), Algorithm::Direct),
    ] {
        check_in(s, true, 11, algorithm, Precision::Bf16, 1e-2);
        // ...and not within fp32's: the inputs really were rounded.
        let x = values(s.input_len(), 11);
        let w = values(s.weight_len(), 12);
        let y = |p| {
            conv::forward(
                &s,
                &x,
                &Prepared::with(algorithm, &s, Weight::torch(&w)).in_precision(p),
                None,
                false,
            )
        };
        let want: Vec<f64> = y(Precision::F32).iter().map(|v| *v as f64).collect();
        assert!(
            worst_error(&y(Precision::Bf16), &want) > TOLERANCE,
            "{algorithm:?}"
        );
    }
}

/// A PyTorch-layout weight (`[c_out][c_in][taps]`) in the kernels' `[c_out][taps][c_in]`.
fn taps_first(s: &ConvShape, torch: &[f32]) -> Vec<f32> {
    let taps = s.kernel[0] * s.kernel[1];
    let mut out = vec![0.0; torch.len()];
    for o in 0..s.c_out {
        for c in 0..s.c_in {
            for t in 0..taps {
                out[(o * taps + t) * s.c_in + c] = torch[(o * s.c_in + c) * taps + t];
            }
        }
    }
    out
}

/// A weight in the kernels' own layout computes what it does in PyTorch's, to the bit, with
/// its gradient back in the kernels' layout: every algorithm, both tiles, a partial block of
/// Winograd's output-channel lanes and of its input channels, 1×1 and 7×7 kernels.
#[test]
fn a_weight_in_the_kernels_layout_gives_the_same_bits_as_in_pytorchs() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let shapes = [
        (shape3x3(2, 40, 24, 8), Algorithm::Winograd4),
        (shape3x3(2, 33, 20, 4), Algorithm::Winograd),
        (shape3x3(16, 24, 40, 2), Algorithm::Direct),
        (shape3x3(2, 5, 7, 6), Algorithm::Im2col),
        (
            ConvShape {
                kernel: [7, 7],
                stride: [2, 2],
                padding: [3, 3],
                ..shape3x3(2, 3, 16, 16)
            },
            Algorithm::Im2col,
        ),
        (
            ConvShape {
                kernel: [1, 1],
                padding: [0, 0],
                ..shape3x3(2, 16, 8, 4)
            },
            Algorithm::Im2col,
        ),
    ];
    for (s, algorithm) in shapes {
        s.validate().unwrap();
        let x = values(s.input_len(), 21);
        let w = values(s.weight_len(), 22);
        let dy = values(s.output_len(), 23);
        let ours = taps_first(&s, &w);
        let run = |weight: Weight| {
            let prepared = Prepared::with(algorithm, &s, weight);
            let y = conv::forward(&s, &x, &prepared, None, true);
            let g = conv::backward(&s, &x, &prepared, Some(&y), &dy, Wanted::ALL);
            (y, g)
        };
        let (y_torch, g_torch) = run(Weight::torch(&w));
        let (y_ours, g_ours) = run(Weight::taps_first(&ours));
        let what = format!("{s:?} by {algorithm:?}");
        assert!(bits(&y_ours) == bits(&y_torch), "forward, {what}");
        assert!(
            bits(g_ours.input.as_deref().unwrap()) == bits(g_torch.input.as_deref().unwrap()),
            "input gradient, {what}"
        );
        assert!(
            bits(&g_ours.weight) == bits(&taps_first(&s, &g_torch.weight)),
            "weight gradient, {what}"
        );
        // ...and the layouts really differ (but for the 1×1 kernel, where they coincide).
        if s.kernel != [1, 1] {
            assert_ne!(bits(&g_ours.weight), bits(&g_torch.weight), "{what}");
        }
    }
}

/// A gradient not wanted is not computed, and the others are what they are when all are.
#[test]
fn gradients_not_wanted_are_left_out_and_the_rest_unchanged() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (s, algorithm) in [
        (shape3x3(2, 40, 24, 8), Algorithm::Winograd4),
        (shape3x3(16, 24, 40, 2), Algorithm::Direct),
        (shape3x3(2, 5, 7, 6), Algorithm::Im2col),
    ] {
        let (x, w, dy) = (
            values(s.input_len(), 31),
            values(s.weight_len(), 32),
            values(s.output_len(), 33),
        );
        let prepared = Prepared::with(algorithm, &s, Weight::torch(&w));
        for relu in [None, Some(conv::forward(&s, &x, &prepared, None, true))] {
            let all = conv::backward(&s, &x, &prepared, relu.as_deref(), &dy, Wanted::ALL);
            for wanted in [
                Wanted {
                    input: false,
                    bias: true,
                },
                Wanted {
                    input: true,
                    bias: false,
                },
                Wanted {
                    input: false,
                    bias: false,
                },
            ] {
                let g = conv::backward(&s, &x, &prepared, relu.as_deref(), &dy, wanted);
                let what = format!("{algorithm:?}, {wanted:?}, ReLU {}", relu.is_some());
                assert_eq!(g.input.is_some(), wanted.input, "{what}");
                assert_eq!(g.bias.is_some(), wanted.bias, "{what}");
                assert!(
                    bits(&g.weight) == bits(&all.weight),
                    "weight gradient, {what}"
                );
                if let Some(dx) = &g.input {
                    assert!(bits(dx) == bits(all.input.as_ref().unwrap()), "{what}");
                }
                if let Some(db) = &g.bias {
                    assert!(bits(db) == bits(all.bias.as_ref().unwrap()), "{what}");
                }
            }
        }
    }
}

#[test]
fn results_are_bit_identical_whatever_the_thread_count() {
    // Enough images for several chunks and every accumulator.
    let s = shape3x3(40, 16, 32, 32);
    assert!(s.batch.div_ceil(s.images_per_chunk()) > conv::ACCUMULATORS);
    assert_bit_identical_at_any_thread_count(s);
}

#[test]
fn a_layer_of_one_chunk_shared_by_tiles_is_bit_identical_whatever_the_thread_count() {
    // A ResNet's deep layers: the whole batch is one chunk, its GEMMs split into tiles.
    let deep = shape3x3(4, 64, 256, 4);
    assert_eq!(deep.images_per_chunk(), deep.batch);
    assert!(matmul::Tiling::of(deep.k(), deep.c_out, 16 * deep.batch).tiles > 1);
    let projection = ConvShape {
        kernel: [1, 1],
        stride: [2, 2],
        padding: [0, 0],
        ..shape3x3(1, 128, 256, 8)
    };
    let pointwise = ConvShape {
        kernel: [1, 1],
        padding: [0, 0],
        ..shape3x3(2, 256, 128, 8)
    };
    for s in [deep, projection, pointwise, shape3x3(1, 32, 48, 5)] {
        assert_bit_identical_at_any_thread_count(s);
    }
}

#[test]
fn small_outputs_skip_the_padding_taps_and_match_the_direct_convolution() {
    // resnet18's deep 3×3 layers at 64 px (2×2, padding 1: 20 of 36 taps are padding), the
    // stride-2 3×3 into them, a 1×1 image, and a 5×5 kernel wider than the image.
    let deep = shape3x3(16, 24, 40, 2);
    let down = ConvShape {
        stride: [2, 2],
        ..shape3x3(16, 12, 20, 4)
    };
    let single = shape3x3(16, 8, 8, 1);
    let wide = ConvShape {
        kernel: [5, 5],
        padding: [2, 2],
        ..shape3x3(17, 6, 5, 3)
    };
    for s in [deep, down, single, wide] {
        assert_eq!(Algorithm::of(&s), Algorithm::Direct, "{s:?}");
        check(s, true, 200);
        check(s, false, 201);
    }
    // Its GEMMs, whose rows are the images, split into tiles of columns.
    let tiled = shape3x3(32, 256, 256, 2);
    assert!(matmul::Tiling::of(tiled.batch, tiled.c_out, 2 * tiled.c_in).tiles > 1);
    assert_bit_identical_at_any_thread_count(tiled);
}

#[test]
fn winograd_takes_4x4_tiles_from_8x8_outputs_and_runs_them_in_fp32_only() {
    let (wide, small) = (shape3x3(2, 64, 64, 8), shape3x3(2, 64, 64, 4));
    assert_eq!(Algorithm::of(&wide), Algorithm::Winograd4);
    assert_eq!(Algorithm::of(&small), Algorithm::Winograd);
    // bf16 would round F(4×4)'s transformed values, scaled by up to 8, to 8 bits: asked for
    // bf16, its products run in fp32, and give exactly fp32's result; F(2×2)'s take bf16.
    let w = values(wide.weight_len(), 7);
    let prepared = |s: &ConvShape, p| Prepared::new(s, Weight::torch(&w), p);
    assert_eq!(prepared(&wide, Precision::Bf16).precision(), Precision::F32);
    assert_eq!(
        prepared(&small, Precision::Bf16).precision(),
        Precision::Bf16
    );
    let x = values(wide.input_len(), 8);
    let y = |p| conv::forward(&wide, &x, &prepared(&wide, p), None, false);
    assert!(y(Precision::Bf16) == y(Precision::F32));
    // ResNet-wide channels (sums of 1,152 terms), a partial tile at the edge, no padding.
    check_with(shape3x3(2, 128, 96, 8), true, 31, Algorithm::Winograd4);
    let unpadded = ConvShape {
        padding: [0, 0],
        ..shape3x3(2, 40, 24, 11)
    };
    check_with(unpadded, false, 32, Algorithm::Winograd4);
}

#[test]
fn a_nan_input_stays_nan_through_the_fused_relu() {
    let s = shape3x3(1, 1, 1, 3);
    let mut x = vec![1.0; 9];
    x[4] = f32::NAN;
    for algorithm in [
        Algorithm::Im2col,
        Algorithm::Winograd,
        Algorithm::Winograd4,
        Algorithm::Direct,
    ] {
        let packed = Prepared::with(algorithm, &s, Weight::torch(&[-1.0; 9]));
        let y = conv::forward(&s, &x, &packed, None, true);
        assert!(y.iter().all(|v| v.is_nan()), "{algorithm:?}: {y:?}");
    }
}

#[test]
fn impossible_shapes_are_refused_with_the_reason() {
    let e = ConvShape {
        kernel: [7, 7],
        padding: [0, 0],
        ..shape3x3(1, 1, 1, 5)
    }
    .validate()
    .unwrap_err();
    assert!(e.contains("does not fit"), "{e}");
    let e = ConvShape {
        stride: [0, 1],
        ..shape3x3(1, 1, 1, 5)
    }
    .validate()
    .unwrap_err();
    assert!(e.contains("vertical stride is 0"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn winograd_matches_the_direct_convolution_on_odd_sizes_and_any_padding(
        batch in 1usize..4,
        c_in in 1usize..9,
        c_out in 1usize..9,
        height in 1usize..12,
        width in 1usize..12,
        py in 0usize..3,
        px in 0usize..3,
        relu in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let s = ConvShape { batch, c_in, height, width, c_out, kernel: [3, 3], stride: [1, 1], padding: [py, px] };
        prop_assume!(s.validate().is_ok());
        check_with(s, relu, seed, Algorithm::Winograd);
        check_with(s, relu, seed, Algorithm::Winograd4);
    }

    #[test]
    fn random_shapes_match_the_direct_convolution(
        batch in 1usize..4,
        c_in in 1usize..9,
        c_out in 1usize..9,
        height in 1usize..12,
        width in 1usize..12,
        kh in 1usize..6,
        kw in 1usize..6,
        sy in 1usize..4,
        sx in 1usize..4,
        py in 0usize..4,
        px in 0usize..4,
        relu in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let s = ConvShape { batch, c_in, height, width, c_out, kernel: [kh, kw], stride: [sy, sx], padding: [py, px] };
        prop_assume!(s.validate().is_ok());
        check(s, relu, seed);
        // Pixel by pixel computes any shape, whichever the rule picks.
        check_with(s, relu, seed, Algorithm::Direct);
    }
}

mod pooling {
    use super::values;
    use crate::pool::{self, PoolShape};

    /// Direct max pooling: the output and, per output, the input index of its (first) maximum.
    fn reference(s: &PoolShape, x: &[f32]) -> (Vec<f32>, Vec<usize>) {
        let [oh, ow] = s.out_size();
        let mut out = vec![f32::NEG_INFINITY; s.output_len()];
        let mut from = vec![usize::MAX; s.output_len()];
        for n in 0..s.batch {
            for oy in 0..oh {
                for ox in 0..ow {
                    for c in 0..s.channels {
                        let o = ((n * oh + oy) * ow + ox) * s.channels + c;
                        for ky in 0..s.kernel[0] {
                            for kx in 0..s.kernel[1] {
                                let iy = (oy * s.stride[0] + ky) as isize - s.padding[0] as isize;
                                let ix = (ox * s.stride[1] + kx) as isize - s.padding[1] as isize;
                                if iy >= 0
                                    && ix >= 0
                                    && (iy as usize) < s.height
                                    && (ix as usize) < s.width
                                {
                                    let i = ((n * s.height + iy as usize) * s.width + ix as usize)
                                        * s.channels
                                        + c;
                                    if x[i] > out[o] {
                                        out[o] = x[i];
                                        from[o] = i;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        (out, from)
    }

    fn shape(kernel: usize, stride: usize, padding: usize, size: usize) -> PoolShape {
        PoolShape {
            batch: 2,
            channels: 5,
            height: size,
            width: size + 1,
            kernel: [kernel; 2],
            stride: [stride; 2],
            padding: [padding; 2],
        }
    }

    #[test]
    fn maxima_and_their_gradient_match_a_direct_pooling() {
        // The seed CNN's 2×2 and the ResNet stem's 3×3 stride 2 padding 1.
        for s in [shape(2, 2, 0, 8), shape(3, 2, 1, 9), shape(3, 1, 1, 5)] {
            s.validate().unwrap();
            let x = values(s.input_len(), 11);
            let (y, taps) = pool::max_forward(&s, &x);
            let (want, from) = reference(&s, &x);
            assert_eq!(y, want, "{s:?}");
            // The gradient goes to each output's maximum, summed where windows overlap.
            let r = values(s.output_len(), 12);
            let mut want_dx = vec![0.0f32; s.input_len()];
            for (o, i) in from.iter().enumerate() {
                want_dx[*i] += r[o];
            }
            assert_eq!(pool::max_backward(&s, &r, &taps), want_dx, "{s:?}");
        }
    }

    #[test]
    fn a_tie_goes_to_the_first_maximum_and_nan_wins() {
        let s = shape(2, 2, 0, 2);
        let s = PoolShape {
            batch: 1,
            channels: 1,
            width: 2,
            ..s
        };
        let (y, taps) = pool::max_forward(&s, &[3.0, 3.0, 1.0, 3.0]);
        assert_eq!((y, taps), (vec![3.0], vec![0]));
        let (y, _) = pool::max_forward(&s, &[3.0, f32::NAN, 9.0, 1.0]);
        assert!(y[0].is_nan());
    }
}

mod batch_norm {
    use super::values;
    use crate::norm;

    #[test]
    fn statistics_output_and_gradients_match_the_formulas() {
        let (rows, channels, eps) = (1100, 6, 1e-5);
        // Offsets and scales per channel, so that the statistics differ.
        let x: Vec<f32> = values(rows * channels, 21)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1.0 + (i % channels) as f32) + (i % channels) as f32)
            .collect();
        let gamma = values(channels, 22);
        let beta = values(channels, 23);
        let dy = values(rows * channels, 24);
        let stats = norm::batch_stats(&x, channels);
        let (y, mask) = norm::normalize(&x, &gamma, &beta, &stats, eps, None, false);
        assert!(mask.is_none());
        let g = norm::backward(&x, &gamma, &stats, eps, &dy, None, false);
        assert!(g.residual.is_none());
        for c in 0..channels {
            let col: Vec<f64> = (0..rows).map(|r| x[r * channels + c] as f64).collect();
            let mean = col.iter().sum::<f64>() / rows as f64;
            let var = col.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / rows as f64;
            assert!((stats.mean[c] as f64 - mean).abs() < 1e-5 * (1.0 + mean.abs()));
            assert!((stats.var[c] as f64 - var).abs() < 1e-5 * var);
            let inv = 1.0 / (var + eps).sqrt();
            let xhat: Vec<f64> = col.iter().map(|v| (v - mean) * inv).collect();
            let gy: Vec<f64> = (0..rows).map(|r| dy[r * channels + c] as f64).collect();
            let dbeta: f64 = gy.iter().sum();
            let dgamma: f64 = gy.iter().zip(&xhat).map(|(g, h)| g * h).sum();
            assert!((g.beta[c] as f64 - dbeta).abs() < 1e-3, "dbeta {c}");
            assert!((g.gamma[c] as f64 - dgamma).abs() < 1e-3, "dgamma {c}");
            for r in 0..rows {
                let want_y = xhat[r] * gamma[c] as f64 + beta[c] as f64;
                assert!(
                    (y[r * channels + c] as f64 - want_y).abs() < 1e-5,
                    "y row {r} channel {c}"
                );
                let want_dx = gamma[c] as f64 * inv / rows as f64
                    * (rows as f64 * gy[r] - dbeta - xhat[r] * dgamma);
                let got = g.input[r * channels + c] as f64;
                assert!(
                    (got - want_dx).abs() < 1e-5 * (1.0 + want_dx.abs()),
                    "dx row {r} channel {c}: {got} vs {want_dx}"
                );
            }
        }
    }

    #[test]
    fn a_relu_mask_passes_only_positive_outputs() {
        // Per channel: the output 0 (gamma and beta 0), NaN (beta NaN), 1; the gradient passes
        // the third only, as it passes where a ReLU's output is positive.
        let (rows, eps) = (700, 1e-5);
        let x = values(rows * 3, 51);
        let (gamma, beta) = ([0.0, 0.0, 0.0], [0.0, f32::NAN, 1.0]);
        let stats = norm::batch_stats(&x, 3);
        let (y, mask) = norm::normalize(&x, &gamma, &beta, &stats, eps, None, true);
        assert!(
            y.chunks(3)
                .all(|r| r[0] == 0.0 && r[1].is_nan() && r[2] == 1.0)
        );
        let mask = mask.expect("a ReLU's mask");
        assert_eq!(mask, norm::ReluMask::of_output(&y));
        let dy = vec![1.0; rows * 3];
        let g = norm::backward(&x, &gamma, &stats, eps, &dy, Some(&mask), true);
        let passed = g.residual.expect("the residual's gradient");
        assert!(passed.chunks(3).all(|r| r == [0.0, 0.0, 1.0]));
        assert_eq!(g.beta, [0.0, 0.0, rows as f32]);
    }

    #[test]
    fn the_residual_add_and_relu_fused_equal_the_three_operations() {
        let (channels, eps) = (5, 1e-5);
        let x = values(channels * 1300, 41);
        let r = values(channels * 1300, 42);
        let (gamma, beta) = (values(channels, 43), values(channels, 44));
        let dy = values(channels * 1300, 45);
        let stats = norm::batch_stats(&x, channels);
        let (plain, _) = norm::normalize(&x, &gamma, &beta, &stats, eps, None, false);
        let want: Vec<f32> = plain
            .iter()
            .zip(&r)
            .map(|(v, r)| (v + r).max(0.0))
            .collect();
        let (y, mask) = norm::normalize(&x, &gamma, &beta, &stats, eps, Some(&r), true);
        assert_eq!(y, want);
        assert!(y.contains(&0.0) && y.iter().any(|v| *v > 0.0));
        // The mask is where the output is positive.
        let mask = mask.expect("a ReLU's mask");
        assert_eq!(mask, norm::ReluMask::of_output(&y));
        // Backward: the gradient through the ReLU goes to the residual as it is, and to the
        // norm's plain backward.
        let masked: Vec<f32> = dy
            .iter()
            .zip(&y)
            .map(|(d, o)| if *o > 0.0 { *d } else { 0.0 })
            .collect();
        let want = norm::backward(&x, &gamma, &stats, eps, &masked, None, false);
        let g = norm::backward(&x, &gamma, &stats, eps, &dy, Some(&mask), true);
        assert_eq!(g.residual.as_ref(), Some(&masked));
        assert_eq!(
            (&g.input, &g.gamma, &g.beta),
            (&want.input, &want.gamma, &want.beta)
        );
        // Without the ReLU the residual's gradient is the upstream one.
        let g = norm::backward(&x, &gamma, &stats, eps, &dy, None, true);
        assert_eq!(g.residual, Some(dy));
    }

    #[test]
    fn sums_are_bit_identical_whatever_the_thread_count() {
        // Many rows of few channels, and a ResNet's deep layer: few rows (32 images of 4×4)
        // of many channels, in blocks of fewer rows.
        for (channels, rows) in [(8, 5000), (1024, 512)] {
            let (x, dy) = (values(channels * rows, 31), values(channels * rows, 32));
            let gamma = values(channels, 33);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let s = norm::batch_stats(&x, channels);
                    let (_, mask) = norm::normalize(&x, &gamma, &gamma, &s, 1e-5, None, true);
                    let g = norm::backward(&x, &gamma, &s, 1e-5, &dy, mask.as_ref(), false);
                    (s, g.input, g.gamma, g.beta)
                })
            };
            let (a, b) = (run(1), run(3));
            assert_eq!(a.0, b.0, "{channels} channels");
            assert!(
                a.1.iter()
                    .zip(&b.1)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{channels} channels"
            );
            assert_eq!((a.2, a.3), (b.2, b.3), "{channels} channels");
        }
    }
}

#[test]
fn several_chunks_and_a_partial_one_match_the_direct_convolution() {
    // 9 images: chunks of 4, 4 and 1 for both algorithms at this shape; c_in ≠ c_out.
    let s = shape3x3(9, 32, 48, 32);
    assert!(s.images_per_chunk() < s.batch);
    for algorithm in [Algorithm::Im2col, Algorithm::Winograd, Algorithm::Winograd4] {
        check_with(s, true, 5, algorithm);
    }
    let pointwise = ConvShape {
        kernel: [1, 1],
        padding: [0, 0],
        ..shape3x3(9, 64, 24, 32)
    };
    assert!(pointwise.images_per_chunk() < pointwise.batch);
    check(pointwise, true, 6);
}
