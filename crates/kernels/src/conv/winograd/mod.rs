//! Winograd F(m×m, 3×3) for stride-1 3×3 convolutions, with output tiles of 2×2 or 4×4
//! ([`Tile`]): each m×m block of outputs comes from an α×α block of inputs (α = m + 2) through α²
//! independent channel products, so the GEMM work is α²/(9m²) of a direct convolution's: 4/9
//! for F(2×2, 3×3), 1/4 for F(4×4, 3×3) (Lavin & Gray, "Fast Algorithms for Convolutional
//! Neural Networks", 2015). The forward pass and both gradients share the transforms
//! (module `transforms`):
//!
//! - forward: `V = Bᵀ d B` per input block, `M[ξ] = V[ξ] · U[ξ]` for the α² positions ξ, with
//!   `U = G g Gᵀ` the transformed weights, then `y = Aᵀ M A`;
//! - backward: `dM = A dy Aᵀ`, `dU[ξ] += V[ξ]ᵀ · dM[ξ]` (then `dW = Gᵀ dU G`), and
//!   `dV[ξ] = dM[ξ] · U[ξ]ᵀ`, scattered back as `dd = B dV Bᵀ` into the overlapping input blocks.
//!
//! Chunks of images and the weight gradient's accumulators work as in `conv` (deterministic
//! whatever the thread count); inside a chunk the transforms run image by image and the α²
//! GEMMs side by side, each on one thread.

mod transforms;

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::shared::{
    ConvGrads, Wanted, Weight, WeightLayout, accumulator_groups, check_backward_sizes,
    chunk_gradient, sum_partials,
};
use super::{Algorithm, ConvShape};
use crate::matmul::{Mat, PackedRhs, Precision, matmul, matmul_packed, matmul_uninit};
use crate::phases;
use crate::scratch::{par_filled, par_written, with_scratch};
pub use transforms::Tile;
use transforms::{LANES, MAX_ALPHA, pieces, pieces_mut, transform_weights, weight_grad_block};

impl Tile {
    /// `what`'s name in [`crate::phases`], for the algorithm this tile is, on `s` (the name is
    /// made only while recording).
    fn phase<'a>(self, s: &'a ConvShape, what: &'a str) -> impl FnOnce() -> String + 'a {
        let algorithm = match self {
            Tile::F2 => Algorithm::Winograd,
            Tile::F4 => Algorithm::Winograd4,
        };
        algorithm.phase(s, what)
    }
}

/// Transformed data of one chunk (V and M, or dM and dV) are kept under this size (bytes).
const CHUNK_BYTES: usize = 6 << 20;

/// Whether Winograd can compute this convolution: a 3×3 kernel at stride 1 with at least
/// `min_channels` input channels (below that, the GEMMs are too narrow to gain).
pub fn applies(s: &ConvShape, min_channels: usize) -> bool {
    s.kernel == [3, 3] && s.stride == [1, 1] && s.c_in >= min_channels
}

/// The transformed weights `U`: `[c_in][α²][c_out]` (each input channel's α² rows followed by
/// [`ROW_PAD`] unused floats), so that each input channel's values are written by one thread in
/// one pass; [`WinogradWeight::plane`] views position ξ as the `c_in × c_out` matrix of the
/// GEMMs.
#[derive(Clone, Debug, PartialEq)]
pub struct WinogradWeight {
    pub data: Vec<f32>,
    pub tile: Tile,
    /// What the GEMMs round their inputs to.
    pub precision: Precision,
    /// The layout the weight came in, which its gradient goes back in.
    pub layout: WeightLayout,
}

impl WinogradWeight {
    /// `U = G g Gᵀ` for every (input, output) channel pair, each block of input channels on
    /// its own thread.
    pub fn new(s: &ConvShape, weight: Weight, tile: Tile) -> Self {
        assert_eq!(weight.values.len(), s.weight_len(), "weight size");
        let (ci, co) = (s.c_in, s.c_out);
        let row = tile.planes() * co + ROW_PAD;
        let data = phases::timed(tile.phase(s, "weight transform"), || {
            par_filled(ci * row, LANES * row, |block, u| {
                transform_weights(tile, weight, ci, co, block * LANES, ROW_PAD, u)
            })
        });
        WinogradWeight {
            data,
            tile,
            precision: Precision::F32,
            layout: weight.layout,
        }
    }

