//! Tests of the bf16 GEMM: rounding as the hardware rounds, products against the rounded
//! inputs' product in f64, panels pair by pair, blocks of packed panels, and bit-identical
//! results at any thread count.

use super::super::{Mat, Precision, matmul, par_matmul};
use super::convert::{as_u32, convert_row};
use super::{NR, PackedB, available, pair, round};

fn skip() -> bool {
    if !available() {
        eprintln!("SKIPPED: this CPU has no AVX512_BF16");
    }
    !available()
}

fn to_f32(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// The product of the bf16-rounded inputs, in f64.
fn reference(lhs: Mat, rhs: Mat) -> Vec<f64> {
    let mut out = vec![0.0; lhs.rows * rhs.cols];
    for i in 0..lhs.rows {
        for j in 0..rhs.cols {
            out[i * rhs.cols + j] = (0..lhs.cols)
                .map(|p| {
                    to_f32(round(lhs.data[i * lhs.row_stride + p * lhs.col_stride]))
                        * to_f32(round(rhs.data[p * rhs.row_stride + j * rhs.col_stride]))
                })
                .sum();
        }
    }
    out
}

fn values(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + seed * 104729) % 997) as f32 / 499.0 - 1.0) * 1.37)
        .collect()
}

#[test]
fn rounding_is_to_nearest_even_like_the_hardware() {
    assert_eq!(round(1.0), 0x3f80);
    // 1 + 2⁻⁸ lies halfway between two bf16 values: ties go to the even one (1.0)...
    assert_eq!(round(1.0 + 1.0 / 256.0), 0x3f80);
    // ...and 1 + 3·2⁻⁸ rounds up to the even 1 + 2⁻⁶.
    assert_eq!(round(1.0 + 3.0 / 256.0), 0x3f82);
    assert!(to_f32(round(f32::NAN)).is_nan());
    assert_eq!(round(f32::INFINITY), 0x7f80);
    if skip() {
        return;
    }
    let row = values(37, 3);
    let mut pairs = vec![0u32; 19];
    // SAFETY: the features are there (checked above).
    unsafe { convert_row(&row, &mut pairs) };
    for (i, v) in row.iter().enumerate() {
        let half = (pairs[i / 2] >> (16 * (i % 2))) as u16;
        assert_eq!(half, round(*v), "element {i}: {v}");
    }
    assert_eq!(pairs[18] >> 16, 0, "the odd k's missing half is zero");
}

#[test]
fn products_match_the_rounded_inputs_product_on_every_edge_and_layout() {
    if skip() {
        return;
    }
    // Rows not a multiple of MR, columns not of NR, odd k, k over one block of pairs;
    // row-major, transposed and strided views on both sides; with and without accumulation.
    for (m, n, k) in [
        (1, 1, 1),
        (13, 33, 7),
        (25, 70, 600),
        (12, 32, 513),
        (40, 16, 2),
    ] {
        for layout in 0..4 {
            let (a, b) = (values(m * k * 2, m), values(k * n * 2, n));
            let lhs = match layout {
                0 | 2 => Mat::rows(&a, m, k),
                1 => Mat::rows(&a, k, m).t(),
                _ => Mat {
                    data: &a,
                    rows: m,
                    cols: k,
                    row_stride: 2 * k,
                    col_stride: 2,
                },
            };
            let rhs = match layout {
                0 | 1 => Mat::rows(&b, k, n),
                _ => Mat::rows(&b, n, k).t(),
            };
            let want = reference(lhs, rhs);
            let scale: f64 = k as f64 * 1.4 * 1.4;
            for accumulate in [false, true] {
                let mut dst = vec![0.5f32; m * (n + 2)];
                matmul(&mut dst, n + 2, lhs, rhs, accumulate, Precision::Bf16);
                for i in 0..m {
                    for j in 0..n + 2 {
                        let got = dst[i * (n + 2) + j] as f64;
                        let expected = if j >= n {
                            0.5
                        } else {
                            want[i * n + j] + if accumulate { 0.5 } else { 0.0 }
                        };
                        assert!(
                            (got - expected).abs() <= 1e-6 * scale,
                            "{m}×{n}×{k} layout {layout} accumulate {accumulate} ({i}, {j}): {got} vs {expected}"
                        );
                    }
                }
            }
        }
    }
}

