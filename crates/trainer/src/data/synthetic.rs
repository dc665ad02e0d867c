//! Generated data sets with structure a network learns in a few steps, for tests, benchmarks
//! and trying things out (`trainctl data synth`):
//!
//! - CIFAR-format ([`cifar`], written in both official layouts): each class has its own pair of
//!   colour (which channels are lit) and stripe orientation, under noise; the seed CNN learns it.
//! - Image folders ([`write_folder`], in the `ImageFolder` layout or tiny-imagenet-200's): each
//!   class is a colour (hues spread around the wheel) painted as a square at a random place on a
//!   noisy grey background, so crops and flips keep the class and a network must look at
//!   colour, not position; a ResNet learns it in a few dozen steps.

use std::path::Path;

use image::{Rgb, RgbImage};

use super::cifar::{CLASS_NAMES, CifarImages, IMAGE_BYTES, NUM_CLASSES};

/// `n` images, classes in rotation, reproducible from `seed`.
pub fn cifar(n: usize, seed: u64) -> CifarImages {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut noise = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % 64) as i32 - 32
    };
    let mut out = CifarImages::default();
    for i in 0..n {
        let class = i % NUM_CLASSES;
        out.labels.push(class as u8);
        for channel in 0..3 {
            // Colour: each class lights a different mix of channels.
            let base = if (class >> channel) & 1 == 1 { 170 } else { 60 };
            for y in 0..32 {
                for x in 0..32 {
                    // Colours repeat after 8 classes; the orientation tells 8 and 9 apart.
                    let orientation = if class >= 8 { class - 6 } else { class % 2 };
                    let stripe = match orientation {
                        0 => y % 8 < 4,
                        1 => x % 8 < 4,
                        2 => (x + y) % 8 < 4,
                        _ => (x + 32 - y) % 8 < 4,
                    };
                    let v = base + if stripe { 40 } else { -40 } + noise();
                    out.images.push(v.clamp(0, 255) as u8);
                }
            }
        }
    }
    debug_assert_eq!(out.images.len(), n * IMAGE_BYTES);
    out
}

/// Writes `train` as `data_batch_1.bin` and `test` as `test_batch.bin` in `dir`.
pub fn write_binary(dir: &Path, train: &CifarImages, test: &CifarImages) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("data_batch_1.bin"), binary_bytes(train))?;
    std::fs::write(dir.join("test_batch.bin"), binary_bytes(test))?;
    std::fs::write(dir.join("batches.meta.txt"), CLASS_NAMES.join("\n"))?;
    Ok(())
}

pub fn binary_bytes(d: &CifarImages) -> Vec<u8> {
    let mut out = Vec::with_capacity(d.len() * (IMAGE_BYTES + 1));
    for i in 0..d.len() {
        out.push(d.labels[i]);
        out.extend_from_slice(d.image(i));
    }
    out
}

/// Writes `train` as `data_batch_1` and `test` as `test_batch` in `dir`, pickled the way the
/// official python files are (protocol 2, numpy array through `_reconstruct`).
pub fn write_python(dir: &Path, train: &CifarImages, test: &CifarImages) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("data_batch_1"), python_bytes(train))?;
    std::fs::write(dir.join("test_batch"), python_bytes(test))?;
    Ok(())
}

