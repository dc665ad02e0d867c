//! 2-D convolution of NHWC `f32` tensors: the forward pass with the bias and ReLU fused in, and
//! both gradients. Stride-1 3×3 layers with enough input channels and outputs run as Winograd
//! F(2×2, 3×3) (module `winograd`), other small outputs with taps in the padding pixel by pixel
//! (module `direct`), every other shape as batched im2col + GEMM (here).
//!
//! Images are processed in chunks whose size depends only on the layer's shape (so that the
//! im2col matrix stays in cache), and chunks run in parallel on rayon's pool; inside a chunk,
//! im2col and col2im run image by image and each GEMM by tiles of its output
//! ([`par_matmul`]), so a layer that is one chunk (a ResNet's deep layers at batch 32) still
//! uses every thread. Determinism: every chunk's and tile's arithmetic is fixed by the shape,
//! and the weight gradient's per-chunk partial sums go to [`ACCUMULATORS`] accumulators (each a
//! fixed, contiguous run of chunks, taken in order) that are added in a fixed order at the end.
//! The result is bit-identical whatever the number of threads.

use rayon::prelude::*;

use crate::direct;
use crate::layout::{transpose_each, transpose_into};
use crate::matmul::{Mat, par_matmul};
use crate::scratch::{Scratch, scratch, with_scratch, zeros};
use crate::winograd::{self, WinogradWeight};

/// Partial sums of the weight gradient, fixed so that the sum's order never depends on the
/// thread count; also the most threads the weight gradient can use.
pub const ACCUMULATORS: usize = 8;
/// The im2col matrix of one chunk is kept under this size (bytes)...
const CHUNK_COL_BYTES: usize = 4 << 20;
/// ...and under this many rows (output pixels).
const CHUNK_MAX_ROWS: usize = 4096;

/// The shape of a convolution: input `[batch, height, width, c_in]` (NHWC), weight
/// `[c_out, c_in, kernel[0], kernel[1]]` (PyTorch's layout), no dilation, one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ConvShape {
    pub batch: usize,
    pub c_in: usize,
    pub height: usize,
    pub width: usize,
    pub c_out: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl ConvShape {
    /// A 3×3 convolution at stride 1 with padding 1 on square inputs (`size` × `size`): every
    /// convolution of the seed CNN.
    pub fn same_3x3(batch: usize, c_in: usize, c_out: usize, size: usize) -> Self {
        ConvShape {
            batch,
            c_in,
            height: size,
            width: size,
            c_out,
            kernel: [3, 3],
            stride: [1, 1],
            padding: [1, 1],
        }
    }

    /// Checks that the shape describes a convolution with at least one output pixel.
    pub fn validate(&self) -> Result<(), String> {
        let dims = [
            ("batch", self.batch),
            ("input channels", self.c_in),
            ("height", self.height),
            ("width", self.width),
            ("output channels", self.c_out),
            ("kernel height", self.kernel[0]),
            ("kernel width", self.kernel[1]),
            ("vertical stride", self.stride[0]),
            ("horizontal stride", self.stride[1]),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(format!("convolution {name} is 0 in {self:?}"));
        }
        for axis in 0..2 {
            let size = [self.height, self.width][axis] + 2 * self.padding[axis];
            if size < self.kernel[axis] {
                return Err(format!(
                    "a {}×{} kernel does not fit the padded {}×{} input",
                    self.kernel[0],
                    self.kernel[1],
                    self.height + 2 * self.padding[0],
                    self.width + 2 * self.padding[1]
                ));
            }
        }
        Ok(())
    }

    /// Output height and width.
    pub fn out_size(&self) -> [usize; 2] {
        [
            (self.height + 2 * self.padding[0] - self.kernel[0]) / self.stride[0] + 1,
            (self.width + 2 * self.padding[1] - self.kernel[1]) / self.stride[1] + 1,
        ]
    }

    /// A 1×1 kernel at stride 1 without padding: on NHWC data the input, as it lies, is
    /// already the im2col matrix.
    pub fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.stride == [1, 1] && self.padding == [0, 0]
    }

    /// The GEMM's inner dimension: one im2col row, `(ky, kx, c)` with `c` fastest.
    pub fn k(&self) -> usize {
        self.kernel[0] * self.kernel[1] * self.c_in
    }

    pub fn input_len(&self) -> usize {
        self.batch * self.height * self.width * self.c_in
    }

    pub fn output_len(&self) -> usize {
        let [oh, ow] = self.out_size();
        self.batch * oh * ow * self.c_out
    }

    pub fn weight_len(&self) -> usize {
        self.c_out * self.k()
    }

    fn rows_per_image(&self) -> usize {
        let [oh, ow] = self.out_size();
        oh * ow
    }

    /// Images per chunk: as many as keep the chunk's im2col matrix in cache.
    pub fn images_per_chunk(&self) -> usize {
        let rows = self.rows_per_image();
        let by_bytes = CHUNK_COL_BYTES / (rows * self.k() * 4).max(1);
        let by_rows = CHUNK_MAX_ROWS / rows;
        by_bytes.min(by_rows).clamp(1, self.batch)
    }
}