/// Every pair of every panel is the two elements of B it packs, rounded, whichever way B
/// lies (row-major, read as a transpose, any strides), with an odd `k`, a partial last
/// panel, and large enough to be packed on several threads in runs of panels.
#[test]
fn panels_hold_each_pair_of_b_whatever_its_layout() {
    if skip() {
        return;
    }
    for (k, n) in [(7, 5), (33, 64), (601, 70), (4608, 96), (1025, 512)] {
        let data = values(k * (2 * n + 1) + 2 * n, k + n);
        for layout in 0..3 {
            let b = match layout {
                0 => Mat::rows(&data, k, n),
                1 => Mat::rows(&data, n, k).t(),
                _ => Mat {
                    data: &data,
                    rows: k,
                    cols: n,
                    row_stride: 2 * n + 1,
                    col_stride: 2,
                },
            };
            let packed = PackedB::new(b);
            let panels = as_u32(&packed.panels);
            let at = |r: usize, j: usize| b.data[r * b.row_stride + j * b.col_stride];
            for j in 0..n {
                for p in 0..k.div_ceil(2) {
                    let hi = if 2 * p + 1 < k { at(2 * p + 1, j) } else { 0.0 };
                    let got = panels[((j / NR) * k.div_ceil(2) + p) * NR + j % NR];
                    assert_eq!(
                        got,
                        pair(at(2 * p, j), hi),
                        "{k}×{n} layout {layout}: column {j}, pair {p}"
                    );
                }
            }
        }
    }
}

/// A block of a weight packed once gives bit for bit the product of the block packed on its
/// own; a block that does not start on a pair of rows or a panel of columns has no view.
#[test]
fn a_block_of_packed_panels_gives_the_blocks_own_product() {
    if skip() {
        return;
    }
    use super::super::{PackedRhs, matmul_packed};
    let (k, n, m) = (300, 96, 20);
    let (a, w) = (values(m * k, 5), values(k * n, 6));
    for transposed in [false, true] {
        let whole = if transposed {
            Mat::rows(&w, n, k).t()
        } else {
            Mat::rows(&w, k, n)
        };
        let packed = PackedRhs::new(whole, Precision::Bf16);
        assert!(packed.view(1..10, 0..n).is_none() && packed.view(0..k, 16..n).is_none());
        for (rows, cols) in [(0..k, 0..n), (64..200, 32..96), (2..k, 0..40)] {
            let block = whole.row_range(rows.clone()).col_range(cols.clone());
            let lhs = Mat::rows(&a, m, rows.len());
            let (mut own, mut from_whole) = (vec![0.0; m * cols.len()], vec![0.0; m * cols.len()]);
            matmul(&mut own, cols.len(), lhs, block, false, Precision::Bf16);
            let view = packed.view(rows.clone(), cols.clone());
            assert!(view.is_some(), "{rows:?} {cols:?}");
            matmul_packed(
                &mut from_whole,
                cols.len(),
                lhs,
                block,
                view,
                false,
                Precision::Bf16,
            );
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&own) == bits(&from_whole),
                "{rows:?} {cols:?} transposed {transposed}"
            );
        }
    }
}

#[test]
fn tiled_bf16_products_are_bit_identical_at_any_thread_count() {
    if skip() {
        return;
    }
    for (m, n, k, transposed) in [(700, 40, 300, false), (30, 900, 200, true)] {
        let (a, b) = (values(m * k, 1), values(k * n, 2));
        let lhs = if transposed {
            Mat::rows(&a, k, m).t()
        } else {
            Mat::rows(&a, m, k)
        };
        let rhs = Mat::rows(&b, k, n);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut dst = vec![0.0; m * n];
            pool.install(|| par_matmul(&mut dst, n, lhs, rhs, false, Precision::Bf16));
            dst.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let one = run(1);
        for threads in [2, 3] {
            assert!(
                run(threads) == one,
                "{m}×{n}×{k} differs at {threads} threads"
            );
        }
    }
}
