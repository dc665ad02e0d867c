//! Convolution as batched im2col + GEMM: any shape.
//!
//! Images are processed in chunks whose size depends only on the layer's shape (so that the
//! im2col matrix stays in cache), and chunks run in parallel on rayon's pool; inside a chunk,
//! im2col and col2im run image by image and each GEMM by tiles of its output
//! ([`par_matmul`]), so a layer that is one chunk (a ResNet's deep layers at batch 32) still
//! uses every thread.

use rayon::prelude::*;

use super::ConvShape;
use super::shared::{
    ConvGrads, ForwardRhs, PackedWeight, Wanted, accumulator_groups, check_backward_sizes,
    chunk_gradient, relu_in_place, sum_partials, tap_range, unpack,
};
use crate::matmul::{Mat, PackedRhs, par_matmul, par_matmul_packed};
use crate::scratch::{par_filled, with_scratch, zeros};

/// Fills `col` (`images · oh · ow` rows of `k`) with the patches of images `n0..n0 + images`.
fn im2col(s: &ConvShape, x: &[f32], n0: usize, images: usize, col: &mut [f32]) {
    let [oh, ow] = s.out_size();
    let [kh, kw] = s.kernel;
    let (c, k, w) = (s.c_in, s.k(), s.width);
    let image_len = s.height * w * c;
    let mut rows = col.chunks_exact_mut(k);
    for n in n0..n0 + images {
        let img = &x[n * image_len..(n + 1) * image_len];
        for oy in 0..oh {
            for ox in 0..ow {
                let row = rows.next().expect("col holds every row");
                let (lo, hi, ix) = tap_range(ox, s.stride[1], s.padding[1], kw, w);
                for ky in 0..kh {
                    let seg = &mut row[ky * kw * c..(ky + 1) * kw * c];
                    let iy = (oy * s.stride[0] + ky).wrapping_sub(s.padding[0]);
                    if iy >= s.height {
                        seg.fill(0.0);
                        continue;
                    }
                    seg[..lo * c].fill(0.0);
                    if hi > lo {
                        let src = (iy * w + ix) * c;
                        seg[lo * c..hi * c].copy_from_slice(&img[src..src + (hi - lo) * c]);
                    }
                    seg[hi * c..].fill(0.0);
                }
            }
        }
    }
}

/// Elements of the scratch [`patch_matrix`] needs for `images` images: none for a pointwise
/// layer.
fn col_len(s: &ConvShape, images: usize) -> usize {
    if s.is_pointwise() {
        0
    } else {
        images * s.rows_per_image() * s.k()
    }
}

/// The im2col matrix of images `n0..n0 + images`: a pointwise layer's input as it lies, else
/// `col` ([`col_len`] elements) filled image by image on rayon's threads.
fn patch_matrix<'a>(
    s: &ConvShape,
    x: &'a [f32],
    n0: usize,
    images: usize,
    col: &'a mut [f32],
) -> &'a [f32] {
    let image = s.rows_per_image() * s.k();
    if s.is_pointwise() {
        return &x[n0 * image..][..images * image];
    }
    col.par_chunks_mut(image)
        .enumerate()
        .for_each(|(i, col)| im2col(s, x, n0 + i, 1, col));
    col
}

/// The adjoint of [`im2col`]: adds every row's patch back into `dx` (images `n0..`, `dx`
/// holding just those images).
fn col2im(s: &ConvShape, dcol: &[f32], images: usize, dx: &mut [f32]) {
    let [oh, ow] = s.out_size();
    let [kh, kw] = s.kernel;
    let (c, k, w) = (s.c_in, s.k(), s.width);
    let image_len = s.height * w * c;
    let mut rows = dcol.chunks_exact(k);
    for n in 0..images {
        let img = &mut dx[n * image_len..(n + 1) * image_len];
        for oy in 0..oh {
            for ox in 0..ow {
                let row = rows.next().expect("dcol holds every row");
                let (lo, hi, ix) = tap_range(ox, s.stride[1], s.padding[1], kw, w);
                for ky in 0..kh {
                    let iy = (oy * s.stride[0] + ky).wrapping_sub(s.padding[0]);
                    if iy >= s.height || hi == lo {
                        continue;
                    }
                    let src = &row[(ky * kw + lo) * c..(ky * kw + hi) * c];
                    let at = (iy * w + ix) * c;
                    for (d, g) in img[at..at + src.len()].iter_mut().zip(src) {
                        *d += g;
                    }
                }
            }
        }
    }
}

