//! Convolution as batched im2col + GEMM: any shape.
//!
//! Images are processed in chunks whose size depends only on the layer's shape (so that the
//! im2col matrix stays in cache), and chunks run in parallel on rayon's pool; inside a chunk,
//! im2col and col2im run image by image and each GEMM by tiles of its output
//! ([`par_matmul`]), so a layer that is one chunk (a ResNet's deep layers at batch 32) still
//! uses every thread.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::shared::{
    ConvGrads, ForwardRhs, PackedWeight, Wanted, accumulator_groups, check_backward_sizes,
    chunk_gradient, relu_in_place, sum_partials, tap_range, unpack,
};
use super::{Algorithm, ConvShape};
use crate::matmul::{Mat, PackedRhs, par_matmul, par_matmul_packed, par_matmul_uninit};
use crate::phases;
use crate::scratch::{par_written, with_scratch};

/// This module's algorithm, whose passes it names in [`crate::phases`].
const ALGORITHM: Algorithm = Algorithm::Im2col;

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
    let (rows_img, co) = (s.rows_per_image(), s.c_out);
    let per_chunk = s.images_per_chunk();
    let rhs = phases::timed(ALGORITHM.phase(s, "weight layout"), || {
        ForwardRhs::new(s, x, weight)
    });
    // SAFETY: `forward_chunk` writes every element of its run (see there).
    unsafe {
        par_written(s.output_len(), per_chunk * rows_img * co, |chunk, y| {
            forward_chunk(s, x, chunk * per_chunk, &rhs, weight, bias, relu, y)
        })
    }
}

