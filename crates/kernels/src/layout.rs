//! NCHW ↔ NHWC conversions (burn's tensors are NCHW; the kernels work channels-last), and
//! plain copies of large buffers on rayon's threads.

use rayon::prelude::*;

use crate::scratch::par_filled;

/// The blocks the transposes go by: 64 source rows × 256 source columns, 64 KiB on each side
/// (in L2), touching few enough pages that the TLB holds them: 16-column bands down a
/// convolution weight's 512 rows touched every page of it per band, and took twice as long.
const BLOCK_ROWS: usize = 64;
const BLOCK_COLS: usize = 256;

/// Each row-major `rows × cols` matrix of `src` transposed, in a new vector (in parallel over
/// the matrices, each one's place zeroed just before it is written: see [`par_filled`]).
pub fn transpose_each(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let len = rows * cols;
    par_filled(src.len(), len, |i, d| {
        transpose_one(&src[i * len..][..len], d, rows, cols)
    })
}

/// `d` = the transpose of the row-major `rows × cols` matrix `s`, block by block.
fn transpose_one(s: &[f32], d: &mut [f32], rows: usize, cols: usize) {
    for c0 in (0..cols).step_by(BLOCK_COLS) {
        for r0 in (0..rows).step_by(BLOCK_ROWS) {
            let (nr, nc) = (BLOCK_ROWS.min(rows - r0), BLOCK_COLS.min(cols - c0));
            block(
                &s[r0 * cols + c0..],
                cols,
                &mut d[c0 * rows + r0..],
                rows,
                nr,
                nc,
            );
        }
    }
}

/// `dst` = the transpose of the row-major `rows × cols` matrix `src`, by bands of `dst`'s rows
/// on rayon's threads (each element is a copy: the result cannot depend on the thread count).
pub(crate) fn transpose_into(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
    assert_eq!(src.len(), rows * cols, "transpose source size");
    assert_eq!(dst.len(), rows * cols, "transpose destination size");
    if rows == 0 || cols == 0 {
        return;
    }
    dst.par_chunks_mut(BLOCK_COLS * rows)
        .enumerate()
        .for_each(|(band, d)| transpose_band(src, d, band, rows, cols));
}

/// Band `band` of [`transpose_into`]'s destination: the transposes of source columns
/// `band · BLOCK_COLS..`, `d.len() / rows` of them.
fn transpose_band(src: &[f32], d: &mut [f32], band: usize, rows: usize, cols: usize) {
    let c0 = band * BLOCK_COLS;
    let nc = d.len() / rows;
    for r0 in (0..rows).step_by(BLOCK_ROWS) {
        let nr = BLOCK_ROWS.min(rows - r0);
        block(&src[r0 * cols + c0..], cols, &mut d[r0..], rows, nr, nc);
    }
}

