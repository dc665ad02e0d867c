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
//! whatever the thread count).

use std::cell::RefCell;

use rayon::prelude::*;

use crate::conv::{ACCUMULATORS, ConvGrads, ConvShape};
use crate::matmul::{Mat, matmul};

/// Transformed data of one chunk (V and M, or dM and dV) are kept under this size (bytes).
const CHUNK_BYTES: usize = 6 << 20;

/// Whether F(2×2, 3×3) computes this convolution: a 3×3 kernel at stride 1 with at least
/// `min_channels` input channels (below that, the GEMMs are too narrow to gain).
pub fn applies(s: &ConvShape, min_channels: usize) -> bool {
    s.kernel == [3, 3] && s.stride == [1, 1] && s.c_in >= min_channels
}

/// The transformed weights `U`: `[16][c_in][c_out]`.
#[derive(Clone, Debug, PartialEq)]
pub struct WinogradWeight {
    pub data: Vec<f32>,
}

impl WinogradWeight {
    /// `U = G g Gᵀ` for every (input, output) channel pair, from PyTorch's `[c_out, c_in, 3, 3]`.
    pub fn from_torch(s: &ConvShape, weight: &[f32]) -> Self {
        assert_eq!(weight.len(), s.weight_len(), "weight size");
        let (ci, co) = (s.c_in, s.c_out);
        let mut data = vec![0.0; 16 * ci * co];
        for o in 0..co {
            for c in 0..ci {
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
                    let u = [a, 0.5 * (a + b + d), 0.5 * (a - b + d), d];
                    for (j, v) in u.into_iter().enumerate() {
                        data[((i * 4 + j) * ci + c) * co + o] = v;
                    }
                }
            }
        }
        WinogradWeight { data }
    }
}

/// `dW = Gᵀ dU G` back into PyTorch's layout.
fn weight_grad_to_torch(s: &ConvShape, du: &[f32]) -> Vec<f32> {
    let (ci, co) = (s.c_in, s.c_out);
    let mut out = vec![0.0; s.weight_len()];
    for o in 0..co {
        for c in 0..ci {
            let m = |i: usize, j: usize| du[((i * 4 + j) * ci + c) * co + o];
            // Gᵀ dU (3×4): Gᵀ rows are [1, ½, ½, 0], [0, ½, -½, 0], [0, ½, ½, 1].
            let mut t = [[0.0f32; 4]; 3];
            for j in 0..4 {
                let (a, b, d, e) = (m(0, j), m(1, j), m(2, j), m(3, j));
                t[0][j] = a + 0.5 * (b + d);
                t[1][j] = 0.5 * (b - d);
                t[2][j] = 0.5 * (b + d) + e;
            }
            let w = &mut out[(o * ci + c) * 9..][..9];
            for (i, row) in t.iter().enumerate() {
                let (a, b, d, e) = (row[0], row[1], row[2], row[3]);
                w[i * 3] = a + 0.5 * (b + d);
                w[i * 3 + 1] = 0.5 * (b - d);
                w[i * 3 + 2] = 0.5 * (b + d) + e;
            }
        }
    }
    out
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

thread_local! {
    static SCRATCH: RefCell<[Vec<f32>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) };
}

fn with_scratch<R>(a: usize, b: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut bufs = cell.borrow_mut();
        let [x, y] = &mut *bufs;
        if x.len() < a {
            x.resize(a, 0.0);
        }
        if y.len() < b {
            y.resize(b, 0.0);
        }
        f(&mut x[..a], &mut y[..b])
    })
}