/// The outputs `y` (whole images) of images `n0..` into memory not yet written, all of it: with
/// a bias, each row set to it and the GEMM adding in; without, the GEMM writing the whole
/// `rows × c_out` block and reading none of it (no zeroing pass first).
#[allow(clippy::too_many_arguments)]
fn forward_chunk(
    s: &ConvShape,
    x: &[f32],
    n0: usize,
    rhs: &ForwardRhs<'_>,
    weight: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    relu: bool,
    y: &mut [MaybeUninit<f32>],
) {
    let (rows_img, k, co) = (s.rows_per_image(), s.k(), s.c_out);
    let images = y.len() / (rows_img * co);
    let rows = images * rows_img;
    with_scratch([col_len(s, images), 0, 0], |col, _, _| {
        let patches = phases::timed(ALGORITHM.phase(s, "patches"), || {
            patch_matrix(s, x, n0, images, col)
        });
        let lhs = Mat::rows(patches, rows, k);
        let (mat, panels) = (rhs.mat(), rhs.panels(0..k));
        let y = match bias {
            Some(b) => {
                for row in y.chunks_exact_mut(co) {
                    for (o, v) in row.iter_mut().zip(b) {
                        o.write(*v);
                    }
                }
                // SAFETY: every row was set to the bias just above.
                let y = unsafe { y.assume_init_mut() };
                phases::timed(ALGORITHM.phase(s, "products"), || {
                    par_matmul_packed(y, co, lhs, mat, panels, true, weight.precision)
                });
                y
            }
            None => {
                phases::timed(ALGORITHM.phase(s, "products"), || {
                    par_matmul_uninit(y, co, lhs, mat, panels, weight.precision)
                });
                // SAFETY: the product wrote its whole `rows × c_out` block, `y` (stride c_out).
                unsafe { y.assume_init_mut() }
            }
        };
        if relu {
            relu_in_place(y);
        }
    });
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

    // Each chunk of dx is written whole (see below): no zeroing pass over it first.
    let mut dx = Vec::with_capacity(if wanted.input { s.input_len() } else { 0 });
    let dx_runs = wanted
        .input
        .then(|| &mut dx.spare_capacity_mut()[..s.input_len()]);
    // dX = G · W for every chunk: in bf16, W packed once for all of them.
    let w = Mat::rows(&weight.data, co, k);
    let packed_w = phases::timed(ALGORITHM.phase(s, "weight layout"), || {
        PackedRhs::new(w, weight.precision)
    });
    let work = accumulator_groups(dx_runs, per_chunk * image_len, chunks);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = work
        .into_par_iter()
        .map(|chunks| {
            // The group's first chunk writes its weight gradient, the others add to it: no
            // zeroing pass first.
            let mut dw = Vec::with_capacity(k * co);
            let mut db = vec![0.0f32; wanted.bias_len(co)];
            for (i, (chunk, dx_chunk)) in chunks.into_iter().enumerate() {
                let n0 = chunk * per_chunk;
                let images = per_chunk.min(s.batch - n0);
                let rows = images * rows_img;
                let span = n0 * rows_img * co..(n0 * rows_img + rows) * co;
                with_scratch([col_len(s, images), rows * co, 0], |col, masked, _| {
                    let g = phases::timed(
                        ALGORITHM.phase(s, "output gradient (ReLU mask, bias)"),
                        || chunk_gradient(dy, relu_output, span, masked, &mut db),
                    );
                    let patches = phases::timed(ALGORITHM.phase(s, "patches"), || {
                        patch_matrix(s, x, n0, images, col)
                    });
                    // dW as the weight is packed, `[c_out][k]`: gᵀ · col.
                    let (gt, pm) = (Mat::rows(g, rows, co).t(), Mat::rows(patches, rows, k));
                    phases::timed(ALGORITHM.phase(s, "weight gradient products"), || {
                        if i == 0 {
                            let block = &mut dw.spare_capacity_mut()[..k * co];
                            par_matmul_uninit(block, k, gt, pm, None, weight.precision);
                            // SAFETY: the product wrote its whole `c_out × k` block: all of dw.
                            unsafe { dw.set_len(k * co) };
                        } else {
                            par_matmul(&mut dw, k, gt, pm, true, weight.precision);
                        }
                    });
                    if let Some(dx_chunk) = dx_chunk {
                        let g = Mat::rows(g, rows, co);
                        input_gradient(s, g, w, &packed_w, weight.precision, col, dx_chunk);
                    }
                });
            }
            (dw, db)
        })
        .collect();
    let dx = wanted.input.then(|| {
        // SAFETY: the chunks tile the input gradient, and each was written whole above: a
        // pointwise layer's by its product (`rows × c_in`, the chunk), another's zeroed first.
        unsafe { dx.set_len(s.input_len()) };
        dx
    });

    let (dw, db) = phases::timed(ALGORITHM.phase(s, "weight gradient sum"), || {
        sum_partials(partials, k * co, wanted.bias_len(co))
    });
    ConvGrads {
        input: dx,
        weight: phases::timed(ALGORITHM.phase(s, "weight gradient layout"), || {
            unpack(s, dw, weight.layout)
        }),
        bias: wanted.bias.then_some(db),
    }
}

/// dX of one chunk from its output gradient `g`: `G · W`, straight into the chunk for a
/// pointwise layer (col2im is the identity), else into `col` (the im2col matrix is not needed
/// any more) and then into each image's zeros. Writes the whole chunk.
fn input_gradient(
    s: &ConvShape,
    g: Mat<'_>,
    w: Mat<'_>,
    packed_w: &PackedRhs,
    precision: crate::Precision,
    col: &mut [f32],
    dx_chunk: &mut [MaybeUninit<f32>],
) {
    let (k, co) = (s.k(), s.c_out);
    let panels = packed_w.view(0..co, 0..k);
    if s.is_pointwise() {
        phases::timed(ALGORITHM.phase(s, "input gradient products"), || {
            par_matmul_uninit(dx_chunk, k, g, w, panels, precision)
        });
        return;
    }
    phases::timed(ALGORITHM.phase(s, "input gradient products"), || {
        par_matmul_packed(col, k, g, w, panels, false, precision)
    });
    let image_len = s.height * s.width * s.c_in;
    phases::timed(ALGORITHM.phase(s, "input gradient (col2im)"), || {
        dx_chunk
            .par_chunks_mut(image_len)
            .zip(col.par_chunks(s.rows_per_image() * k))
            .for_each(|(dx, dcol)| {
                dx.fill(MaybeUninit::new(0.0));
                // SAFETY: every element was set on the line above.
                col2im(s, dcol, 1, unsafe { dx.assume_init_mut() })
            })
    });
}