    /// The α² planes (or their transposes) packed once for every chunk's products: bf16
    /// panels in bf16; none in f32, which the `gemm` crate packs per product.
    fn packed_planes(&self, ci: usize, co: usize, transposed: bool) -> Vec<PackedRhs> {
        if self.precision == Precision::F32 {
            return Vec::new();
        }
        (0..self.tile.planes())
            .into_par_iter()
            .map(|xi| {
                let plane = self.plane(xi, ci, co);
                PackedRhs::new(if transposed { plane.t() } else { plane }, self.precision)
            })
            .collect()
    }

    /// Position ξ's `c_in × c_out` matrix (rows `α² · c_out + ROW_PAD` apart).
    fn plane(&self, xi: usize, ci: usize, co: usize) -> Mat<'_> {
        Mat {
            data: &self.data[xi * co..],
            rows: ci,
            cols: co,
            row_stride: self.tile.planes() * co + ROW_PAD,
            col_stride: 1,
        }
    }
}

/// Floats after each input channel's rows of `U`: without them the rows of a plane would be a
/// power of two apart whenever `c_out` is (64 KiB for 1,024 channels), every row in the same
/// cache sets, and the input gradient's products would slow down.
const ROW_PAD: usize = 16;

/// `dW = Gᵀ dU G` back into `layout` from dU (`[α²][c_in][c_out]`), in one pass: each block
/// of output channels on its own thread.
fn weight_grad(s: &ConvShape, tile: Tile, du: &[f32], layout: WeightLayout) -> Vec<f32> {
    let ci = s.c_in;
    phases::timed(tile.phase(s, "weight gradient transform"), || {
        par_filled(s.weight_len(), LANES * 9 * ci, |block, w| {
            weight_grad_block(tile, du, ci, block * LANES, layout, w)
        })
    })
}

/// Tiles of one image and their grid.
#[derive(Clone, Copy)]
struct Tiling {
    tile: Tile,
    /// Output size.
    oh: usize,
    ow: usize,
    /// Tiles per row and per column.
    th: usize,
    tw: usize,
}

impl Tiling {
    fn of(s: &ConvShape, tile: Tile) -> Self {
        let [oh, ow] = s.out_size();
        Tiling {
            tile,
            oh,
            ow,
            th: oh.div_ceil(tile.side()),
            tw: ow.div_ceil(tile.side()),
        }
    }

    fn per_image(&self) -> usize {
        self.th * self.tw
    }

    /// α², the planes.
    fn planes(&self) -> usize {
        self.tile.planes()
    }
}

/// Products a channel pair's GEMMs take for one image of `s` with `tile`: α² a tile.
pub(crate) fn products_per_image(s: &ConvShape, tile: Tile) -> usize {
    let t = Tiling::of(s, tile);
    t.per_image() * t.planes()
}

fn images_per_chunk(s: &ConvShape, t: &Tiling) -> usize {
    let per_image = t.per_image() * t.planes() * (s.c_in + s.c_out) * 4;
    (CHUNK_BYTES / per_image.max(1)).clamp(1, s.batch)
}

/// `buf`, `[α²][images · piece]`, as each image's α² pieces: the transformed tiles of one
/// image in each of the planes, for the image's own thread to write.
fn planes_per_image(
    buf: &mut [f32],
    planes: usize,
    images: usize,
    piece: usize,
) -> Vec<Vec<&mut [f32]>> {
    let mut out: Vec<Vec<&mut [f32]>> = (0..images).map(|_| Vec::with_capacity(planes)).collect();
    for plane in buf.chunks_mut(images * piece).take(planes) {
        for (pieces, p) in out.iter_mut().zip(plane.chunks_mut(piece)) {
            pieces.push(p);
        }
    }
    out
}

/// Planes `from..from + n` of an image's planes, at tile `tile` of `c` values (the rest empty).
#[inline(always)]
fn plane_pieces<'a>(
    planes: &'a mut [&mut [f32]],
    from: usize,
    n: usize,
    tile: usize,
    c: usize,
) -> [&'a mut [f32]; MAX_ALPHA] {
    let mut out: [&mut [f32]; MAX_ALPHA] = Default::default();
    for (piece, plane) in out.iter_mut().zip(&mut planes[from..from + n]) {
        *piece = &mut plane[tile * c..][..c];
    }
    out
}