/// The 4×4 input block of tile (ty, tx) of `img`, row by row, each entry `c` floats (zeros
/// outside the image), through `Bᵀ d B` into `v` (`[16][tiles][c]`, tile index `t`).
#[allow(clippy::too_many_arguments)]
fn input_transform(
    s: &ConvShape,
    img: &[f32],
    ty: usize,
    tx: usize,
    t: usize,
    tiles: usize,
    v: &mut [f32],
    d: &mut [f32],
) {
    let c = s.c_in;
    // Gather d: 16 vectors of c.
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
    let at = |xi: usize| (xi * tiles + t) * c;
    for k in 0..c {
        let e = |i: usize, j: usize| d[(i * 4 + j) * c + k];
        // Bᵀ d: rows d0 - d2, d1 + d2, d2 - d1, d1 - d3.
        let mut r = [[0.0f32; 4]; 4];
        for j in 0..4 {
            let (a, b, cc, dd) = (e(0, j), e(1, j), e(2, j), e(3, j));
            r[0][j] = a - cc;
            r[1][j] = b + cc;
            r[2][j] = cc - b;
            r[3][j] = b - dd;
        }
        for (i, row) in r.iter().enumerate() {
            let (a, b, cc, dd) = (row[0], row[1], row[2], row[3]);
            v[at(i * 4) + k] = a - cc;
            v[at(i * 4 + 1) + k] = b + cc;
            v[at(i * 4 + 2) + k] = cc - b;
            v[at(i * 4 + 3) + k] = b - dd;
        }
    }
}