/// [`super::forward`] as im2col + GEMM (any shape).
pub fn forward(
    s: &ConvShape,
    x: &[f32],
    weight: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    let (rows_img, k, co) = (s.rows_per_image(), s.k(), s.c_out);
    let per_chunk = s.images_per_chunk();
    let rhs = ForwardRhs::new(s, x, weight);
    par_filled(s.output_len(), per_chunk * rows_img * co, |chunk, y| {
        let images = y.len() / (rows_img * co);
        let rows = images * rows_img;
        let n0 = chunk * per_chunk;
        with_scratch([col_len(s, images), 0, 0], |col, _, _| {
            let patches = patch_matrix(s, x, n0, images, col);
            if let Some(b) = bias {
                for row in y.chunks_exact_mut(co) {
                    row.copy_from_slice(b);
                }
            }
            par_matmul_packed(
                y,
                co,
                Mat::rows(patches, rows, k),
                rhs.mat(),
                rhs.panels(0..k),
                bias.is_some(),
                weight.precision,
            );
            if relu {
                relu_in_place(y);
            }
        });
    })
}

/// [`super::backward`] as im2col + GEMM.
pub fn backward(
    s: &ConvShape,
    x: &[f32],
    weight: &PackedWeight<'_>,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    wanted: Wanted,
) -> ConvGrads {
    check_backward_sizes(s, x, relu_output, dy);
    let (rows_img, k, co) = (s.rows_per_image(), s.k(), s.c_out);
    let per_chunk = s.images_per_chunk();
    let chunks = s.batch.div_ceil(per_chunk);
    let image_len = s.height * s.width * s.c_in;

    let mut dx = wanted.input.then(|| zeros(s.input_len()));
    // dX = G · W for every chunk: in bf16, W packed once for all of them.
    let w = Mat::rows(&weight.data, co, k);
    let packed_w = PackedRhs::new(w, weight.precision);
    let work = accumulator_groups(dx.as_deref_mut(), per_chunk * image_len, chunks);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = work
        .into_par_iter()
        .map(|chunks| {
            let mut dw = zeros(k * co);
            let mut db = vec![0.0f32; wanted.bias_len(co)];
            for (chunk, dx_chunk) in chunks {
                let n0 = chunk * per_chunk;
                let images = per_chunk.min(s.batch - n0);
                let rows = images * rows_img;
                let span = n0 * rows_img * co..(n0 * rows_img + rows) * co;
                with_scratch([col_len(s, images), rows * co, 0], |col, masked, _| {
                    let g = chunk_gradient(dy, relu_output, span, masked, &mut db);
                    let patches = patch_matrix(s, x, n0, images, col);
                    // dW as the weight is packed, `[c_out][k]`: gᵀ · col.
                    par_matmul(
                        &mut dw,
                        k,
                        Mat::rows(g, rows, co).t(),
                        Mat::rows(patches, rows, k),
                        true,
                        weight.precision,
                    );
                    if let Some(dx_chunk) = dx_chunk {
                        // col2im of a pointwise layer is the identity: straight into dx; else
                        // the im2col matrix is not needed any more: reuse it for dcol.
                        let dcol = if s.is_pointwise() {
                            &mut *dx_chunk
                        } else {
                            &mut *col
                        };
                        par_matmul_packed(
                            dcol,
                            k,
                            Mat::rows(g, rows, co),
                            w,
                            packed_w.view(0..co, 0..k),
                            false,
                            weight.precision,
                        );
                        if s.is_pointwise() {
                            return;
                        }
                        dx_chunk
                            .par_chunks_mut(image_len)
                            .zip(col.par_chunks(rows_img * k))
                            .for_each(|(dx, dcol)| col2im(s, dcol, 1, dx));
                    }
                });
            }
            (dw, db)
        })
        .collect();

    let (dw, db) = sum_partials(partials, k * co, wanted.bias_len(co));
    ConvGrads {
        input: dx,
        weight: unpack(s, dw, weight.layout),
        bias: wanted.bias.then_some(db),
    }
}