/// `d[c · d_stride + r] = s[r · s_stride + c]` for `r < nr`, `c < nc`. By 16×16 blocks in
/// vector registers where the CPU has AVX-512 and both sides are 16 or more, else by 8×8 blocks
/// where it has AVX and both sides are 8 or more, the last block of a side overlapping the one
/// before it when the side is not a multiple of the block's (a convolution weight's 9 taps: two
/// blocks rather than a column element by element, which costs about 1.5 ns an element, ten
/// times a copy: strided reads, one at a time). Each element is a copy, written the same
/// whichever block writes it.
pub(crate) fn block(
    s: &[f32],
    s_stride: usize,
    d: &mut [f32],
    d_stride: usize,
    nr: usize,
    nc: usize,
) {
    if nr == 0 || nc == 0 {
        return;
    }
    assert!(
        (nr - 1) * s_stride + nc <= s.len() && (nc - 1) * d_stride + nr <= d.len(),
        "a {nr}×{nc} transpose block overruns its slices"
    );
    #[cfg(target_arch = "x86_64")]
    if nr >= 16 && nc >= 16 && std::arch::is_x86_feature_detected!("avx512f") {
        // Every 64-byte line a 16 × 16 block reads and every one it writes is whole, and the
        // blocks go down `s`'s rows, so that `d`'s rows are written line after line. By 8 × 8
        // blocks along a row of `s`, each of `d`'s lines was half-written, left the cache for
        // the band's other 255 rows and came back for its other half: a 512 × 4,608 weight
        // (its rows 18 KiB apart, `d`'s 2 KiB) took 1.6–2.0 ms, 16 × 16 blocks along a row of
        // `s` 1.0–1.2 and down its rows 0.40–0.43, where copying it takes 0.18 (all in cache).
        for c in starts(nc, 16) {
            for r in starts(nr, 16) {
                let (s, d) = (&s[r * s_stride + c..], &mut d[c * d_stride + r..]);
                assert!(15 * s_stride + 16 <= s.len() && 15 * d_stride + 16 <= d.len());
                // SAFETY: AVX-512 is present (checked above), and the assert proves that the
                // sixteen rows of sixteen read from `s` and written to `d` lie inside the
                // slices.
                unsafe { avx::transpose16(s.as_ptr(), s_stride, d.as_mut_ptr(), d_stride) };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if nr >= 8 && nc >= 8 && std::arch::is_x86_feature_detected!("avx") {
        for r in starts(nr, 8) {
            for c in starts(nc, 8) {
                let (s, d) = (&s[r * s_stride + c..], &mut d[c * d_stride + r..]);
                assert!(7 * s_stride + 8 <= s.len() && 7 * d_stride + 8 <= d.len());
                // SAFETY: AVX is present (checked above), and the assert proves that the eight
                // rows of eight read from `s` and written to `d` lie inside the slices.
                unsafe { avx::transpose8(s.as_ptr(), s_stride, d.as_mut_ptr(), d_stride) };
            }
        }
        return;
    }
    for c in 0..nc {
        let column = s[c..].iter().step_by(s_stride);
        for (o, &v) in d[c * d_stride..][..nr].iter_mut().zip(column) {
            *o = v;
        }
    }
}

/// Where the `side`-long blocks covering `0..n` start (`n` ≥ `side`): every `side`th index,
/// and `n - side` when `n` is not a multiple of `side`.
#[cfg(target_arch = "x86_64")]
fn starts(n: usize, side: usize) -> impl Iterator<Item = usize> {
    (0..n / side)
        .map(move |i| i * side)
        .chain((!n.is_multiple_of(side)).then_some(n - side))
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx {
    use std::arch::x86_64::*;

    /// Transposes the 8×8 block at `s` (rows `s_stride` apart) into `d` (rows `d_stride`
    /// apart): the unpack / shuffle / lane-permute sequence, 24 shuffles for 64 elements.
    ///
    /// # Safety
    /// AVX must be present; `s + r·s_stride + c` and `d + r·d_stride + c` must be valid for
    /// `r, c < 8`.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn transpose8(s: *const f32, s_stride: usize, d: *mut f32, d_stride: usize) {
        // SAFETY: the caller vouches for every address read and written.
        unsafe {
            let row = |r: usize| _mm256_loadu_ps(s.add(r * s_stride));
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let (r4, r5, r6, r7) = (row(4), row(5), row(6), row(7));
            // Pairs of rows interleaved: t0 = r0[0] r1[0] r0[1] r1[1] | r0[4] r1[4] r0[5] r1[5].
            let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
            let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
            let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
            // Quads: u0 = column 0 of rows 0-3 | column 4 of rows 0-3.
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            // Lanes joined: column c whole.
            let column = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (c, v) in column.into_iter().enumerate() {
                _mm256_storeu_ps(d.add(c * d_stride), v);
            }
        }
    }

    /// Transposes the 16×16 block at `s` (rows `s_stride` apart) into `d` (rows `d_stride`
    /// apart), by [`transpose16_registers`].
    ///
    /// # Safety
    /// AVX-512F must be present; `s + r·s_stride + c` and `d + r·d_stride + c` must be valid
    /// for `r, c < 16`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose16(s: *const f32, s_stride: usize, d: *mut f32, d_stride: usize) {
        // SAFETY: the caller vouches for every address read and written.
        unsafe {
            let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(s.add(i * s_stride)));
            for (c, column) in transpose16_registers(r).into_iter().enumerate() {
                _mm512_storeu_ps(d.add(c * d_stride), column);
            }
        }
    }

    /// The 16 columns of the 16 rows `r` (16 lanes each), in four rounds of 16 shuffles: pairs
    /// of rows interleaved, then quads (each 128-bit lane of `u[4q + m]` is column `4·lane + m`
    /// of rows `4q..4q + 4`), then lanes gathered twice across registers until each holds one
    /// column whole. It only moves bits: any 32-bit lanes (a bf16 pair) go through as f32.
    #[target_feature(enable = "avx512f")]
    pub(crate) fn transpose16_registers(r: [__m512; 16]) -> [__m512; 16] {
        // t[2p] = rows 2p, 2p + 1 interleaved from each lane's first two columns, t[2p + 1]
        // from its last two.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        // u[4q + m], lane k: column 4k + m of rows 4q..4q + 4.
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let (q, m) = (i / 4, i % 4);
            let (a, b) = (t[4 * q + m / 2], t[4 * q + 2 + m / 2]);
            if m % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(a, b)
            } else {
                _mm512_shuffle_ps::<0xEE>(a, b)
            }
        });
        // v[8h + 4·odd + m]: lanes 0 and 2 (odd = 0: columns m and 8 + m) or 1 and 3
        // (odd = 1: columns 4 + m and 12 + m) of u[8h + m], then of u[8h + 4 + m]: rows
        // 8h..8h + 8.
        let v: [__m512; 16] = std::array::from_fn(|i| {
            let (half, odd, m) = (i / 8, (i / 4) % 2, i % 4);
            let (a, b) = (u[8 * half + m], u[8 * half + 4 + m]);
            if odd == 0 {
                _mm512_shuffle_f32x4::<0x88>(a, b)
            } else {
                _mm512_shuffle_f32x4::<0xDD>(a, b)
            }
        });
        // Column c = 4·odd + 8·high + m from v[4·odd + m] (rows 0..8) and v[8 + 4·odd + m]
        // (rows 8..16).
        std::array::from_fn(|c| {
            let (high, odd, m) = ((c / 8) % 2, (c / 4) % 2, c % 4);
            let (a, b) = (v[4 * odd + m], v[8 + 4 * odd + m]);
            if high == 0 {
                _mm512_shuffle_f32x4::<0x88>(a, b)
            } else {
                _mm512_shuffle_f32x4::<0xDD>(a, b)
            }
        })
    }
}