/// Fills `v` (`[16][tiles][c_in]`) for images `n0..n0 + images`.
fn transform_inputs(s: &ConvShape, t: &Tiling, x: &[f32], n0: usize, images: usize, v: &mut [f32]) {
    let tiles = images * t.per_image();
    let image_len = s.height * s.width * s.c_in;
    let mut d = vec![0.0f32; 16 * s.c_in];
    for n in 0..images {
        let img = &x[(n0 + n) * image_len..][..image_len];
        for ty in 0..t.th {
            for tx in 0..t.tw {
                let tile = (n * t.th + ty) * t.tw + tx;
                input_transform(s, img, ty, tx, tile, tiles, v, &mut d);
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
        "Winograd F(2×2, 3×3) needs a 3×3 stride-1 convolution: {s:?}"
    );
    assert_eq!(x.len(), s.input_len(), "convolution input size");
    assert_eq!(
        u.data.len(),
        16 * s.c_in * s.c_out,
        "transformed weight size"
    );
    let t = Tiling::of(s);
    let (ci, co) = (s.c_in, s.c_out);
    let per_chunk = images_per_chunk(s, &t);
    let out_image = t.oh * t.ow * co;
    let mut out = vec![0.0f32; s.output_len()];
    out.par_chunks_mut(per_chunk * out_image)
        .enumerate()
        .for_each(|(chunk, y)| {
            let images = y.len() / out_image;
            let tiles = images * t.per_image();
            with_scratch(16 * tiles * ci, 16 * tiles * co, |v, m| {
                transform_inputs(s, &t, x, chunk * per_chunk, images, v);
                for xi in 0..16 {
                    matmul(
                        &mut m[xi * tiles * co..][..tiles * co],
                        co,
                        Mat::rows(&v[xi * tiles * ci..][..tiles * ci], tiles, ci),
                        Mat::rows(&u.data[xi * ci * co..][..ci * co], ci, co),
                        false,
                    );
                }
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
    let at = |xi: usize, tile: usize| (xi * tiles + tile) * co;
    // The tile's four outputs for every channel, then written where they fall inside the image.
    let mut out = vec![0.0f32; 4 * co];
    let zeros = vec![0.0f32; co];
    let bias = bias.unwrap_or(&zeros);
    for n in 0..images {
        for ty in 0..t.th {
            for tx in 0..t.tw {
                let tile = (n * t.th + ty) * t.tw + tx;
                let (o0, rest) = out.split_at_mut(co);
                let (o1, rest) = rest.split_at_mut(co);
                let (o2, o3) = rest.split_at_mut(co);
                for o in 0..co {
                    let e = |i: usize, j: usize| m[at(i * 4 + j, tile) + o];
                    // Aᵀ M: rows M0 + M1 + M2, M1 - M2 - M3; then · A the same on columns.
                    let mut r = [[0.0f32; 4]; 2];
                    for j in 0..4 {
                        let (a, b, c, d) = (e(0, j), e(1, j), e(2, j), e(3, j));
                        r[0][j] = a + b + c;
                        r[1][j] = b - c - d;
                    }
                    o0[o] = r[0][0] + r[0][1] + r[0][2] + bias[o];
                    o1[o] = r[0][1] - r[0][2] - r[0][3] + bias[o];
                    o2[o] = r[1][0] + r[1][1] + r[1][2] + bias[o];
                    o3[o] = r[1][1] - r[1][2] - r[1][3] + bias[o];
                }
                for (k, vals) in out.chunks_exact(co).enumerate() {
                    let (oy, ox) = (2 * ty + k / 2, 2 * tx + k % 2);
                    if oy >= t.oh || ox >= t.ow {
                        continue;
                    }
                    let dst = &mut y[((n * t.oh + oy) * t.ow + ox) * co..][..co];
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
    assert_eq!(x.len(), s.input_len(), "convolution input size");
    assert_eq!(dy.len(), s.output_len(), "convolution output-gradient size");
    let t = Tiling::of(s);
    let (ci, co) = (s.c_in, s.c_out);
    let per_chunk = images_per_chunk(s, &t);
    let chunks = s.batch.div_ceil(per_chunk);
    let groups = ACCUMULATORS.min(chunks);
    let image_len = s.height * s.width * ci;
    let out_image = t.oh * t.ow * co;

    let mut dx = need_input.then(|| vec![0.0f32; s.input_len()]);
    let mut work: Vec<Vec<(usize, Option<&mut [f32]>)>> = (0..groups).map(|_| Vec::new()).collect();
    match dx.as_mut() {
        Some(dx) => {
            for (chunk, slice) in dx.chunks_mut(per_chunk * image_len).enumerate() {
                work[chunk % groups].push((chunk, Some(slice)));
            }
        }
        None => {
            for chunk in 0..chunks {
                work[chunk % groups].push((chunk, None));
            }
        }
    }

    let partials: Vec<(Vec<f32>, Vec<f32>)> = work
        .into_par_iter()
        .map(|chunks| {
            let mut du = vec![0.0f32; 16 * ci * co];
            let mut db = vec![0.0f32; co];
            for (chunk, dx_chunk) in chunks {
                let n0 = chunk * per_chunk;
                let images = per_chunk.min(s.batch - n0);
                let tiles = images * t.per_image();
                let span = n0 * out_image..(n0 + images) * out_image;
                let g: Vec<f32> = match relu_output {
                    Some(y) => dy[span.clone()]
                        .iter()
                        .zip(&y[span.clone()])
                        .map(|(d, o)| if *o > 0.0 { *d } else { 0.0 })
                        .collect(),
                    None => dy[span.clone()].to_vec(),
                };
                for row in g.chunks_exact(co) {
                    for (b, v) in db.iter_mut().zip(row) {
                        *b += v;
                    }
                }
                with_scratch(16 * tiles * ci, 16 * tiles * co, |v, dm| {
                    transform_inputs(s, &t, x, n0, images, v);
                    output_grad_transform(&t, &g, tiles, images, co, dm);
                    for xi in 0..16 {
                        matmul(
                            &mut du[xi * ci * co..][..ci * co],
                            co,
                            Mat::rows(&v[xi * tiles * ci..][..tiles * ci], tiles, ci).t(),
                            Mat::rows(&dm[xi * tiles * co..][..tiles * co], tiles, co),
                            true,
                        );
                    }
                    if let Some(dx_chunk) = dx_chunk {
                        // V is not needed any more: dV goes in its place.
                        for xi in 0..16 {
                            matmul(
                                &mut v[xi * tiles * ci..][..tiles * ci],
                                ci,
                                Mat::rows(&dm[xi * tiles * co..][..tiles * co], tiles, co),
                                Mat::rows(&u.data[xi * ci * co..][..ci * co], ci, co).t(),
                                false,
                            );
                        }
                        input_grad_transform(s, &t, v, tiles, images, dx_chunk);
                    }
                });
            }
            (du, db)
        })
        .collect();

    let mut partials = partials.into_iter();
    let (mut du, mut db) = partials
        .next()
        .unwrap_or_else(|| (vec![0.0; 16 * ci * co], vec![0.0; co]));
    for (w, b) in partials {
        for (acc, v) in du.iter_mut().zip(&w) {
            *acc += v;
        }
        for (acc, v) in db.iter_mut().zip(&b) {
            *acc += v;
        }
    }
    ConvGrads {
        input: dx,
        weight: weight_grad_to_torch(s, &du),
        bias: db,
    }
}

/// `dM = A dy Aᵀ` per tile (`dy` of the chunk's images, zero past the output's edge).
fn output_grad_transform(
    t: &Tiling,
    g: &[f32],
    tiles: usize,
    images: usize,
    co: usize,
    dm: &mut [f32],
) {
    let at = |xi: usize, tile: usize| (xi * tiles + tile) * co;
    let zeros = vec![0.0f32; co];
    for n in 0..images {
        for ty in 0..t.th {
            for tx in 0..t.tw {
                let tile = (n * t.th + ty) * t.tw + tx;
                let pos = |a: usize, b: usize| {
                    let (oy, ox) = (2 * ty + a, 2 * tx + b);
                    if oy < t.oh && ox < t.ow {
                        &g[((n * t.oh + oy) * t.ow + ox) * co..][..co]
                    } else {
                        &zeros[..]
                    }
                };
                let (g00, g01, g10, g11) = (pos(0, 0), pos(0, 1), pos(1, 0), pos(1, 1));
                for o in 0..co {
                    // A dy (4×2): rows dy0, dy0 + dy1, dy0 - dy1, -dy1; then · Aᵀ likewise.
                    let (d00, d01, d10, d11) = (g00[o], g01[o], g10[o], g11[o]);
                    let rows = [
                        [d00, d01],
                        [d00 + d10, d01 + d11],
                        [d00 - d10, d01 - d11],
                        [-d10, -d11],
                    ];
                    for (i, [a, b]) in rows.into_iter().enumerate() {
                        dm[at(i * 4, tile) + o] = a;
                        dm[at(i * 4 + 1, tile) + o] = a + b;
                        dm[at(i * 4 + 2, tile) + o] = a - b;
                        dm[at(i * 4 + 3, tile) + o] = -b;
                    }
                }
            }
        }
    }
}

/// `dd = B dV Bᵀ` per tile, added into the chunk's input gradient (dropping the padding).
fn input_grad_transform(
    s: &ConvShape,
    t: &Tiling,
    dv: &[f32],
    tiles: usize,
    images: usize,
    dx: &mut [f32],
) {
    let c = s.c_in;
    let image_len = s.height * s.width * c;
    let at = |xi: usize, tile: usize| (xi * tiles + tile) * c;
    let mut dd = vec![0.0f32; 16 * c];
    for n in 0..images {
        let img = &mut dx[n * image_len..][..image_len];
        for ty in 0..t.th {
            for tx in 0..t.tw {
                let tile = (n * t.th + ty) * t.tw + tx;
                for k in 0..c {
                    let e = |i: usize, j: usize| dv[at(i * 4 + j, tile) + k];
                    // B dV: rows v0, v1 - v2 + v3, v1 + v2 - v0, -v3; then · Bᵀ likewise.
                    let mut r = [[0.0f32; 4]; 4];
                    for j in 0..4 {
                        let (a, b, cc, d) = (e(0, j), e(1, j), e(2, j), e(3, j));
                        r[0][j] = a;
                        r[1][j] = b - cc + d;
                        r[2][j] = b + cc - a;
                        r[3][j] = -d;
                    }
                    for (i, row) in r.iter().enumerate() {
                        let (a, b, cc, d) = (row[0], row[1], row[2], row[3]);
                        dd[(i * 4) * c + k] = a;
                        dd[(i * 4 + 1) * c + k] = b - cc + d;
                        dd[(i * 4 + 2) * c + k] = b + cc - a;
                        dd[(i * 4 + 3) * c + k] = -d;
                    }
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
                        let dst = &mut img[(iy * s.width + ix) * c..][..c];
                        for (a, b) in dst.iter_mut().zip(&dd[(i * 4 + j) * c..][..c]) {
                            *a += b;
                        }
                    }
                }
            }
        }
    }
}