/// The weight with each output channel's taps before its input channels: `[c_out][k]`, row
/// `(ky, kx, c)` as an im2col row; its transpose is the GEMM's right-hand side. One pass over
/// PyTorch's layout (none for a 1×1 kernel), each output channel in cache.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedWeight {
    pub data: Vec<f32>,
}

impl PackedWeight {
    /// Packs a weight in PyTorch's layout `[c_out, c_in, kh, kw]`.
    pub fn from_torch(shape: &ConvShape, weight: &[f32]) -> Self {
        assert_eq!(weight.len(), shape.weight_len(), "weight size");
        let taps = shape.kernel[0] * shape.kernel[1];
        if taps == 1 {
            return PackedWeight {
                data: weight.to_vec(),
            };
        }
        let mut data = zeros(weight.len());
        transpose_each(weight, &mut data, shape.c_in, taps);
        PackedWeight { data }
    }
}

/// A packed `[c_out][k]` weight gradient back into PyTorch's layout.
pub(crate) fn unpack_to_torch(shape: &ConvShape, packed: Vec<f32>) -> Vec<f32> {
    let taps = shape.kernel[0] * shape.kernel[1];
    if taps == 1 {
        return packed;
    }
    let mut out = zeros(packed.len());
    transpose_each(&packed, &mut out, taps, shape.c_in);
    out
}

/// A group's chunks: the chunk index and, when the input gradient is wanted, its slice of it.
pub(crate) type ChunkGroup<'a> = Vec<(usize, Option<&'a mut [f32]>)>;

/// The backward pass's chunks, shared out to the weight gradient's accumulators: each group a
/// contiguous, equal (±1) run of chunks, so that rayon's halving of the group list halves the
/// work. Each chunk carries its slice of the input gradient when there is one.
pub(crate) fn accumulator_groups(
    dx: Option<&mut [f32]>,
    chunk_len: usize,
    chunks: usize,
) -> Vec<ChunkGroup<'_>> {
    let groups = ACCUMULATORS.min(chunks);
    let mut work: Vec<ChunkGroup> = (0..groups).map(|_| Vec::new()).collect();
    let group_of = |chunk: usize| chunk * groups / chunks;
    match dx {
        Some(dx) => {
            for (chunk, slice) in dx.chunks_mut(chunk_len).enumerate() {
                work[group_of(chunk)].push((chunk, Some(slice)));
            }
        }
        None => {
            for chunk in 0..chunks {
                work[group_of(chunk)].push((chunk, None));
            }
        }
    }
    work
}

/// The upstream gradient of a chunk (`span` of the output), masked by the fused ReLU when there
/// is one (into `masked`), with its sum over pixels added to the bias gradient `db`.
pub(crate) fn chunk_gradient<'a>(
    dy: &'a [f32],
    relu_output: Option<&[f32]>,
    span: std::ops::Range<usize>,
    masked: &'a mut [f32],
    db: &mut [f32],
) -> &'a [f32] {
    let g: &[f32] = match relu_output {
        Some(y) => {
            for ((m, &d), &o) in masked.iter_mut().zip(&dy[span.clone()]).zip(&y[span]) {
                *m = if o > 0.0 { d } else { 0.0 };
            }
            masked
        }
        None => &dy[span],
    };
    for row in g.chunks_exact(db.len()) {
        for (b, v) in db.iter_mut().zip(row) {
            *b += v;
        }
    }
    g
}

/// Adds the groups' partial (weight, bias) gradients in group order.
pub(crate) fn sum_partials(
    partials: Vec<(Vec<f32>, Vec<f32>)>,
    weight_len: usize,
    bias_len: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut partials = partials.into_iter();
    let (mut dw, mut db) = partials
        .next()
        .unwrap_or_else(|| (vec![0.0; weight_len], vec![0.0; bias_len]));
    for (w, b) in partials {
        for (acc, v) in dw.iter_mut().zip(&w) {
            *acc += v;
        }
        for (acc, v) in db.iter_mut().zip(&b) {
            *acc += v;
        }
    }
    (dw, db)
}

