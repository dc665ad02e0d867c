//! NCHW ↔ NHWC conversions (burn's tensors are NCHW; the kernels work channels-last).

use rayon::prelude::*;

/// Tile edge of the blocked transposes: 16×16 floats stay in L1 on both sides.
const TILE: usize = 16;

/// Transposes each of `batch` row-major `rows × cols` matrices of `src` into `dst`.
fn transpose_batched(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
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

/// `[n, c, h, w]` → `[n, h, w, c]`.
pub fn nchw_to_nhwc(src: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
    let mut dst = vec![0.0; src.len()];
    transpose_batched(src, &mut dst, channels, pixels);
    dst
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[n, h, w, c]` → `[n, c, h, w]`: the way back, to check the way there.
    fn nhwc_to_nchw(src: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
        let mut dst = vec![0.0; src.len()];
        transpose_batched(src, &mut dst, pixels, channels);
        dst
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
}