/// Fills `v` (`[α²][tiles][c_in]`) for images `n0..n0 + images`, each image on its own thread.
fn transform_inputs(s: &ConvShape, t: &Tiling, x: &[f32], n0: usize, images: usize, v: &mut [f32]) {
    let image_len = s.height * s.width * s.c_in;
    planes_per_image(v, t.planes(), images, t.per_image() * s.c_in)
        .into_par_iter()
        .enumerate()
        .for_each(|(n, mut planes)| {
            input_image(s, t, &x[(n0 + n) * image_len..][..image_len], &mut planes)
        });
}

/// One image of [`transform_inputs`]: each tile's α×α input block (zeros outside the image)
/// through `Bᵀ d B` into the image's planes (each `[tiles][c]`), compiled for the CPU's widest
/// vectors.
#[multiversion::multiversion(targets = "simd")]
fn input_image(s: &ConvShape, t: &Tiling, img: &[f32], planes: &mut [&mut [f32]]) {
    let (c, a, m, tile_kind) = (s.c_in, t.tile.alpha(), t.tile.side(), t.tile);
    let zeros = vec![0.0f32; c];
    let mut r = vec![0.0f32; a * a * c];
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = ty * t.tw + tx;
            // Bᵀ d down each column j of the block (pixels outside the image are zeros): r[i][j].
            for j in 0..a {
                let ix = (m * tx + j).wrapping_sub(s.padding[1]);
                let mut column: [&[f32]; MAX_ALPHA] = [&[]; MAX_ALPHA];
                for (i, pixel) in column.iter_mut().enumerate().take(a) {
                    let iy = (m * ty + i).wrapping_sub(s.padding[0]);
                    *pixel = if iy < s.height && ix < s.width {
                        &img[(iy * s.width + ix) * c..][..c]
                    } else {
                        &zeros
                    };
                }
                tile_kind.bt(&mut pieces_mut(&mut r, a, j * c, a * c, c), &column);
            }
            // (Bᵀ d) B along each row i: V[ξ = αi + j].
            for i in 0..a {
                tile_kind.bt(
                    &mut plane_pieces(planes, i * a, a, tile, c),
                    &pieces(&r, a, i * a * c, c, c),
                );
            }
        }
    }
}

/// `y = conv(x, w) + bias`, then ReLU when `relu`; `x` and `y` NHWC.
pub fn forward(
    s: &ConvShape,
    x: &[f32],
    u: &WinogradWeight,
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    assert!(
        applies(s, 1),
        "Winograd needs a 3×3 stride-1 convolution: {s:?}"
    );
    assert_eq!(x.len(), s.input_len(), "convolution input size");
    let t = Tiling::of(s, u.tile);
    let (ci, co) = (s.c_in, s.c_out);
    assert_eq!(
        u.data.len(),
        ci * (t.planes() * co + ROW_PAD),
        "transformed weight size"
    );
    let per_chunk = images_per_chunk(s, &t);
    let out_image = t.oh * t.ow * co;
    let planes = u.packed_planes(ci, co, false);
    // SAFETY: `output_transform` writes every element of the chunk's images (their tiles cover
    // each output pixel, see `output_image`): no zeroing pass first.
    unsafe {
        par_written(s.output_len(), per_chunk * out_image, |chunk, y| {
            let images = y.len() / out_image;
            let tiles = images * t.per_image();
            let np = t.planes();
            with_scratch([np * tiles * ci, np * tiles * co, 0], |v, m, _| {
                phases::timed(t.tile.phase(s, "input transform"), || {
                    transform_inputs(s, &t, x, chunk * per_chunk, images, v)
                });
                let v = &*v;
                phases::timed(t.tile.phase(s, "products"), || {
                    m.par_chunks_mut(tiles * co)
                        .enumerate()
                        .for_each(|(xi, m)| {
                            matmul_packed(
                                m,
                                co,
                                Mat::rows(&v[xi * tiles * ci..][..tiles * ci], tiles, ci),
                                u.plane(xi, ci, co),
                                planes.get(xi).and_then(|p| p.view(0..ci, 0..co)),
                                false,
                                u.precision,
                            );
                        })
                });
                phases::timed(t.tile.phase(s, "output transform"), || {
                    output_transform(s, &t, m, tiles, images, bias, relu, y)
                });
            });
        })
    }
}

