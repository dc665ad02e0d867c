//! Winograd F(2×2, 3×3) for stride-1 3×3 convolutions: each 2×2 block of outputs (a tile) comes
//! from a 4×4 block of inputs through 16 independent channel products, so the GEMM work is 4/9
//! of a direct convolution's (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks",
//! 2015). The forward pass and both gradients share the transforms:
//!
//! - forward: `V = Bᵀ d B` per input tile, `M[ξ] = V[ξ] · U[ξ]` for the 16 positions ξ, with
//!   `U = G g Gᵀ` the transformed weights, then `y = Aᵀ M A`;
//! - backward: `dM = A dy Aᵀ`, `dU[ξ] += V[ξ]ᵀ · dM[ξ]` (then `dW = Gᵀ dU G`), and
//!   `dV[ξ] = dM[ξ] · U[ξ]ᵀ`, scattered back as `dd = B dV Bᵀ` into the overlapping input tiles.
//!
//! Chunks of images and the weight gradient's accumulators work as in `conv` (deterministic
//! whatever the thread count); inside a chunk the transforms run image by image and the 16
//! GEMMs side by side, each on one thread.

use multiversion::multiversion;
use rayon::prelude::*;

use super::ConvShape;
use super::shared::{
    ConvGrads, accumulator_groups, check_backward_sizes, chunk_gradient, sum_partials,
};
use crate::matmul::{Mat, PackedRhs, Precision, matmul, matmul_packed};
use crate::scratch::{with_scratch, zeros};

/// Transformed data of one chunk (V and M, or dM and dV) are kept under this size (bytes).
const CHUNK_BYTES: usize = 6 << 20;

/// Whether F(2×2, 3×3) computes this convolution: a 3×3 kernel at stride 1 with at least
/// `min_channels` input channels (below that, the GEMMs are too narrow to gain).
pub fn applies(s: &ConvShape, min_channels: usize) -> bool {
    s.kernel == [3, 3] && s.stride == [1, 1] && s.c_in >= min_channels
}

/// The transformed weights `U`: `[c_in][16][c_out]` (each input channel's 16 rows followed by
/// [`ROW_PAD`] unused floats), so that each input channel's values are written by one thread in
/// one pass; [`WinogradWeight::plane`] views position ξ as the `c_in × c_out` matrix of the
/// GEMMs.
#[derive(Clone, Debug, PartialEq)]
pub struct WinogradWeight {
    pub data: Vec<f32>,
    /// What the GEMMs round their inputs to.
    pub precision: Precision,
}

impl WinogradWeight {
    /// `U = G g Gᵀ` for every (input, output) channel pair, from PyTorch's `[c_out, c_in, 3, 3]`,
    /// each input channel on its own thread.
    pub fn from_torch(s: &ConvShape, weight: &[f32]) -> Self {
        assert_eq!(weight.len(), s.weight_len(), "weight size");
        let (ci, co) = (s.c_in, s.c_out);
        let mut data = zeros(ci * (16 * co + ROW_PAD));
        data.par_chunks_mut(16 * co + ROW_PAD)
            .enumerate()
            .for_each(|(c, u)| transform_weights(weight, c, ci, &mut u[..16 * co]));
        WinogradWeight {
            data,
            precision: Precision::F32,
        }
    }

    /// The 16 planes (or their transposes) packed once for every chunk's products: bf16
    /// panels in bf16; none in f32, which the `gemm` crate packs per product.
    fn packed_planes(&self, ci: usize, co: usize, transposed: bool) -> Vec<PackedRhs> {
        if self.precision == Precision::F32 {
            return Vec::new();
        }
        (0..16)
            .into_par_iter()
            .map(|xi| {
                let plane = self.plane(xi, ci, co);
                PackedRhs::new(if transposed { plane.t() } else { plane }, self.precision)
            })
            .collect()
    }

    /// Position ξ's `c_in × c_out` matrix (rows `16 · c_out + ROW_PAD` apart).
    fn plane(&self, xi: usize, ci: usize, co: usize) -> Mat<'_> {
        Mat {
            data: &self.data[xi * co..],
            rows: ci,
            cols: co,
            row_stride: 16 * co + ROW_PAD,
            col_stride: 1,
        }
    }
}