pub(crate) fn python_bytes(d: &CifarImages) -> Vec<u8> {
    let mut p = vec![0x80, 2, b'}', b'('];
    let short = |p: &mut Vec<u8>, s: &[u8]| {
        p.push(b'U');
        p.push(s.len() as u8);
        p.extend_from_slice(s);
    };
    short(&mut p, b"labels");
    p.extend_from_slice(b"](");
    for &l in &d.labels {
        p.extend_from_slice(&[b'K', l]);
    }
    p.push(b'e');
    short(&mut p, b"data");
    p.extend_from_slice(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85");
    short(&mut p, b"b");
    p.extend_from_slice(b"\x87R(K\x01");
    p.push(b'J');
    p.extend_from_slice(&(d.len() as u32).to_le_bytes());
    p.push(b'M');
    p.extend_from_slice(&(IMAGE_BYTES as u16).to_le_bytes());
    p.extend_from_slice(b"\x86cnumpy\ndtype\n");
    short(&mut p, b"u1");
    p.extend_from_slice(b"K\x00K\x01\x87R(K\x03");
    short(&mut p, b"|");
    p.extend_from_slice(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T");
    p.extend_from_slice(&(d.images.len() as u32).to_le_bytes());
    p.extend_from_slice(&d.images);
    p.extend_from_slice(b"tbu.");
    p
}

/// What to generate.
#[derive(Debug, Clone, Copy)]
pub struct FolderSpec {
    pub classes: usize,
    pub train_per_class: usize,
    pub val_per_class: usize,
    /// Side of the square images.
    pub size: u32,
    /// tiny-imagenet-200's layout (`tiny-imagenet-200/train/WNID/images/*.JPEG`,
    /// `val/images/` with `val_annotations.txt`, `words.txt`, `wnids.txt`) instead of
    /// `train/CLASS/*.jpg` and `val/CLASS/*.jpg`.
    pub tiny_layout: bool,
    pub seed: u64,
}

/// A fake WordNet id per class, like tiny-imagenet's `n01443537`.
pub(crate) fn wnid(class: usize) -> String {
    format!("n{:08}", 1_000_000 + class * 37)
}

/// The class names the generator writes (`words.txt` in the tiny layout, folder names else).
pub(crate) fn class_name(class: usize) -> String {
    format!("colour{class:02}")
}

fn hue_rgb(class: usize, classes: usize) -> [u8; 3] {
    let h = class as f32 / classes.max(1) as f32 * 6.0;
    let x = 1.0 - ((h % 2.0) - 1.0).abs();
    let (r, g, b) = match h as usize {
        0 => (1.0, x, 0.0),
        1 => (x, 1.0, 0.0),
        2 => (0.0, 1.0, x),
        3 => (0.0, x, 1.0),
        4 => (x, 0.0, 1.0),
        _ => (1.0, 0.0, x),
    };
    [r, g, b].map(|v| (40.0 + v * 200.0) as u8)
}

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Image `n` of `class`.
pub fn image(spec: &FolderSpec, class: usize, n: usize, split_salt: u64) -> RgbImage {
    let mut rng = Lcg(spec.seed ^ ((class as u64) << 32) ^ ((n as u64) << 8) ^ split_salt);
    let size = spec.size;
    let colour = hue_rgb(class, spec.classes);
    let side = (size / 2).max(1);
    let (x0, y0) = (
        (rng.next() % (size - side + 1) as u64) as u32,
        (rng.next() % (size - side + 1) as u64) as u32,
    );
    RgbImage::from_fn(size, size, |x, y| {
        let noise = (rng.next() % 41) as i32 - 20;
        let inside = (x0..x0 + side).contains(&x) && (y0..y0 + side).contains(&y);
        let base = if inside { colour } else { [110, 110, 110] };
        Rgb(base.map(|c| (c as i32 + noise).clamp(0, 255) as u8))
    })
}

/// Writes the folder under `root` (the tiny layout under `root/tiny-imagenet-200`).
pub fn write_folder(root: &Path, spec: &FolderSpec) -> std::io::Result<()> {
    let save = |img: &RgbImage, path: &Path| -> std::io::Result<()> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        img.save(path).map_err(std::io::Error::other)
    };
    if !spec.tiny_layout {
        for class in 0..spec.classes {
            let name = class_name(class);
            for n in 0..spec.train_per_class {
                save(
                    &image(spec, class, n, 1),
                    &root.join(format!("train/{name}/{n:05}.jpg")),
                )?;
            }
            for n in 0..spec.val_per_class {
                save(
                    &image(spec, class, n, 2),
                    &root.join(format!("val/{name}/{n:05}.jpg")),
                )?;
            }
        }
        return Ok(());
    }
    let root = root.join(super::folder::TINY_DIR);
    std::fs::create_dir_all(&root)?;
    let (mut words, mut wnids, mut annotations) = (String::new(), String::new(), String::new());
    let mut val = 0;
    for class in 0..spec.classes {
        let id = wnid(class);
        words.push_str(&format!("{id}\t{}, synonym\n", class_name(class)));
        wnids.push_str(&format!("{id}\n"));
        let mut boxes = String::new();
        for n in 0..spec.train_per_class {
            let file = format!("{id}_{n}.JPEG");
            save(
                &image(spec, class, n, 1),
                &root.join(format!("train/{id}/images/{file}")),
            )?;
            boxes.push_str(&format!("{file}\t0\t0\t{0}\t{0}\n", spec.size - 1));
        }
        std::fs::write(root.join(format!("train/{id}/{id}_boxes.txt")), boxes)?;
        for n in 0..spec.val_per_class {
            let file = format!("val_{val}.JPEG");
            val += 1;
            save(
                &image(spec, class, n, 2),
                &root.join(format!("val/images/{file}")),
            )?;
            annotations.push_str(&format!("{file}\t{id}\t0\t0\t{0}\t{0}\n", spec.size - 1));
        }
    }
    // A class of words.txt that is not in the data set, as the real file has 82,115 of them.
    words.push_str("n99999999\tnot in the data set\n");
    std::fs::write(root.join("words.txt"), words)?;
    std::fs::write(root.join("wnids.txt"), wnids)?;
    std::fs::write(root.join("val/val_annotations.txt"), annotations)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Layout, Split};

    #[test]
    fn both_layouts_are_detected_with_their_classes() {
        for tiny_layout in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let spec = FolderSpec {
                classes: 3,
                train_per_class: 2,
                val_per_class: 1,
                size: 16,
                tiny_layout,
                seed: 1,
            };
            write_folder(dir.path(), &spec).unwrap();
            let layout = Layout::locate(dir.path()).unwrap();
            let train = layout.open(Split::Train, 16, 1 << 20).unwrap();
            assert_eq!(train.classes, ["colour00", "colour01", "colour02"]);
            assert_eq!(train.len(), 6);
            let val = layout.open(Split::Eval, 16, 0).unwrap();
            assert_eq!(
                (0..3).map(|i| val.label(i)).collect::<Vec<_>>(),
                [0, 1, 2],
                "tiny: {tiny_layout}"
            );
        }
    }
}