/// `y = Aᵀ M A` per tile, plus bias and ReLU, into the chunk's outputs: every element of its
/// `images` images written once.
#[allow(clippy::too_many_arguments)]
fn output_transform(
    s: &ConvShape,
    t: &Tiling,
    m: &[f32],
    tiles: usize,
    images: usize,
    bias: Option<&[f32]>,
    relu: bool,
    y: &mut [MaybeUninit<f32>],
) {
    let co = s.c_out;
    let zeros = vec![0.0f32; co];
    let bias = bias.unwrap_or(&zeros);
    let y = &mut y[..images * t.oh * t.ow * co];
    y.par_chunks_mut(t.oh * t.ow * co)
        .enumerate()
        .for_each(|(n, y)| output_image(t, m, tiles, n, co, bias, relu, y));
}

/// Image `n` of [`output_transform`], compiled for the CPU's widest vectors.
#[multiversion::multiversion(targets = "simd")]
#[allow(clippy::too_many_arguments)]
fn output_image(
    t: &Tiling,
    m: &[f32],
    tiles: usize,
    n: usize,
    co: usize,
    bias: &[f32],
    relu: bool,
    y: &mut [MaybeUninit<f32>],
) {
    let (a, mo, tile_kind) = (t.tile.alpha(), t.tile.side(), t.tile);
    // Aᵀ M: mo rows of α vectors; then a row's mo outputs, each a vector of co.
    let mut r = vec![0.0f32; mo * a * co];
    let mut out = vec![0.0f32; mo * co];
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = (n * t.th + ty) * t.tw + tx;
            for j in 0..a {
                // Column j of M: M[i][j] = M[ξ = αi + j], plane ξ at tile `tile`.
                let column = pieces(m, a, (j * tiles + tile) * co, a * tiles * co, co);
                tile_kind.at(&mut pieces_mut(&mut r, mo, j * co, a * co, co), &column);
            }
            for i in 0..mo {
                let oy = mo * ty + i;
                if oy >= t.oh {
                    continue;
                }
                tile_kind.at(
                    &mut pieces_mut(&mut out, mo, 0, co, co),
                    &pieces(&r, a, i * a * co, co, co),
                );
                for (j, vals) in out.chunks_exact(co).enumerate() {
                    let ox = mo * tx + j;
                    if ox >= t.ow {
                        continue;
                    }
                    let dst = &mut y[(oy * t.ow + ox) * co..][..co];
                    for ((d, v), b) in dst.iter_mut().zip(vals).zip(bias) {
                        let v = v + b;
                        // `<`: a NaN stays a NaN.
                        d.write(if relu && v < 0.0 { 0.0 } else { v });
                    }
                }
            }
        }
    }
}

