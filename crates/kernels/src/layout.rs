//! NCHW ↔ NHWC conversions (burn's tensors are NCHW; the kernels work channels-last), and
//! plain copies of large buffers on rayon's threads.

use rayon::prelude::*;

use crate::scratch::zeros;

/// Tile edge of the blocked transposes: 16×16 floats stay in L1 on both sides.
const TILE: usize = 16;

/// Transposes each row-major `rows × cols` matrix of `src` into the same place of `dst`, in
/// parallel over the matrices.
pub fn transpose_each(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
    let len = rows * cols;
    assert_eq!(src.len(), dst.len(), "transpose sizes");
    if len == 0 {
        return;
    }
    dst.par_chunks_mut(len)
        .zip(src.par_chunks(len))
        .for_each(|(d, s)| {
            // Writes contiguous (the inner loop runs along a row of `d`), reads strided.
            for c0 in (0..cols).step_by(TILE) {
                for r0 in (0..rows).step_by(TILE) {
                    let r1 = (r0 + TILE).min(rows);
                    for c in c0..(c0 + TILE).min(cols) {
                        let out = &mut d[c * rows + r0..c * rows + r1];
                        for (k, o) in out.iter_mut().enumerate() {
                            *o = s[(r0 + k) * cols + c];
                        }
                    }
                }
            }
        });
}

/// `dst` = the transpose of the row-major `rows × cols` matrix `src`, by bands of `dst`'s rows
/// on rayon's threads (each element is a copy: the result cannot depend on the thread count).
pub fn transpose_into(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
    assert_eq!(src.len(), rows * cols, "transpose source size");
    assert_eq!(dst.len(), rows * cols, "transpose destination size");
    if rows == 0 || cols == 0 {
        return;
    }
    dst.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(band, d)| {
            let c0 = band * TILE;
            for r0 in (0..rows).step_by(TILE) {
                let r1 = (r0 + TILE).min(rows);
                for (dc, out) in d.chunks_exact_mut(rows).enumerate() {
                    for (r, o) in (r0..r1).zip(&mut out[r0..r1]) {
                        *o = src[r * cols + c0 + dc];
                    }
                }
            }
        });
}

/// [`transpose_into`] a new vector.
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut dst = zeros(src.len());
    transpose_into(src, &mut dst, rows, cols);
    dst
}

/// `[n, c, h, w]` → `[n, h, w, c]`.
pub fn nchw_to_nhwc(src: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
    let mut dst = zeros(src.len());
    transpose_each(src, &mut dst, channels, pixels);
    dst
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

    /// `[n, h, w, c]` → `[n, c, h, w]`: the way back, to check the way there.
    fn nhwc_to_nchw(src: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
        let mut dst = vec![0.0; src.len()];
        transpose_each(src, &mut dst, pixels, channels);
        dst
    }

    #[test]
    fn copies_of_any_size_are_exact() {
        for len in [0, 1, PARALLEL_COPY - 1, PARALLEL_COPY, 3 * PARALLEL_COPY + 7] {
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
    fn a_single_transpose_of_any_size_puts_every_element_in_place() {
        for (rows, cols) in [(1, 1), (3, 40), (40, 3), (33, 17), (0, 5)] {
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let t = transpose(&src, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        t[c * rows + r],
                        src[r * cols + c],
                        "{rows}×{cols} at ({r}, {c})"
                    );
                }
            }
        }
    }
}
