//! 2-D convolution of NHWC `f32` tensors: the forward pass with the bias and ReLU fused in, and
//! both gradients, by one of three algorithms that [`Algorithm::of`] picks from the shape:
//! stride-1 3×3 layers with enough input channels and outputs run as Winograd ([`winograd`]:
//! F(4×4, 3×3) from 8×8 outputs, always in fp32, F(2×2, 3×3) otherwise), other small outputs
//! with taps in the padding pixel by pixel ([`direct`]), every other shape as batched im2col +
//! GEMM ([`im2col`]).
//!
//! This module only dispatches. What the algorithms share (the shape, the packed weight, the
//! backward's chunk groups and their ordered sums) lives in `shape` and `shared`; each
//! algorithm imports from those (and [`Algorithm`], the name it goes by in the dispatch) and
//! never from another algorithm.
//!
//! Determinism, in every algorithm: each chunk's and tile's arithmetic is fixed by the shape,
//! and the weight gradient's per-chunk partial sums go to [`ACCUMULATORS`] accumulators (each a
//! fixed, contiguous run of chunks, taken in order) that are added in a fixed order at the end.
//! The result is bit-identical whatever the number of threads.

pub mod direct;
pub mod im2col;
mod shape;
mod shared;
pub mod winograd;

use std::borrow::Cow;

pub use shape::ConvShape;
pub use shared::{ACCUMULATORS, ConvGrads, PackedWeight, Wanted, Weight, WeightLayout};
use winograd::{Tile, WinogradWeight};

use crate::matmul::Precision;

/// Input channels from which a stride-1 3×3 convolution runs as Winograd (below,
/// its GEMMs are too narrow to gain; docs/journal/performance.md has the layer figures).
pub(crate) const WINOGRAD_MIN_CHANNELS: usize = 32;
/// ...and the output side from which it does: on smaller outputs most of a tile's 4×4 input
/// block is padding and the weight's transforms (16 values for 9, every step) cost more than
/// the GEMMs save.
pub(crate) const WINOGRAD_MIN_SIDE: usize = 4;

/// ...and the output side from which it takes 4×4 tiles (F(4×4, 3×3): 36 products for 16
/// outputs, against F(2×2)'s 64), which take less time than F(2×2) from 8×8 outputs; at 4×4
/// one tile covers the image, and its 36 planes of transformed weights (2.25× F(2×2)'s, every
/// step) cost more than its GEMMs save.
///
/// Its products always run in fp32, bf16 mode too ([`Algorithm::precision`]): rounded to bf16,
/// its transformed values (scaled by up to 8 before rounding to 8 bits of mantissa) put the
/// result 3–21 % off, against F(2×2)'s 1 %, and in fp32 it is faster than F(2×2) in bf16.
pub(crate) const WINOGRAD4_MIN_SIDE: usize = 8;

/// Whether [`Prepared::new`] computes `s` with Winograd.
fn winograd_pays(s: &ConvShape) -> bool {
    let [oh, ow] = s.out_size();
    winograd::applies(s, WINOGRAD_MIN_CHANNELS) && oh.min(ow) >= WINOGRAD_MIN_SIDE
}

/// The algorithms, as [`Prepared::new`] picks them for a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Stride-1 3×3 layers from 4×4 outputs and 32 input channels (module `winograd`), by
    /// F(2×2, 3×3)...
    Winograd,
    /// ...or, from 8×8 outputs, by F(4×4, 3×3) (in fp32 only).
    Winograd4,
    /// Other small outputs with taps in the padding, pixel by pixel (module `direct`).
    Direct,
    /// Everything else.
    Im2col,
}

impl Algorithm {
    /// The algorithm for `s`.
    pub fn of(s: &ConvShape) -> Self {
        let [oh, ow] = s.out_size();
        if winograd_pays(s) && oh.min(ow) >= WINOGRAD4_MIN_SIDE {
            Algorithm::Winograd4
        } else if winograd_pays(s) {
            Algorithm::Winograd
        } else if direct::pays(s) {
            Algorithm::Direct
        } else {
            Algorithm::Im2col
        }
    }

    /// The multiply-adds of the forward's GEMMs when this algorithm computes `s` (each gradient
    /// takes as many): Winograd's α² products a tile, the direct kernel's taps inside the
    /// image, im2col's whole windows. What `trainctl bench --layers` divides by the time for
    /// the rate the GEMMs actually run at, beside the direct algorithm's count, which is the
    /// same for every algorithm.
    pub fn multiply_adds(self, s: &ConvShape) -> usize {
        let pairs = s.batch * s.c_in * s.c_out;
        match self {
            Algorithm::Winograd => winograd::products_per_image(s, Tile::F2) * pairs,
            Algorithm::Winograd4 => winograd::products_per_image(s, Tile::F4) * pairs,
            Algorithm::Direct => direct::useful_taps(s) * pairs,
            Algorithm::Im2col => {
                let [oh, ow] = s.out_size();
                oh * ow * s.kernel[0] * s.kernel[1] * pairs
            }
        }
    }

    /// What this algorithm's GEMMs round their inputs to when `asked` is: `asked`, but fp32
    /// for F(4×4) Winograd (see [`WINOGRAD4_MIN_SIDE`]).
    pub fn precision(self, asked: Precision) -> Precision {
        match self {
            Algorithm::Winograd4 => Precision::F32,
            Algorithm::Winograd | Algorithm::Direct | Algorithm::Im2col => asked,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Direct => "direct",
            Algorithm::Winograd => "winograd",
            Algorithm::Winograd4 => "winograd4",
            Algorithm::Im2col => "im2col",
        }
    }