/// Floats after each input channel's rows of `U`: without them the rows of a plane would be a
/// power of two apart whenever `c_out` is (64 KiB for 1,024 channels), every row in the same
/// cache sets: resnet18's 256→256 layer at 4×4 took 10.8–12.5 ms backward without the pad,
/// 8.6–10.7 with it (alone, 1 thread).
const ROW_PAD: usize = 16;

/// `U` of input channel `c` for every output channel into `u` (`[16][c_out]`): each output
/// channel's 16 values go to 16 runs written in order.
#[multiversion(targets = "simd")]
fn transform_weights(weight: &[f32], c: usize, ci: usize, u: &mut [f32]) {
    let co = u.len() / 16;
    for o in 0..co {
        let g = &weight[(o * ci + c) * 9..][..9];
        // G g (4×3), then (G g) Gᵀ (4×4).
        let mut gg = [[0.0f32; 3]; 4];
        for j in 0..3 {
            let (a, b, d) = (g[j], g[3 + j], g[6 + j]);
            gg[0][j] = a;
            gg[1][j] = 0.5 * (a + b + d);
            gg[2][j] = 0.5 * (a - b + d);
            gg[3][j] = d;
        }
        for (i, row) in gg.iter().enumerate() {
            let (a, b, d) = (row[0], row[1], row[2]);
            let values = [a, 0.5 * (a + b + d), 0.5 * (a - b + d), d];
            for (j, v) in values.into_iter().enumerate() {
                u[(i * 4 + j) * co + o] = v;
            }
        }
    }
}

/// Output channels per thread of [`weight_grad_to_torch`]: dU's values for them lie side by
/// side, so each cache line read serves the whole block.
const GRAD_BLOCK: usize = 16;

/// `dW = Gᵀ dU G` back into PyTorch's layout from dU (`[16][c_in][c_out]`), in one pass: each
/// block of output channels on its own thread.
fn weight_grad_to_torch(s: &ConvShape, du: &[f32]) -> Vec<f32> {
    let ci = s.c_in;
    let mut out = zeros(s.weight_len());
    out.par_chunks_mut(GRAD_BLOCK * 9 * ci)
        .enumerate()
        .for_each(|(block, w)| weight_grad_block(du, ci, block * GRAD_BLOCK, w));
    out
}

/// Output channels `o0..` of [`weight_grad_to_torch`] into `w_out` (`[o][c_in][9]`).
#[multiversion(targets = "simd")]
fn weight_grad_block(du: &[f32], ci: usize, o0: usize, w_out: &mut [f32]) {
    let co = du.len() / (16 * ci);
    for c in 0..ci {
        for (k, w) in w_out.chunks_exact_mut(9 * ci).enumerate() {
            let o = o0 + k;
            let m = |i: usize, j: usize| du[((i * 4 + j) * ci + c) * co + o];
            // Gᵀ dU (3×4): Gᵀ rows are [1, ½, ½, 0], [0, ½, -½, 0], [0, ½, ½, 1].
            let mut t = [[0.0f32; 4]; 3];
            let [r0, r1, r2] = &mut t;
            for (j, ((t0, t1), t2)) in r0
                .iter_mut()
                .zip(r1.iter_mut())
                .zip(r2.iter_mut())
                .enumerate()
            {
                let (a, b, d, e) = (m(0, j), m(1, j), m(2, j), m(3, j));
                *t0 = a + 0.5 * (b + d);
                *t1 = 0.5 * (b - d);
                *t2 = 0.5 * (b + d) + e;
            }
            let w = &mut w[c * 9..][..9];
            for (i, row) in t.iter().enumerate() {
                let (a, b, d, e) = (row[0], row[1], row[2], row[3]);
                w[i * 3] = a + 0.5 * (b + d);
                w[i * 3 + 1] = 0.5 * (b - d);
                w[i * 3 + 2] = 0.5 * (b + d) + e;
            }
        }
    }
}

/// Tiles of one image and their grid.
#[derive(Clone, Copy)]
struct Tiling {
    /// Output size.
    oh: usize,
    ow: usize,
    /// Tiles per row and per column.
    th: usize,
    tw: usize,
}

impl Tiling {
    fn of(s: &ConvShape) -> Self {
        let [oh, ow] = s.out_size();
        Tiling {
            oh,
            ow,
            th: oh.div_ceil(2),
            tw: ow.div_ceil(2),
        }
    }

    fn per_image(&self) -> usize {
        self.th * self.tw
    }
}

