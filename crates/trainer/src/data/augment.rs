//! Training augmentation and normalisation of one image.
//!
//! Every random choice comes from a generator seeded by (run seed, epoch, sample index)
//! alone ([`sample_seed`]), so a sample gets the same crop and flip whichever rank, thread or
//! restart decodes it: resume and elastic re-sharding stay exact.

use super::Normalisation;

/// What is done to a training image before it is normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Augment {
    /// The image as it is (evaluation, and CIFAR-10 by default: the seed's transforms).
    None,
    /// Pad by an eighth of the side with black, crop a random square of the side, flip
    /// horizontally half the time (the CIFAR/ResNet recipe: 4 px at 32, 8 px at 64).
    Crop,
    /// torchvision's `RandomResizedCrop` (8–100 % of the area, aspect 3/4–4/3, bilinear) and a
    /// horizontal flip half the time (the ImageNet recipe).
    ResizedCrop,
}

impl Augment {
    pub const CHOICES: &str = "none, crop or resized-crop";

    pub fn parse(name: &str) -> Option<Augment> {
        match name {
            "none" => Some(Augment::None),
            "crop" => Some(Augment::Crop),
            "resized-crop" => Some(Augment::ResizedCrop),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Augment::None => "none",
            Augment::Crop => "crop",
            Augment::ResizedCrop => "resized-crop",
        }
    }
}

/// The generator seed of sample `index` in `epoch` of a run seeded `seed`.
pub(crate) fn sample_seed(seed: u64, epoch: usize, index: usize) -> u64 {
    let mut s = SplitMix(seed ^ 0x7261_696e_6374_6c00);
    let a = s.next() ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let b = SplitMix(a).next() ^ (index as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    SplitMix(b).next()
}

/// SplitMix64: tiny, fast, and defined here so that augmentation never changes with a
/// dependency's version.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..=max.
    fn upto(&mut self, max: usize) -> usize {
        (self.next() % (max as u64 + 1)) as usize
    }
}

/// Writes `base` (`size`×`size` RGB, rows of pixels) into `out` as channels-first floats,
/// augmented as `augment` says with choices drawn from `rng_seed`, normalised by `norm`.
pub(crate) fn apply(
    base: &[u8],
    size: usize,
    augment: Augment,
    rng_seed: u64,
    norm: Normalisation,
    out: &mut [f32],
) {
    debug_assert_eq!(base.len(), 3 * size * size);
    debug_assert_eq!(out.len(), 3 * size * size);
    let coef = norm.coefficients();
    let plane = size * size;
    let mut rng = SplitMix(rng_seed);
    match augment {
        Augment::None => {
            for (p, px) in base.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    out[c * plane + p] = px[c] as f32 * coef[c].0 + coef[c].1;
                }
            }
        }
        Augment::Crop => {
            let pad = size / 8;
            let (dx, dy) = (rng.upto(2 * pad), rng.upto(2 * pad));
            let flip = rng.unit() < 0.5;
            for y in 0..size {
                for x in 0..size {
                    let sx = (if flip { size - 1 - x } else { x } + dx) as isize - pad as isize;
                    let sy = (y + dy) as isize - pad as isize;
                    let inside =
                        (0..size as isize).contains(&sx) && (0..size as isize).contains(&sy);
                    for c in 0..3 {
                        let byte = if inside {
                            base[(sy as usize * size + sx as usize) * 3 + c]
                        } else {
                            0
                        };
                        out[c * plane + y * size + x] = byte as f32 * coef[c].0 + coef[c].1;
                    }
                }
            }
        }
        Augment::ResizedCrop => {
            let (x0, y0, w, h) = resized_crop_box(size, &mut rng);
            let flip = rng.unit() < 0.5;
            // Bilinear sampling of the box onto size×size, pixel centres aligned (PIL/torchvision
            // `resize` without antialiasing).
            let (sx_scale, sy_scale) = (w as f32 / size as f32, h as f32 / size as f32);
            for y in 0..size {
                let fy =
                    (y0 as f32 + (y as f32 + 0.5) * sy_scale - 0.5).clamp(0.0, (size - 1) as f32);
                let (y_lo, ty) = (fy.floor() as usize, fy - fy.floor());
                let y_hi = (y_lo + 1).min(size - 1);
                for x in 0..size {
                    let ox = if flip { size - 1 - x } else { x };
                    let fx = (x0 as f32 + (ox as f32 + 0.5) * sx_scale - 0.5)
                        .clamp(0.0, (size - 1) as f32);
                    let (x_lo, tx) = (fx.floor() as usize, fx - fx.floor());
                    let x_hi = (x_lo + 1).min(size - 1);
                    for c in 0..3 {
                        let at = |yy: usize, xx: usize| base[(yy * size + xx) * 3 + c] as f32;
                        let top = at(y_lo, x_lo) * (1.0 - tx) + at(y_lo, x_hi) * tx;
                        let bottom = at(y_hi, x_lo) * (1.0 - tx) + at(y_hi, x_hi) * tx;
                        let v = top * (1.0 - ty) + bottom * ty;
                        out[c * plane + y * size + x] = v * coef[c].0 + coef[c].1;
                    }
                }
            }
        }
    }
}