/// Gradients of [`forward`] given `dy` (NHWC); with the ReLU fused, `relu_output` is the
/// forward's output. The weight gradient is in the layout the weight came in.
pub fn backward(
    s: &ConvShape,
    x: &[f32],
    u: &WinogradWeight,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    wanted: Wanted,
) -> ConvGrads {
    assert!(
        applies(s, 1),
        "Winograd needs a 3×3 stride-1 convolution: {s:?}"
    );
    check_backward_sizes(s, x, relu_output, dy);
    let t = Tiling::of(s, u.tile);
    let np = t.planes();
    let (ci, co) = (s.c_in, s.c_out);
    let per_chunk = images_per_chunk(s, &t);
    let chunks = s.batch.div_ceil(per_chunk);
    let image_len = s.height * s.width * ci;
    let out_image = t.oh * t.ow * co;

    // Each chunk of dx is zeroed by `input_grad_transform` as it adds into it, in cache: no
    // zeroing pass over all of it first.
    let mut dx = Vec::with_capacity(if wanted.input { s.input_len() } else { 0 });
    let dx_runs = wanted
        .input
        .then(|| &mut dx.spare_capacity_mut()[..s.input_len()]);
    let planes = if wanted.input {
        u.packed_planes(ci, co, true)
    } else {
        Vec::new()
    };
    let work = accumulator_groups(dx_runs, per_chunk * image_len, chunks);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = work
        .into_par_iter()
        .map(|chunks| {
            // The group's first chunk writes its planes' weight gradients, the others add to
            // them: no zeroing pass first.
            let mut du = Vec::with_capacity(np * ci * co);
            let mut db = vec![0.0f32; wanted.bias_len(co)];
            for (i, (chunk, dx_chunk)) in chunks.into_iter().enumerate() {
                let n0 = chunk * per_chunk;
                let images = per_chunk.min(s.batch - n0);
                let tiles = images * t.per_image();
                let span = n0 * out_image..(n0 + images) * out_image;
                with_scratch(
                    [np * tiles * ci, np * tiles * co, images * out_image],
                    |v, dm, masked| {
                        let phase = |what| t.tile.phase(s, what);
                        let g = phases::timed(phase("output gradient (ReLU mask, bias)"), || {
                            chunk_gradient(dy, relu_output, span, masked, &mut db)
                        });
                        phases::timed(phase("input transform"), || {
                            transform_inputs(s, &t, x, n0, images, v)
                        });
                        phases::timed(phase("output gradient transform"), || {
                            output_grad_transform(&t, g, images, co, dm)
                        });
                        let dm = &*dm;
                        phases::timed(phase("weight gradient products"), || {
                            weight_grad_products(&mut du, i == 0, v, dm, tiles, (ci, co), u)
                        });
                        if let Some(dx_chunk) = dx_chunk {
                            // V is not needed any more: dV goes in its place.
                            phases::timed(phase("input gradient products"), || {
                                input_grad_products(v, dm, tiles, (ci, co), u, &planes)
                            });
                            phases::timed(phase("input gradient transform"), || {
                                input_grad_transform(s, &t, v, tiles, dx_chunk)
                            });
                        }
                    },
                );
            }
            (du, db)
        })
        .collect();

    let dx = wanted.input.then(|| {
        // SAFETY: the chunks tile the input gradient, and `input_grad_transform` wrote each whole.
        unsafe { dx.set_len(s.input_len()) };
        dx
    });
    let (dw, db) = sum_partials(partials, np * ci * co, wanted.bias_len(co));
    ConvGrads {
        input: dx,
        weight: weight_grad(s, u.tile, &dw, u.layout),
        bias: wanted.bias.then_some(db),
    }
}

/// `dU = Vᵀ dM` per plane, into the group's weight gradients `du`: written by the group's
/// `first` chunk, added to by the others (no zeroing pass first).
fn weight_grad_products(
    du: &mut Vec<f32>,
    first: bool,
    v: &[f32],
    dm: &[f32],
    tiles: usize,
    (ci, co): (usize, usize),
    u: &WinogradWeight,
) {
    let np = u.tile.planes();
    let vt = |xi: usize| Mat::rows(&v[xi * tiles * ci..][..tiles * ci], tiles, ci).t();
    let dm = |xi: usize| Mat::rows(&dm[xi * tiles * co..][..tiles * co], tiles, co);
    if !first {
        du.par_chunks_mut(ci * co)
            .enumerate()
            .for_each(|(xi, du)| matmul(du, co, vt(xi), dm(xi), true, u.precision));
        return;
    }
    du.spare_capacity_mut()[..np * ci * co]
        .par_chunks_mut(ci * co)
        .enumerate()
        .for_each(|(xi, du)| matmul_uninit(du, co, vt(xi), dm(xi), u.precision));
    // SAFETY: each plane's product wrote its whole `c_in × c_out` block, and the planes tile du.
    unsafe { du.set_len(np * ci * co) };
}

/// `dV = dM Uᵀ` per plane, in `v`'s place (V is not needed any more), with the planes packed
/// for the transposed product (`planes`, empty when not packed).
fn input_grad_products(
    v: &mut [f32],
    dm: &[f32],
    tiles: usize,
    (ci, co): (usize, usize),
    u: &WinogradWeight,
    planes: &[PackedRhs],
) {
    v.par_chunks_mut(tiles * ci)
        .enumerate()
        .for_each(|(xi, dv)| {
            matmul_packed(
                dv,
                ci,
                Mat::rows(&dm[xi * tiles * co..][..tiles * co], tiles, co),
                u.plane(xi, ci, co).t(),
                planes.get(xi).and_then(|p| p.view(0..co, 0..ci)),
                false,
                u.precision,
            );
        });
}

