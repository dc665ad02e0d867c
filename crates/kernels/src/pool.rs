//! Max pooling of NHWC tensors, with the position of each window's maximum kept for the
//! backward pass. Each image's loop is compiled for the CPU's widest vectors (multiversion's
//! runtime dispatch).

use multiversion::multiversion;
use rayon::prelude::*;

use crate::scratch::par_filled;

/// Input `[batch, height, width, channels]`; padding counts as -∞ (as in PyTorch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolShape {
    pub batch: usize,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl PoolShape {
    pub fn validate(&self) -> Result<(), String> {
        if self.kernel.contains(&0) || self.stride.contains(&0) {
            return Err(format!(
                "pooling kernel and stride must be positive in {self:?}"
            ));
        }
        if self.padding[0] * 2 > self.kernel[0] || self.padding[1] * 2 > self.kernel[1] {
            return Err(format!(
                "pooling padding {:?} is over half the kernel {:?}",
                self.padding, self.kernel
            ));
        }
        if self.height + 2 * self.padding[0] < self.kernel[0]
            || self.width + 2 * self.padding[1] < self.kernel[1]
        {
            return Err(format!(
                "a {:?} pooling window does not fit the input {}×{}",
                self.kernel, self.height, self.width
            ));
        }
        Ok(())
    }

    pub fn out_size(&self) -> [usize; 2] {
        [
            (self.height + 2 * self.padding[0] - self.kernel[0]) / self.stride[0] + 1,
            (self.width + 2 * self.padding[1] - self.kernel[1]) / self.stride[1] + 1,
        ]
    }

    pub(crate) fn input_len(&self) -> usize {
        self.batch * self.height * self.width * self.channels
    }

    pub fn output_len(&self) -> usize {
        let [oh, ow] = self.out_size();
        self.batch * oh * ow * self.channels
    }

    /// Calls `f(tap, pixel)` for every tap of output (oy, ox)'s window that falls inside the
    /// image (`tap = ky · kw + kx`, `pixel = iy · width + ix`), in tap order.
    #[inline(always)]
    fn for_each_tap(&self, oy: usize, ox: usize, mut f: impl FnMut(u32, usize)) {
        for ky in 0..self.kernel[0] {
            let iy = (oy * self.stride[0] + ky).wrapping_sub(self.padding[0]);
            if iy >= self.height {
                continue;
            }
            for kx in 0..self.kernel[1] {
                let ix = (ox * self.stride[1] + kx).wrapping_sub(self.padding[1]);
                if ix < self.width {
                    f((ky * self.kernel[1] + kx) as u32, iy * self.width + ix);
                }
            }
        }
    }
}

/// Output and, per output element, the tap (`ky · kw + kx`) its value came from. The first
/// maximum wins a tie; a NaN wins over any number.
pub fn max_forward(s: &PoolShape, x: &[f32]) -> (Vec<f32>, Vec<u32>) {
    assert_eq!(x.len(), s.input_len(), "pooling input size");
    let [oh, ow] = s.out_size();
    let c = s.channels;
    let (in_img, out_img) = (s.height * s.width * c, oh * ow * c);
    let mut y = vec![f32::NEG_INFINITY; s.output_len()];
    let mut arg = vec![0u32; s.output_len()];
    y.par_chunks_mut(out_img.max(1))
        .zip(arg.par_chunks_mut(out_img.max(1)))
        .zip(x.par_chunks(in_img.max(1)))
        .for_each(|((y, arg), img)| max_image(s, img, y, arg));
    (y, arg)
}

/// [`max_forward`] of one image, compiled for the CPU's widest vectors.
#[multiversion(targets = "simd")]
fn max_image(s: &PoolShape, img: &[f32], y: &mut [f32], arg: &mut [u32]) {
    let [oh, ow] = s.out_size();
    let c = s.channels;
    for oy in 0..oh {
        for ox in 0..ow {
            let at = (oy * ow + ox) * c;
            let (best, which) = (&mut y[at..at + c], &mut arg[at..at + c]);
            s.for_each_tap(oy, ox, |tap, pixel| {
                let src = &img[pixel * c..][..c];
                for ((b, w), &v) in best.iter_mut().zip(which.iter_mut()).zip(src) {
                    // Greater, or a NaN (which stays: nothing is greater than it).
                    // As bit masks: with selects, LLVM branches per element.
                    let take = 0u32.wrapping_sub(((v > *b) | v.is_nan()) as u32);
                    *b = f32::from_bits((v.to_bits() & take) | (b.to_bits() & !take));
                    *w = (tap & take) | (*w & !take);
                }
            });
        }
    }
}

/// The input gradient: each output's gradient goes to the input its maximum came from.
pub fn max_backward(s: &PoolShape, dy: &[f32], arg: &[u32]) -> Vec<f32> {
    assert_eq!(dy.len(), s.output_len(), "pooling output-gradient size");
    assert_eq!(arg.len(), s.output_len(), "pooling argmax size");
    let [oh, ow] = s.out_size();
    let c = s.channels;
    let (in_img, out_img) = (s.height * s.width * c, oh * ow * c);
    // Each image's gradient zeroed just before the scatter into it.
    par_filled(s.input_len(), in_img, |n, dx| {
        let at = n * out_img..(n + 1) * out_img;
        max_image_backward(s, &dy[at.clone()], &arg[at], dx)
    })
}

/// [`max_backward`] of one image, compiled for the CPU's widest vectors.
#[multiversion(targets = "simd")]
fn max_image_backward(s: &PoolShape, dy: &[f32], arg: &[u32], dx: &mut [f32]) {
    let [oh, ow] = s.out_size();
    let c = s.channels;
    for oy in 0..oh {
        for ox in 0..ow {
            let at = (oy * ow + ox) * c;
            let (g, taps) = (&dy[at..at + c], &arg[at..at + c]);
            // Tap by tap, so that the inner loop is a vector compare-and-add.
            s.for_each_tap(oy, ox, |tap, pixel| {
                let dst = &mut dx[pixel * c..][..c];
                for ((d, &v), &t) in dst.iter_mut().zip(g).zip(taps) {
                    *d += if t == tap { v } else { 0.0 };
                }
            });
        }
    }
}