fn images_per_chunk(s: &ConvShape, t: &Tiling) -> usize {
    let per_image = t.per_image() * 16 * (s.c_in + s.c_out) * 4;
    (CHUNK_BYTES / per_image.max(1)).clamp(1, s.batch)
}

/// Elementwise `dst = a + b`, `a - b`, ... over channel vectors: the transforms are made of
/// these, each a loop the compiler vectorises.
#[inline(always)]
fn add(dst: &mut [f32], a: &[f32], b: &[f32]) {
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = x + y;
    }
}

#[inline(always)]
fn sub(dst: &mut [f32], a: &[f32], b: &[f32]) {
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = x - y;
    }
}

#[inline(always)]
fn neg(dst: &mut [f32], a: &[f32]) {
    for (d, x) in dst.iter_mut().zip(a) {
        *d = -x;
    }
}

#[inline(always)]
fn add_into(dst: &mut [f32], a: &[f32]) {
    for (d, x) in dst.iter_mut().zip(a) {
        *d += x;
    }
}

/// The 4-point transform `Bᵀ`: `[x0 - x2, x1 + x2, x2 - x1, x1 - x3]`, on 4 vectors of `c`
/// (`src[k]`), into `dst[k]`.
#[inline(always)]
fn bt4(dst: [&mut [f32]; 4], src: [&[f32]; 4]) {
    let [d0, d1, d2, d3] = dst;
    sub(d0, src[0], src[2]);
    add(d1, src[1], src[2]);
    sub(d2, src[2], src[1]);
    sub(d3, src[1], src[3]);
}

/// Its adjoint `B`: `[x0, x1 - x2 + x3, x1 + x2 - x0, -x3]`.
#[inline(always)]
fn b4(dst: [&mut [f32]; 4], src: [&[f32]; 4]) {
    let [d0, d1, d2, d3] = dst;
    d0.copy_from_slice(src[0]);
    sub(d1, src[1], src[2]);
    add_into(d1, src[3]);
    add(d2, src[1], src[2]);
    for (d, x) in d2.iter_mut().zip(src[0]) {
        *d -= x;
    }
    neg(d3, src[3]);
}

/// Four consecutive `len`-long pieces of `buf` starting at `at`, stepping by `step`.
fn four(buf: &[f32], at: usize, step: usize, len: usize) -> [&[f32]; 4] {
    std::array::from_fn(|k| &buf[at + k * step..][..len])
}

/// The same, mutable (the pieces must not overlap: `step >= len`).
fn four_mut(buf: &mut [f32], at: usize, step: usize, len: usize) -> [&mut [f32]; 4] {
    assert!(step >= len, "pieces overlap");
    let (_, rest) = buf.split_at_mut(at);
    let (a, rest) = rest.split_at_mut(step);
    let (b, rest) = rest.split_at_mut(step);
    let (c, d) = rest.split_at_mut(step);
    [&mut a[..len], &mut b[..len], &mut c[..len], &mut d[..len]]
}

/// `buf`, `[16][images · piece]`, as each image's 16 pieces: the transformed tiles of one image
/// in each of the 16 planes, for the image's own thread to write.
fn planes_per_image(buf: &mut [f32], images: usize, piece: usize) -> Vec<Vec<&mut [f32]>> {
    let mut out: Vec<Vec<&mut [f32]>> = (0..images).map(|_| Vec::with_capacity(16)).collect();
    for plane in buf.chunks_mut(images * piece).take(16) {
        for (pieces, p) in out.iter_mut().zip(plane.chunks_mut(piece)) {
            pieces.push(p);
        }
    }
    out
}

/// Four of an image's planes (`planes[4i..4i + 4]`), at tile `t` of `c` values.
fn four_planes<'a>(
    planes: &'a mut [&mut [f32]],
    i: usize,
    t: usize,
    c: usize,
) -> [&'a mut [f32]; 4] {
    let [p0, p1, p2, p3] = &mut planes[4 * i..4 * i + 4] else {
        unreachable!("four planes")
    };
    [p0, p1, p2, p3].map(|p| &mut p[t * c..][..c])
}