/// `dM = A dy Aᵀ` per tile (`dy` of the chunk's images, zero past the output's edge), each
/// image on its own thread.
fn output_grad_transform(t: &Tiling, g: &[f32], images: usize, co: usize, dm: &mut [f32]) {
    let out_image = t.oh * t.ow * co;
    planes_per_image(dm, t.planes(), images, t.per_image() * co)
        .into_par_iter()
        .enumerate()
        .for_each(|(n, mut planes)| {
            output_grad_image(t, &g[n * out_image..][..out_image], co, &mut planes)
        });
}

/// One image of [`output_grad_transform`] (`g` its output gradient), compiled for the CPU's
/// widest vectors.
#[multiversion::multiversion(targets = "simd")]
fn output_grad_image(t: &Tiling, g: &[f32], co: usize, planes: &mut [&mut [f32]]) {
    let (a, mo, tile_kind) = (t.tile.alpha(), t.tile.side(), t.tile);
    let zeros = vec![0.0f32; co];
    // A dy: α rows of mo vectors.
    let mut r = vec![0.0f32; a * mo * co];
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = ty * t.tw + tx;
            for j in 0..mo {
                // Column j of the tile's dy (zero past the output's edge) through A.
                let ox = mo * tx + j;
                let mut column: [&[f32]; MAX_ALPHA] = [&[]; MAX_ALPHA];
                for (i, pixel) in column.iter_mut().enumerate().take(mo) {
                    let oy = mo * ty + i;
                    *pixel = if oy < t.oh && ox < t.ow {
                        &g[(oy * t.ow + ox) * co..][..co]
                    } else {
                        &zeros
                    };
                }
                tile_kind.a(&mut pieces_mut(&mut r, a, j * co, mo * co, co), &column);
            }
            // (A dy) Aᵀ along each row i: dM[ξ = αi + j].
            for i in 0..a {
                tile_kind.a(
                    &mut plane_pieces(planes, i * a, a, tile, co),
                    &pieces(&r, mo, i * mo * co, co, co),
                );
            }
        }
    }
}

/// `dd = B dV Bᵀ` per tile, added into the chunk's input gradient (dropping the padding), each
/// image on its own thread, which zeroes it first: all of `dx` is written.
fn input_grad_transform(
    s: &ConvShape,
    t: &Tiling,
    dv: &[f32],
    tiles: usize,
    dx: &mut [MaybeUninit<f32>],
) {
    let c = s.c_in;
    let image_len = s.height * s.width * c;
    dx.par_chunks_mut(image_len)
        .enumerate()
        .for_each(|(n, img)| {
            img.fill(MaybeUninit::new(0.0));
            // SAFETY: every element was set on the line above.
            input_grad_image(s, t, dv, tiles, n, unsafe { img.assume_init_mut() })
        });
}

/// Image `n` of [`input_grad_transform`], compiled for the CPU's widest vectors.
#[multiversion::multiversion(targets = "simd")]
fn input_grad_image(
    s: &ConvShape,
    t: &Tiling,
    dv: &[f32],
    tiles: usize,
    n: usize,
    img: &mut [f32],
) {
    let (c, a, m, tile_kind) = (s.c_in, t.tile.alpha(), t.tile.side(), t.tile);
    let (mut r, mut dd) = (vec![0.0f32; a * a * c], vec![0.0f32; a * c]);
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = (n * t.th + ty) * t.tw + tx;
            // B dV down each column j, then · Bᵀ along each row.
            for j in 0..a {
                let column = pieces(dv, a, (j * tiles + tile) * c, a * tiles * c, c);
                tile_kind.b(&mut pieces_mut(&mut r, a, j * c, a * c, c), &column);
            }
            for i in 0..a {
                let iy = (m * ty + i).wrapping_sub(s.padding[0]);
                if iy >= s.height {
                    continue;
                }
                tile_kind.b(
                    &mut pieces_mut(&mut dd, a, 0, c, c),
                    &pieces(&r, a, i * a * c, c, c),
                );
                for (j, vals) in dd.chunks_exact(c).enumerate() {
                    let ix = (m * tx + j).wrapping_sub(s.padding[1]);
                    if ix >= s.width {
                        continue;
                    }
                    for (d, v) in img[(iy * s.width + ix) * c..][..c].iter_mut().zip(vals) {
                        *d += v;
                    }
                }
            }
        }
    }
}
