//! What the convolution algorithms share: the packed weight, the backward's chunk groups and
//! their ordered sums, the upstream gradient through a fused ReLU, the taps inside the image.

use std::borrow::Cow;

use super::ConvShape;
use crate::layout::{transpose_each, transpose_into};
use crate::matmul::{Mat, PackedRhs, Precision, RhsPanels};
use crate::scratch::{Scratch, scratch};

/// Partial sums of the weight gradient, fixed so that the sum's order never depends on the
/// thread count; also the most threads the weight gradient can use.
pub const ACCUMULATORS: usize = 8;

/// Gradients of a convolution; the weight gradient in the layout the weight came in, the
/// others when [`Wanted`].
#[derive(Debug, Clone)]
pub struct ConvGrads {
    pub input: Option<Vec<f32>>,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

/// The gradients a backward computes besides the weight's: the input's (not for a network's
/// first layer) and the bias's (not for a layer without one: a ResNet's, whose batch norm
/// follows; its sum is a pass over the output gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub input: bool,
    pub bias: bool,
}

impl Wanted {
    pub const ALL: Wanted = Wanted {
        input: true,
        bias: true,
    };

    /// Elements of the bias gradient's sums: the output channels, or none.
    pub(crate) fn bias_len(self, c_out: usize) -> usize {
        if self.bias { c_out } else { 0 }
    }
}

/// How a convolution weight's values lie.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLayout {
    /// PyTorch's `[c_out][c_in][kh][kw]`.
    #[default]
    Torch,
    /// The kernels' own `[c_out][kh][kw][c_in]`: each output channel's taps before its input
    /// channels, an im2col row. im2col and the direct kernel multiply by it as it lies, and
    /// their weight gradient comes out so; a weight kept this way between steps (trainctl's
    /// trainer does) spares two passes over it a step. For a 1×1 kernel both are the same.
    TapsFirst,
}

/// A convolution weight: its values and how they lie.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'a> {
    pub values: &'a [f32],
    pub layout: WeightLayout,
}

impl<'a> Weight<'a> {
    /// A weight in PyTorch's layout.
    pub fn torch(values: &'a [f32]) -> Self {
        Weight {
            values,
            layout: WeightLayout::Torch,
        }
    }

    #[cfg(test)]
    /// A weight in the kernels' layout ([`WeightLayout::TapsFirst`]).
    pub(crate) fn taps_first(values: &'a [f32]) -> Self {
        Weight {
            values,
            layout: WeightLayout::TapsFirst,
        }
    }
}

/// The weight with each output channel's taps before its input channels: `[c_out][k]`, row
/// `(ky, kx, c)` as an im2col row; its transpose is the GEMM's right-hand side. From PyTorch's
/// layout, one pass (none for a 1×1 kernel), each output channel in cache; the kernels' own
/// layout is this, borrowed as it lies.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedWeight<'w> {
    pub data: Cow<'w, [f32]>,
    /// What the GEMMs round their inputs to.
    pub precision: Precision,
    /// The layout the weight came in, which its gradient goes back in.
    pub layout: WeightLayout,
}

impl<'w> PackedWeight<'w> {
    pub fn new(shape: &ConvShape, weight: Weight<'w>) -> Self {
        assert_eq!(weight.values.len(), shape.weight_len(), "weight size");
        let taps = shape.kernel[0] * shape.kernel[1];
        let data = if taps == 1 || weight.layout == WeightLayout::TapsFirst {
            Cow::Borrowed(weight.values)
        } else {
            Cow::Owned(transpose_each(weight.values, shape.c_in, taps))
        };
        PackedWeight {
            data,
            precision: Precision::F32,
            layout: weight.layout,
        }
    }

    /// This weight owning its values (a copy when they are borrowed).
    pub fn into_owned(self) -> PackedWeight<'static> {
        PackedWeight {
            data: Cow::Owned(self.data.into_owned()),
            ..self
        }
    }
}