/// Panics unless the backward's inputs have the sizes `s` gives them.
pub(crate) fn check_backward_sizes(
    s: &ConvShape,
    x: &[f32],
    relu_output: Option<&[f32]>,
    dy: &[f32],
) {
    assert_eq!(x.len(), s.input_len(), "convolution input size");
    assert_eq!(dy.len(), s.output_len(), "convolution output-gradient size");
    if let Some(y) = relu_output {
        assert_eq!(y.len(), s.output_len(), "convolution output size");
    }
}

/// The in-range kernel columns for output column `ox`: `(kx_lo, kx_hi, ix of kx_lo)`.
#[inline]
pub(crate) fn tap_range(
    ox: usize,
    stride: usize,
    pad: usize,
    kernel: usize,
    size: usize,
) -> (usize, usize, usize) {
    let start = ox * stride; // input column of tap 0, plus `pad`
    // A window may lie wholly in the padding (a padding wider than the kernel).
    let lo = pad.saturating_sub(start).min(kernel);
    let hi = (size + pad).saturating_sub(start).min(kernel);
    (lo, hi.max(lo), (start + lo).saturating_sub(pad))
}

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

/// Input channels from which a stride-1 3×3 convolution runs as Winograd F(2×2, 3×3) (below,
/// its GEMMs are too narrow to gain; docs/PERFORMANCE.md has the layer figures).
pub const WINOGRAD_MIN_CHANNELS: usize = 32;
/// ...and the output side from which it does: on smaller outputs most of a tile's 4×4 input
/// block is padding and the weight's transforms (16 values for 9, every step) cost more than
/// the GEMMs save.
pub const WINOGRAD_MIN_SIDE: usize = 4;

/// Whether [`Prepared::new`] computes `s` with Winograd F(2×2, 3×3).
fn winograd_pays(s: &ConvShape) -> bool {
    let [oh, ow] = s.out_size();
    winograd::applies(s, WINOGRAD_MIN_CHANNELS) && oh.min(ow) >= WINOGRAD_MIN_SIDE
}

/// The algorithms, as [`Prepared::new`] picks them for a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Stride-1 3×3 layers from 4×4 outputs and 32 input channels (module `winograd`).
    Winograd,
    /// Other small outputs with taps in the padding, pixel by pixel (module `direct`).
    Direct,
    /// Everything else.
    Im2col,
}

impl Algorithm {
    pub fn of(s: &ConvShape) -> Self {
        if winograd_pays(s) {
            Algorithm::Winograd
        } else if direct::pays(s) {
            Algorithm::Direct
        } else {
            Algorithm::Im2col
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Direct => "direct",
            Algorithm::Winograd => "winograd",
            Algorithm::Im2col => "im2col",
        }
    }
}

/// A layer's weight, transformed for the algorithm its shape gets.
#[derive(Clone, Debug, PartialEq)]
pub enum Prepared {
    Im2col(PackedWeight),
    Winograd(WinogradWeight),
    Direct(PackedWeight),
}

impl Prepared {
    /// The name of the algorithm [`Prepared::new`] picks for `s`.
    pub fn algorithm(s: &ConvShape) -> &'static str {
        Algorithm::of(s).name()
    }

    /// The algorithm for `s` and the weight (PyTorch's layout) transformed for it.
    pub fn new(s: &ConvShape, weight: &[f32]) -> Self {
        Prepared::with(Algorithm::of(s), s, weight)
    }

    /// The weight transformed for `algorithm`, whether or not it is the one `s` gets (each
    /// computes any shape but Winograd, which needs a stride-1 3×3 kernel).
    pub fn with(algorithm: Algorithm, s: &ConvShape, weight: &[f32]) -> Self {
        match algorithm {
            Algorithm::Direct => Prepared::Direct(PackedWeight::from_torch(s, weight)),
            Algorithm::Winograd => Prepared::Winograd(WinogradWeight::from_torch(s, weight)),
            Algorithm::Im2col => Prepared::Im2col(PackedWeight::from_torch(s, weight)),
        }
    }
}