/// The 4×4 input block of tile (ty, tx) of `img` (zeros outside the image) through `Bᵀ d B`
/// into the image's 16 planes of `v` (each `[tiles][c]`, tile index `t`). `d` and `r` are
/// scratch of `16 · c`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn input_transform(
    s: &ConvShape,
    img: &[f32],
    ty: usize,
    tx: usize,
    t: usize,
    v: &mut [&mut [f32]],
    d: &mut [f32],
    r: &mut [f32],
) {
    let c = s.c_in;
    for i in 0..4 {
        let iy = (2 * ty + i).wrapping_sub(s.padding[0]);
        for j in 0..4 {
            let ix = (2 * tx + j).wrapping_sub(s.padding[1]);
            let dst = &mut d[(i * 4 + j) * c..][..c];
            if iy < s.height && ix < s.width {
                dst.copy_from_slice(&img[(iy * s.width + ix) * c..][..c]);
            } else {
                dst.fill(0.0);
            }
        }
    }
    // Bᵀ d down each column j: r[i][j].
    for j in 0..4 {
        let src = four(d, j * c, 4 * c, c);
        bt4(four_mut(r, j * c, 4 * c, c), src);
    }
    // (Bᵀ d) B along each row i: V[ξ = 4i + j].
    for i in 0..4 {
        let src = four(r, i * 4 * c, c, c);
        bt4(four_planes(v, i, t, c), src);
    }
}

/// Fills `v` (`[16][tiles][c_in]`) for images `n0..n0 + images`, each image on its own thread.
fn transform_inputs(s: &ConvShape, t: &Tiling, x: &[f32], n0: usize, images: usize, v: &mut [f32]) {
    let image_len = s.height * s.width * s.c_in;
    planes_per_image(v, images, t.per_image() * s.c_in)
        .into_par_iter()
        .enumerate()
        .for_each(|(n, mut planes)| {
            input_image(s, t, &x[(n0 + n) * image_len..][..image_len], &mut planes)
        });
}

/// One image of [`transform_inputs`], compiled for the CPU's widest vectors.
#[multiversion(targets = "simd")]
fn input_image(s: &ConvShape, t: &Tiling, img: &[f32], planes: &mut [&mut [f32]]) {
    let (mut d, mut r) = (vec![0.0f32; 16 * s.c_in], vec![0.0f32; 16 * s.c_in]);
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = ty * t.tw + tx;
            input_transform(s, img, ty, tx, tile, planes, &mut d, &mut r);
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
        "Winograd F(2×2, 3×3) needs a 3×3 stride-1 convolution: {s:?}"
    );
    assert_eq!(x.len(), s.input_len(), "convolution input size");
    assert_eq!(
        u.data.len(),
        s.c_in * (16 * s.c_out + ROW_PAD),
        "transformed weight size"
    );
    let t = Tiling::of(s);
    let (ci, co) = (s.c_in, s.c_out);
    let per_chunk = images_per_chunk(s, &t);
    let out_image = t.oh * t.ow * co;
    let planes = u.packed_planes(ci, co, false);
    let mut out = zeros(s.output_len());
    out.par_chunks_mut(per_chunk * out_image)
        .enumerate()
        .for_each(|(chunk, y)| {
            let images = y.len() / out_image;
            let tiles = images * t.per_image();
            with_scratch([16 * tiles * ci, 16 * tiles * co, 0], |v, m, _| {
                transform_inputs(s, &t, x, chunk * per_chunk, images, v);
                let v = &*v;
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
                    });
                output_transform(s, &t, m, tiles, images, bias, relu, y);
            });
        });
    out
}