/// A `[c_out][k]` weight gradient in `layout`: as it is for the kernels' own, one pass back
/// for PyTorch's.
pub(crate) fn unpack(shape: &ConvShape, packed: Vec<f32>, layout: WeightLayout) -> Vec<f32> {
    let taps = shape.kernel[0] * shape.kernel[1];
    if taps == 1 || layout == WeightLayout::TapsFirst {
        return packed;
    }
    transpose_each(&packed, taps, shape.c_in)
}

/// A group's chunks: the chunk index and, when the input gradient is wanted, its slice of it
/// (`T`: `f32`, or `MaybeUninit<f32>` for a kernel that writes each chunk whole).
pub(crate) type ChunkGroup<'a, T = f32> = Vec<(usize, Option<&'a mut [T]>)>;

/// The backward pass's chunks, shared out to the weight gradient's accumulators: each group a
/// contiguous, equal (±1) run of chunks, so that rayon's halving of the group list halves the
/// work. Each chunk carries its slice of the input gradient when there is one.
pub(crate) fn accumulator_groups<T>(
    dx: Option<&mut [T]>,
    chunk_len: usize,
    chunks: usize,
) -> Vec<ChunkGroup<'_, T>> {
    let groups = ACCUMULATORS.min(chunks);
    let mut work: Vec<ChunkGroup<T>> = (0..groups).map(|_| Vec::new()).collect();
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
/// is one (into `masked`), with its sum over pixels added to the bias gradient `db` unless
/// that is empty (not wanted).
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
    if db.is_empty() {
        return g;
    }
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

/// The forward GEMMs' right-hand side, the weight as `[k][c_out]`. In f32, the packed weight
/// transposed into scratch: gemm runs up to 4× faster on it than on the transposed view when
/// the product has few rows (a ResNet's deep layers; docs/PERFORMANCE.md). In bf16, the
/// transposed view packed once into bf16 panels for every product of the layer (no transpose
/// pass: the packing reads the view's columns as they lie).
pub(crate) struct ForwardRhs<'a> {
    transposed: Option<Scratch>,
    weight: &'a PackedWeight<'a>,
    packed: PackedRhs,
    k: usize,
    c_out: usize,
}

impl<'a> ForwardRhs<'a> {
    /// Checks the forward's input and weight sizes, and lays the weight out.
    pub(crate) fn new(s: &ConvShape, x: &[f32], weight: &'a PackedWeight<'a>) -> Self {
        assert_eq!(x.len(), s.input_len(), "convolution input size");
        assert_eq!(weight.data.len(), s.weight_len(), "convolution weight size");
        let (k, c_out) = (s.k(), s.c_out);
        let transposed = (weight.precision == Precision::F32).then(|| {
            let mut rhs = scratch(k * c_out);
            transpose_into(&weight.data, &mut rhs, c_out, k);
            rhs
        });
        let mat = match &transposed {
            Some(t) => Mat::rows(t, k, c_out),
            None => Mat::rows(&weight.data, c_out, k).t(),
        };
        let packed = PackedRhs::new(mat, weight.precision);
        ForwardRhs {
            transposed,
            weight,
            packed,
            k,
            c_out,
        }
    }

    /// The `[k][c_out]` matrix.
    pub(crate) fn mat(&self) -> Mat<'_> {
        match &self.transposed {
            Some(t) => Mat::rows(t, self.k, self.c_out),
            None => Mat::rows(&self.weight.data, self.c_out, self.k).t(),
        }
    }

    /// Its rows `rows` (all columns) as packed panels, when packed.
    pub(crate) fn panels(&self, rows: std::ops::Range<usize>) -> Option<RhsPanels<'_>> {
        self.packed.view(rows, 0..self.c_out)
    }
}

/// ReLU in place; `<`, not `max`: a NaN stays a NaN, as in PyTorch.
pub(crate) fn relu_in_place(y: &mut [f32]) {
    for v in y.iter_mut() {
        if *v < 0.0 {
            *v = 0.0;
        }
    }
}