    /// The name of its pass `what` on `s` in [`crate::phases`], made only while recording:
    /// `conv 3x3/1 256->256 at 4x4 (winograd): input transform`.
    pub(crate) fn phase<'a>(self, s: &'a ConvShape, what: &'a str) -> impl FnOnce() -> String + 'a {
        move || format!("{}: {what}", layer_name(s, self))
    }
}

/// `conv 3x3/1 256->256 at 4x4 (winograd)`: a convolution as `trainctl bench --layers` names
/// it, by its shape and the algorithm that computes it (the operation profile's rows and the
/// passes of [`crate::phases`] alike).
pub fn layer_name(s: &ConvShape, algorithm: Algorithm) -> String {
    format!("conv {} ({})", s.label(), algorithm.name())
}

/// A layer's weight, transformed for the algorithm its shape gets.
#[derive(Clone, Debug, PartialEq)]
pub enum Prepared<'w> {
    Im2col(PackedWeight<'w>),
    Winograd(WinogradWeight),
    Direct(PackedWeight<'w>),
}

impl<'w> Prepared<'w> {
    /// The algorithm for `s` and the weight transformed for it, its GEMMs rounding their
    /// inputs to `precision` where the algorithm takes it ([`Algorithm::precision`]).
    pub fn new(s: &ConvShape, weight: Weight<'w>, precision: Precision) -> Self {
        let algorithm = Algorithm::of(s);
        Prepared::with(algorithm, s, weight).in_precision(algorithm.precision(precision))
    }

    /// The weight transformed for `algorithm`, whether or not it is the one `s` gets (each
    /// computes any shape but Winograd, which needs a stride-1 3×3 kernel).
    pub fn with(algorithm: Algorithm, s: &ConvShape, weight: Weight<'w>) -> Self {
        match algorithm {
            Algorithm::Direct => Prepared::Direct(PackedWeight::new(s, weight)),
            Algorithm::Winograd => Prepared::Winograd(WinogradWeight::new(s, weight, Tile::F2)),
            Algorithm::Winograd4 => Prepared::Winograd(WinogradWeight::new(s, weight, Tile::F4)),
            Algorithm::Im2col => Prepared::Im2col(PackedWeight::new(s, weight)),
        }
    }

    /// This weight with its GEMMs' inputs rounded to `precision` (f32 unless asked).
    pub(crate) fn in_precision(mut self, precision: Precision) -> Self {
        match &mut self {
            Prepared::Im2col(w) | Prepared::Direct(w) => w.precision = precision,
            Prepared::Winograd(u) => u.precision = precision,
        }
        self
    }

    /// Whether it borrows the weight's values (im2col's and the direct kernel's, from the
    /// kernels' layout): then the weight must outlive it, and re-preparing it costs nothing.
    pub fn borrows(&self) -> bool {
        match self {
            Prepared::Im2col(w) | Prepared::Direct(w) => matches!(w.data, Cow::Borrowed(_)),
            Prepared::Winograd(_) => false,
        }
    }

    /// This weight owning its values (a copy when they are borrowed).
    pub fn into_owned(self) -> Prepared<'static> {
        match self {
            Prepared::Im2col(w) => Prepared::Im2col(w.into_owned()),
            Prepared::Direct(w) => Prepared::Direct(w.into_owned()),
            Prepared::Winograd(u) => Prepared::Winograd(u),
        }
    }

    /// The layout the weight came in, which [`backward`]'s weight gradient goes back in.
    pub fn layout(&self) -> WeightLayout {
        match self {
            Prepared::Im2col(w) | Prepared::Direct(w) => w.layout,
            Prepared::Winograd(u) => u.layout,
        }
    }

    /// What this weight's GEMMs round their inputs to.
    pub fn precision(&self) -> Precision {
        match self {
            Prepared::Im2col(w) | Prepared::Direct(w) => w.precision,
            Prepared::Winograd(u) => u.precision,
        }
    }
}

/// `y = conv(x, w) + bias`, then ReLU when `relu`; `x` and `y` NHWC.
pub fn forward(
    s: &ConvShape,
    x: &[f32],
    weight: &Prepared<'_>,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    match weight {
        Prepared::Im2col(w) => im2col::forward(s, x, w, bias, relu),
        Prepared::Winograd(u) => winograd::forward(s, x, u, bias, relu),
        Prepared::Direct(w) => direct::forward(s, x, w, bias, relu),
    }
}

/// Gradients of [`forward`] given `dy` (NHWC), the weight's in the layout it came in. With the
/// ReLU fused, `relu_output` is the forward's output: the gradient passes where it is positive.
pub fn backward(
    s: &ConvShape,
    x: &[f32],
    weight: &Prepared<'_>,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    wanted: Wanted,
) -> ConvGrads {
    match weight {
        Prepared::Im2col(w) => im2col::backward(s, x, w, relu_output, dy, wanted),
        Prepared::Winograd(u) => winograd::backward(s, x, u, relu_output, dy, wanted),
        Prepared::Direct(w) => direct::backward(s, x, w, relu_output, dy, wanted),
    }
}