/// `y = Aᵀ M A` per tile, plus bias and ReLU, into the chunk's outputs.
#[allow(clippy::too_many_arguments)]
fn output_transform(
    s: &ConvShape,
    t: &Tiling,
    m: &[f32],
    tiles: usize,
    images: usize,
    bias: Option<&[f32]>,
    relu: bool,
    y: &mut [f32],
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
#[multiversion(targets = "simd")]
#[allow(clippy::too_many_arguments)]
fn output_image(
    t: &Tiling,
    m: &[f32],
    tiles: usize,
    n: usize,
    co: usize,
    bias: &[f32],
    relu: bool,
    y: &mut [f32],
) {
    // Aᵀ M (2 rows of 4), then the tile's 4 outputs, each a vector of co.
    let mut r = vec![0.0f32; 8 * co];
    let mut out = vec![0.0f32; 4 * co];
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = (n * t.th + ty) * t.tw + tx;
            for j in 0..4 {
                // Column j of M: M[i][j] = M[ξ = 4i + j].
                let col = four(m, (j * tiles + tile) * co, 4 * tiles * co, co);
                let [r0, r1] = two_mut(&mut r, j * co, 4 * co, co);
                add(r0, col[0], col[1]);
                add_into(r0, col[2]);
                sub(r1, col[1], col[2]);
                for (d, x) in r1.iter_mut().zip(col[3]) {
                    *d -= x;
                }
            }
            for a in 0..2 {
                let row = four(&r, a * 4 * co, co, co);
                let [o0, o1] = two_mut(&mut out, 2 * a * co, co, co);
                add(o0, row[0], row[1]);
                add_into(o0, row[2]);
                add_into(o0, bias);
                sub(o1, row[1], row[2]);
                for ((d, x), b) in o1.iter_mut().zip(row[3]).zip(bias) {
                    *d += b - x;
                }
            }
            for (k, vals) in out.chunks_exact(co).enumerate() {
                let (oy, ox) = (2 * ty + k / 2, 2 * tx + k % 2);
                if oy >= t.oh || ox >= t.ow {
                    continue;
                }
                let dst = &mut y[(oy * t.ow + ox) * co..][..co];
                if relu {
                    for (d, v) in dst.iter_mut().zip(vals) {
                        // `<`: a NaN stays a NaN.
                        *d = if *v < 0.0 { 0.0 } else { *v };
                    }
                } else {
                    dst.copy_from_slice(vals);
                }
            }
        }
    }
}

/// Two `len`-long pieces of `buf`, at `at` and `at + step` (`step >= len`).
fn two_mut(buf: &mut [f32], at: usize, step: usize, len: usize) -> [&mut [f32]; 2] {
    assert!(step >= len, "pieces overlap");
    let (_, rest) = buf.split_at_mut(at);
    let (a, b) = rest.split_at_mut(step);
    [&mut a[..len], &mut b[..len]]
}

/// Gradients of [`forward`] given `dy` (NHWC); with the ReLU fused, `relu_output` is the
/// forward's output. The weight gradient is in PyTorch's layout.
pub fn backward(
    s: &ConvShape,
    x: &[f32],
    u: &WinogradWeight,
    relu_output: Option<&[f32]>,
    dy: &[f32],
    need_input: bool,
) -> ConvGrads {
    assert!(
        applies(s, 1),
        "Winograd F(2×2, 3×3) needs a 3×3 stride-1 convolution: {s:?}"
    );
    check_backward_sizes(s, x, relu_output, dy);
    let t = Tiling::of(s);
    let (ci, co) = (s.c_in, s.c_out);
    let per_chunk = images_per_chunk(s, &t);
    let chunks = s.batch.div_ceil(per_chunk);
    let image_len = s.height * s.width * ci;
    let out_image = t.oh * t.ow * co;

    let mut dx = need_input.then(|| zeros(s.input_len()));
    let planes = if need_input {
        u.packed_planes(ci, co, true)
    } else {
        Vec::new()
    };
    let work = accumulator_groups(dx.as_deref_mut(), per_chunk * image_len, chunks);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = work
        .into_par_iter()
        .map(|chunks| {
            let mut du = zeros(16 * ci * co);
            let mut db = vec![0.0f32; co];
            for (chunk, dx_chunk) in chunks {
                let n0 = chunk * per_chunk;
                let images = per_chunk.min(s.batch - n0);
                let tiles = images * t.per_image();
                let span = n0 * out_image..(n0 + images) * out_image;
                with_scratch(
                    [16 * tiles * ci, 16 * tiles * co, images * out_image],
                    |v, dm, masked| {
                        let g = chunk_gradient(dy, relu_output, span, masked, &mut db);
                        transform_inputs(s, &t, x, n0, images, v);
                        output_grad_transform(&t, g, images, co, dm);
                        let dm = &*dm;
                        du.par_chunks_mut(ci * co).enumerate().for_each(|(xi, du)| {
                            matmul(
                                du,
                                co,
                                Mat::rows(&v[xi * tiles * ci..][..tiles * ci], tiles, ci).t(),
                                Mat::rows(&dm[xi * tiles * co..][..tiles * co], tiles, co),
                                true,
                                u.precision,
                            );
                        });
                        if let Some(dx_chunk) = dx_chunk {
                            // V is not needed any more: dV goes in its place.
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
                            input_grad_transform(s, &t, v, tiles, dx_chunk);
                        }
                    },
                );
            }
            (du, db)
        })
        .collect();

    let (dw, db) = sum_partials(partials, 16 * ci * co, co);
    ConvGrads {
        input: dx,
        weight: weight_grad_to_torch(s, &dw),
        bias: db,
    }
}