/// torchvision's `RandomResizedCrop.get_params` on a `size`² image: ten tries at a random area
/// and aspect, else the whole image. Returns (x, y, width, height).
fn resized_crop_box(size: usize, rng: &mut SplitMix) -> (usize, usize, usize, usize) {
    let area = (size * size) as f64;
    let (log_lo, log_hi) = ((3.0f64 / 4.0).ln(), (4.0f64 / 3.0).ln());
    for _ in 0..10 {
        let target = area * (0.08 + rng.unit() * (1.0 - 0.08));
        let aspect = (log_lo + rng.unit() * (log_hi - log_lo)).exp();
        let w = (target * aspect).sqrt().round() as usize;
        let h = (target / aspect).sqrt().round() as usize;
        if (1..=size).contains(&w) && (1..=size).contains(&h) {
            return (rng.upto(size - w), rng.upto(size - h), w, h);
        }
    }
    (0, 0, size, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient_image(size: usize) -> Vec<u8> {
        (0..size * size * 3).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn the_same_sample_gets_the_same_augmentation_and_others_differ() {
        let size = 16;
        let base = gradient_image(size);
        let run = |seed| {
            let mut out = vec![0.0; 3 * size * size];
            apply(
                &base,
                size,
                Augment::Crop,
                seed,
                Normalisation::ImageNet,
                &mut out,
            );
            out
        };
        assert_eq!(run(sample_seed(1, 2, 3)), run(sample_seed(1, 2, 3)));
        let distinct: std::collections::HashSet<Vec<u32>> = (0..20)
            .map(|i| {
                run(sample_seed(1, 2, i))
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect();
        assert!(
            distinct.len() > 5,
            "only {} distinct crops of 20",
            distinct.len()
        );
        assert_ne!(sample_seed(1, 2, 3), sample_seed(1, 3, 3), "epochs differ");
        assert_ne!(sample_seed(1, 2, 3), sample_seed(2, 2, 3), "seeds differ");
    }

    #[test]
    fn no_augmentation_is_normalisation_only() {
        let size = 4;
        let base = gradient_image(size);
        let mut out = vec![0.0; 3 * size * size];
        apply(
            &base,
            size,
            Augment::None,
            9,
            Normalisation::Cifar,
            &mut out,
        );
        for p in 0..size * size {
            for c in 0..3 {
                let expected = base[p * 3 + c] as f32 * (2.0 / 255.0) - 1.0;
                assert_eq!(out[c * size * size + p], expected);
            }
        }
        let mut imagenet = vec![0.0; 3 * size * size];
        apply(
            &[255; 48],
            size,
            Augment::None,
            0,
            Normalisation::ImageNet,
            &mut imagenet,
        );
        assert!((imagenet[0] - (1.0 - 0.485) / 0.229).abs() < 1e-5);
        assert!((imagenet[16] - (1.0 - 0.456) / 0.224).abs() < 1e-5);
    }

    /// A crop moves the picture by at most the padding and fills what it uncovers with black;
    /// a flip mirrors it.
    #[test]
    fn crops_shift_within_the_padding_and_flips_mirror() {
        let size = 16;
        let base = gradient_image(size);
        let black = -1.0; // normalise(0) under Cifar
        for i in 0..50 {
            let mut out = vec![0.0; 3 * size * size];
            apply(
                &base,
                size,
                Augment::Crop,
                sample_seed(0, 0, i),
                Normalisation::Cifar,
                &mut out,
            );
            let value = |x: usize, y: usize| out[y * size + x];
            let found = (0..=4)
                .flat_map(|dy| (0..=4).map(move |dx| (dx, dy)))
                .find(|&(dx, dy)| {
                    [false, true].iter().any(|&flip| {
                        (0..size).all(|y| {
                            (0..size).all(|x| {
                                let sx = (if flip { size - 1 - x } else { x } + dx) as isize - 2;
                                let sy = (y + dy) as isize - 2;
                                let want = if (0..16).contains(&sx) && (0..16).contains(&sy) {
                                    base[(sy as usize * size + sx as usize) * 3] as f32
                                        * (2.0 / 255.0)
                                        - 1.0
                                } else {
                                    black
                                };
                                value(x, y) == want
                            })
                        })
                    })
                });
            assert!(
                found.is_some(),
                "sample {i}: not a padded crop of the image"
            );
        }
    }

    #[test]
    fn resized_crops_stay_inside_the_image() {
        let mut rng = SplitMix(3);
        for size in [32, 33, 64] {
            for _ in 0..200 {
                let (x, y, w, h) = resized_crop_box(size, &mut rng);
                assert!(
                    w >= 1 && h >= 1 && x + w <= size && y + h <= size,
                    "{x} {y} {w} {h}"
                );
            }
        }
        let base = gradient_image(32);
        let mut out = vec![0.0; 3 * 32 * 32];
        apply(
            &base,
            32,
            Augment::ResizedCrop,
            5,
            Normalisation::ImageNet,
            &mut out,
        );
        assert!(out.iter().all(|v| v.is_finite()));
    }
}