/// `y = conv(x, w) + bias`, then ReLU when `relu`; `x` and `y` NHWC.
pub fn forward(
    s: &ConvShape,
    x: &[f32],
    weight: &Prepared,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    match weight {
        Prepared::Im2col(w) => im2col_forward(s, x, w, bias, relu),
        Prepared::Winograd(u) => winograd::forward(s, x, u, bias, relu),
        Prepared::Direct(w) => direct::forward(s, x, w, bias, relu),
    }
}

/// Gradients of [`forward`] given `dy` (NHWC). With the ReLU fused, `relu_output` is the
/// forward's output: the gradient passes where it is positive.
pub fn backward(
    s: &ConvShape,
    x: &[f32],
    weight: &Prepared,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    need_input: bool,
) -> ConvGrads {
    match weight {
        Prepared::Im2col(w) => im2col_backward(s, x, w, relu_output, dy, need_input),
        Prepared::Winograd(u) => winograd::backward(s, x, u, relu_output, dy, need_input),
        Prepared::Direct(w) => direct::backward(s, x, w, relu_output, dy, need_input),
    }
}

/// Checks the forward's input and weight sizes, and lays the packed weight out as the forward
/// GEMM's right-hand side, `[k][c_out]`: gemm runs up to 4× faster on it than on the transposed
/// view when the product has few rows (a ResNet's deep layers; docs/PERFORMANCE.md).
pub(crate) fn forward_rhs(s: &ConvShape, x: &[f32], weight: &PackedWeight) -> Scratch {
    assert_eq!(x.len(), s.input_len(), "convolution input size");
    assert_eq!(weight.data.len(), s.weight_len(), "convolution weight size");
    let mut rhs = scratch(s.k() * s.c_out);
    transpose_into(&weight.data, &mut rhs, s.c_out, s.k());
    rhs
}

/// ReLU in place; `<`, not `max`: a NaN stays a NaN, as in PyTorch.
pub(crate) fn relu_in_place(y: &mut [f32]) {
    for v in y.iter_mut() {
        if *v < 0.0 {
            *v = 0.0;
        }
    }
}

/// [`forward`] as im2col + GEMM (any shape).
pub fn im2col_forward(
    s: &ConvShape,
    x: &[f32],
    weight: &PackedWeight,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    let (rows_img, k, co) = (s.rows_per_image(), s.k(), s.c_out);
    let per_chunk = s.images_per_chunk();
    let rhs = forward_rhs(s, x, weight);
    let mut out = zeros(s.output_len());
    out.par_chunks_mut(per_chunk * rows_img * co)
        .enumerate()
        .for_each(|(chunk, y)| {
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
                par_matmul(
                    y,
                    co,
                    Mat::rows(patches, rows, k),
                    Mat::rows(&rhs, k, co),
                    bias.is_some(),
                );
                if relu {
                    relu_in_place(y);
                }
            });
        });
    out
}

/// Gradients of a convolution; the weight gradient in PyTorch's layout.
#[derive(Debug, Clone)]
pub struct ConvGrads {
    pub input: Option<Vec<f32>>,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// [`backward`] as im2col + GEMM.
pub fn im2col_backward(
    s: &ConvShape,
    x: &[f32],
    weight: &PackedWeight,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    need_input: bool,
) -> ConvGrads {
    check_backward_sizes(s, x, relu_output, dy);
    let (rows_img, k, co) = (s.rows_per_image(), s.k(), s.c_out);
    let per_chunk = s.images_per_chunk();
    let chunks = s.batch.div_ceil(per_chunk);
    let image_len = s.height * s.width * s.c_in;

    let mut dx = need_input.then(|| zeros(s.input_len()));
    let work = accumulator_groups(dx.as_deref_mut(), per_chunk * image_len, chunks);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = work
        .into_par_iter()
        .map(|chunks| {
            let mut dw = zeros(k * co);
            let mut db = vec![0.0f32; co];
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
                    );
                    if let Some(dx_chunk) = dx_chunk {
                        let w = Mat::rows(&weight.data, co, k);
                        if s.is_pointwise() {
                            // col2im of a pointwise layer is the identity: straight into dx.
                            par_matmul(dx_chunk, k, Mat::rows(g, rows, co), w, false);
                            return;
                        }
                        // The im2col matrix is not needed any more: reuse it for dcol.
                        par_matmul(col, k, Mat::rows(g, rows, co), w, false);
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

    let (dw, db) = sum_partials(partials, k * co, co);
    ConvGrads {
        input: dx,
        weight: unpack_to_torch(s, dw),
        bias: db,
    }
}