/// `dM = A dy Aᵀ` per tile (`dy` of the chunk's images, zero past the output's edge), each
/// image on its own thread.
fn output_grad_transform(t: &Tiling, g: &[f32], images: usize, co: usize, dm: &mut [f32]) {
    let zeros = vec![0.0f32; co];
    let out_image = t.oh * t.ow * co;
    planes_per_image(dm, images, t.per_image() * co)
        .into_par_iter()
        .enumerate()
        .for_each(|(n, mut planes)| {
            output_grad_image(t, &g[n * out_image..][..out_image], co, &zeros, &mut planes)
        });
}

/// Image `n` of [`output_grad_transform`] (`g` its output gradient), compiled for the CPU's
/// widest vectors.
#[multiversion(targets = "simd")]
fn output_grad_image(t: &Tiling, g: &[f32], co: usize, zeros: &[f32], planes: &mut [&mut [f32]]) {
    // A dy: 4 rows of 2 vectors.
    let mut sr = vec![0.0f32; 8 * co];
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = ty * t.tw + tx;
            let pos = |a: usize, b: usize| {
                let (oy, ox) = (2 * ty + a, 2 * tx + b);
                if oy < t.oh && ox < t.ow {
                    &g[(oy * t.ow + ox) * co..][..co]
                } else {
                    zeros
                }
            };
            for b in 0..2 {
                // Column b of dy through A: [d0, d0 + d1, d0 - d1, -d1].
                let (d0, d1) = (pos(0, b), pos(1, b));
                let [s0, s1, s2, s3] = four_mut(&mut sr, b * co, 2 * co, co);
                s0.copy_from_slice(d0);
                add(s1, d0, d1);
                sub(s2, d0, d1);
                neg(s3, d1);
            }
            for i in 0..4 {
                // Row i through Aᵀ on the right: [s0, s0 + s1, s0 - s1, -s1] into
                // dM[4i + j].
                let (s0, s1) = (&sr[2 * i * co..][..co], &sr[(2 * i + 1) * co..][..co]);
                let [m0, m1, m2, m3] = four_planes(planes, i, tile, co);
                m0.copy_from_slice(s0);
                add(m1, s0, s1);
                sub(m2, s0, s1);
                neg(m3, s1);
            }
        }
    }
}

/// `dd = B dV Bᵀ` per tile, added into the chunk's input gradient (dropping the padding), each
/// image on its own thread.
fn input_grad_transform(s: &ConvShape, t: &Tiling, dv: &[f32], tiles: usize, dx: &mut [f32]) {
    let c = s.c_in;
    let image_len = s.height * s.width * c;
    dx.par_chunks_mut(image_len)
        .enumerate()
        .for_each(|(n, img)| input_grad_image(s, t, dv, tiles, n, img));
}

/// Image `n` of [`input_grad_transform`], compiled for the CPU's widest vectors.
#[multiversion(targets = "simd")]
fn input_grad_image(
    s: &ConvShape,
    t: &Tiling,
    dv: &[f32],
    tiles: usize,
    n: usize,
    img: &mut [f32],
) {
    let c = s.c_in;
    let (mut r, mut dd) = (vec![0.0f32; 16 * c], vec![0.0f32; 16 * c]);
    for ty in 0..t.th {
        for tx in 0..t.tw {
            let tile = (n * t.th + ty) * t.tw + tx;
            // B dV down each column j, then · Bᵀ along each row.
            for j in 0..4 {
                let src = four(dv, (j * tiles + tile) * c, 4 * tiles * c, c);
                b4(four_mut(&mut r, j * c, 4 * c, c), src);
            }
            for i in 0..4 {
                let src = four(&r, i * 4 * c, c, c);
                b4(four_mut(&mut dd, i * 4 * c, c, c), src);
            }
            for i in 0..4 {
                let iy = (2 * ty + i).wrapping_sub(s.padding[0]);
                if iy >= s.height {
                    continue;
                }
                for j in 0..4 {
                    let ix = (2 * tx + j).wrapping_sub(s.padding[1]);
                    if ix >= s.width {
                        continue;
                    }
                    add_into(
                        &mut img[(iy * s.width + ix) * c..][..c],
                        &dd[(i * 4 + j) * c..][..c],
                    );
                }
            }
        }
    }
}