/// [`transpose_into`] a new vector.
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(src.len(), rows * cols, "transpose source size");
    if rows == 0 || cols == 0 {
        return Vec::new();
    }
    par_filled(src.len(), BLOCK_COLS * rows, |band, d| {
        transpose_band(src, d, band, rows, cols)
    })
}

/// `[n, c, h, w]` → `[n, h, w, c]`.
pub fn nchw_to_nhwc(src: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
    transpose_each(src, channels, pixels)
}

#[cfg(test)]
/// `[n, h, w, c]` → `[n, c, h, w]`.
pub(crate) fn nhwc_to_nchw(src: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
    transpose_each(src, pixels, channels)
}

/// Elements from which [`copy`] and [`copied`] run on rayon's threads, by chunks of this many
/// (a serial memcpy of a 512×512×3×3 weight is about 2 ms, during which the other threads wait).
const PARALLEL_COPY: usize = 1 << 16;

/// `dst.copy_from_slice(src)`, by chunks on rayon's threads when large.
///
/// # Panics
/// When the lengths differ.
pub fn copy(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "copy sizes");
    if src.len() < PARALLEL_COPY {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(PARALLEL_COPY)
        .zip(src.par_chunks(PARALLEL_COPY))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// `src.to_vec()`, on rayon's threads when large.
pub fn copied(src: &[f32]) -> Vec<f32> {
    if src.len() < PARALLEL_COPY {
        return src.to_vec();
    }
    let mut v = Vec::with_capacity(src.len());
    v.par_extend(src.par_iter().copied());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_of_any_size_are_exact() {
        for len in [
            0,
            1,
            PARALLEL_COPY - 1,
            PARALLEL_COPY,
            3 * PARALLEL_COPY + 7,
        ] {
            let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
            assert_eq!(copied(&src), src, "copied, {len} elements");
            let mut dst = vec![-1.0; len];
            copy(&mut dst, &src);
            assert_eq!(dst, src, "copy, {len} elements");
        }
    }

    #[test]
    fn round_trip_and_element_positions() {
        let (n, c, h, w) = (2, 3, 5, 7);
        let src: Vec<f32> = (0..n * c * h * w).map(|i| i as f32).collect();
        let nhwc = nchw_to_nhwc(&src, c, h * w);
        for b in 0..n {
            for ch in 0..c {
                for p in 0..h * w {
                    assert_eq!(
                        nhwc[(b * h * w + p) * c + ch],
                        src[(b * c + ch) * h * w + p]
                    );
                }
            }
        }
        assert_eq!(nhwc_to_nchw(&nhwc, c, h * w), src);
    }

    #[test]
    fn transposes_of_any_size_put_every_element_in_place() {
        // Sizes below, at and across the 8×8 and 16×16 vector blocks and the 64×256 blocks, and
        // a convolution weight's `c_in × taps` and `taps × c_in`.
        let sizes = [
            (1, 1),
            (3, 40),
            (40, 3),
            (33, 17),
            (0, 5),
            (8, 8),
            (16, 16),
            (19, 21),
            (31, 47),
            (16, 40),
            (64, 9),
            (9, 64),
            (70, 260),
            (260, 70),
        ];
        for (rows, cols) in sizes {
            let len = rows * cols;
            let src: Vec<f32> = (0..3 * len).map(|i| i as f32).collect();
            let t = transpose(&src[..len], rows, cols);
            let each = transpose_each(&src, rows, cols);
            for m in 0..3 {
                for r in 0..rows {
                    for c in 0..cols {
                        let want = src[m * len + r * cols + c];
                        if m == 0 {
                            assert_eq!(t[c * rows + r], want, "{rows}×{cols} at ({r}, {c})");
                        }
                        let got = each[m * len + c * rows + r];
                        assert_eq!(got, want, "matrix {m} of {rows}×{cols} at ({r}, {c})");
                    }
                }
            }
        }
    }
}
