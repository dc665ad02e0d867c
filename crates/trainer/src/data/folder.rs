//! Image folders: torchvision's `ImageFolder` layout (`train/CLASS/**/*.jpg`, `val/CLASS/...`)
//! and tiny-imagenet-200's own (`train/WNID/images/*.JPEG`, `val/images/*.JPEG` labelled by
//! `val/val_annotations.txt`, class names in `words.txt`).
//!
//! Classes are the training folder's class directories in sorted order, as torchvision's
//! `ImageFolder` numbers them, so a model trained here predicts the indices a torchvision
//! pipeline over the same folder expects. Files are listed in sorted order: every rank and
//! host sees the same sample numbering.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use image::imageops::FilterType;

use super::Split;
use crate::error::{IoContext, Result, TrainError};

/// What an image folder must look like, for messages.
pub(crate) const EXPECTED: &str = "or an image folder (train/CLASS/*.jpg|jpeg|png and val/CLASS/..., or tiny-imagenet-200's train/WNID/images/ with val/val_annotations.txt)";

/// The folder tiny-imagenet-200.zip extracts to.
pub(crate) const TINY_DIR: &str = "tiny-imagenet-200";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// `root/train/CLASS/**/image` and `root/val/CLASS/**/image`.
    ImageFolder(PathBuf),
    /// tiny-imagenet-200 as its archive extracts.
    TinyImageNet(PathBuf),
}

fn is_image(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| {
        ["jpg", "jpeg", "png"]
            .iter()
            .any(|x| e.eq_ignore_ascii_case(x))
    })
}

fn subdirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).at(dir)? {
        let path = entry.at(dir)?.path();
        if path.is_dir() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Every image file under `dir`, at any depth, sorted.
fn images_under(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .at(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .at(dir)?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            images_under(&path, out)?;
        } else if is_image(&path) {
            out.push(path);
        }
    }
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

impl Layout {
    /// Looks in `dir`, then in `dir/tiny-imagenet-200`.
    pub fn locate(dir: &Path) -> Option<Layout> {
        [dir.to_path_buf(), dir.join(TINY_DIR)]
            .into_iter()
            .find_map(|root| {
                let train = root.join("train");
                if !train.is_dir() {
                    return None;
                }
                if root.join("val").join("val_annotations.txt").is_file()
                    || root.join("wnids.txt").is_file()
                {
                    return Some(Layout::TinyImageNet(root));
                }
                // An image folder: some class directory under train/.
                let has_class = std::fs::read_dir(&train)
                    .ok()?
                    .filter_map(|e| e.ok())
                    .any(|e| e.path().is_dir());
                has_class.then_some(Layout::ImageFolder(root))
            })
    }

    pub fn root(&self) -> &Path {
        match self {
            Layout::ImageFolder(r) | Layout::TinyImageNet(r) => r,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Layout::ImageFolder(r) => format!("image folder {}", r.display()),
            Layout::TinyImageNet(r) => format!("tiny-imagenet-200 in {}", r.display()),
        }
    }

    /// Class directory names (torchvision's order) and their display names.
    fn classes(&self) -> Result<(Vec<String>, Vec<String>)> {
        let train = self.root().join("train");
        let ids: Vec<String> = subdirs(&train)?.iter().map(|d| file_name(d)).collect();
        if ids.is_empty() {
            return Err(TrainError::BadData {
                path: train,
                problem: format!(
                    "no class folders; expected {}",
                    EXPECTED.trim_start_matches("or ")
                ),
            });
        }
        let names = match self {
            Layout::ImageFolder(_) => ids.clone(),
            Layout::TinyImageNet(root) => {
                let words = root.join("words.txt");
                let text = std::fs::read_to_string(&words).unwrap_or_default();
                let table = parse_words(&text);
                ids.iter()
                    .map(|id| {
                        table
                            .get(id.as_str())
                            .cloned()
                            .unwrap_or_else(|| id.clone())
                    })
                    .collect()
            }
        };
        Ok((ids, names))
    }

    /// The images of `split` with their labels; decoded later, at `image_size`, cached up to
    /// `cache_bytes`.
    pub fn scan(
        &self,
        split: Split,
        image_size: usize,
        cache_bytes: u64,
    ) -> Result<(Vec<String>, Images)> {
        let (ids, names) = self.classes()?;
        let index: HashMap<&str, u32> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i as u32))
            .collect();
        let root = self.root();
        let mut files = Vec::new();
        let mut labels = Vec::new();
        match (self, split) {
            (Layout::TinyImageNet(_), Split::Train) | (Layout::ImageFolder(_), Split::Train) => {
                for (label, id) in ids.iter().enumerate() {
                    let dir = root.join("train").join(id);
                    let before = files.len();
                    images_under(&dir, &mut files)?;
                    if files.len() == before {
                        return Err(TrainError::BadData {
                            path: dir,
                            problem: "class folder with no .jpg, .jpeg or .png images: add images or remove the folder".into(),
                        });
                    }
                    labels.resize(files.len(), label as u32);
                }
            }
            (Layout::ImageFolder(_), Split::Eval) => {
                let val = root.join("val");
                if !val.is_dir() {
                    return Err(TrainError::BadData {
                        path: val,
                        problem: "no validation folder: put val/CLASS/... beside train/".into(),
                    });
                }
                for dir in subdirs(&val)? {
                    let id = file_name(&dir);
                    let Some(&label) = index.get(id.as_str()) else {
                        return Err(TrainError::BadData {
                            path: dir,
                            problem: format!(
                                "class {id:?} is not among the {} training classes (train/{id} is missing)",
                                ids.len()
                            ),
                        });
                    };
                    images_under(&dir, &mut files)?;
                    labels.resize(files.len(), label);
                }
            }
            (Layout::TinyImageNet(_), Split::Eval) => {
                let annotations = root.join("val").join("val_annotations.txt");
                let text = std::fs::read_to_string(&annotations).at(&annotations)?;
                let bad = |problem: String| TrainError::BadData {
                    path: annotations.clone(),
                    problem,
                };
                for a in parse_annotations(&text).map_err(bad)? {
                    let Some(&label) = index.get(a.id) else {
                        return Err(bad(format!(
                            "line {}: class {:?} has no train/{} folder",
                            a.line, a.id, a.id
                        )));
                    };
                    files.push(root.join("val").join("images").join(a.file));
                    labels.push(label);
                }
            }
        }
        Ok((names, Images::new(files, labels, image_size, cache_bytes)))
    }
}

/// One line of tiny-imagenet's `val/val_annotations.txt`: an image in `val/images/` and the
/// WNID of its class.
pub(crate) struct Annotation<'a> {
    /// The line's number, from 1.
    pub line: usize,
    pub file: &'a str,
    pub id: &'a str,
}

/// `val_annotations.txt`: `FILE<TAB>WNID<TAB>box...` a line (blank lines skipped). A file that
/// is not a plain name (empty, or with `/` or `..`) is refused: it would reach outside
/// `val/images/`.
pub(crate) fn parse_annotations(text: &str) -> std::result::Result<Vec<Annotation<'_>>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut fields = line.split('\t');
        let (Some(file), Some(id)) = (fields.next(), fields.next()) else {
            if line.trim().is_empty() {
                continue;
            }
            return Err(format!(
                "line {}: expected FILE<TAB>WNID..., got {line:?}",
                n + 1
            ));
        };
        if file.is_empty() || file.contains('/') || file.contains("..") {
            return Err(format!("line {}: {file:?} is not a file name", n + 1));
        }
        out.push(Annotation {
            line: n + 1,
            file,
            id,
        });
    }
    Ok(out)
}

/// `words.txt`: `WNID<TAB>name, synonym, ...` → the first name.
pub(crate) fn parse_words(text: &str) -> HashMap<&str, String> {
    text.lines()
        .filter_map(|line| {
            let (id, names) = line.split_once('\t')?;
            let first = names.split(',').next()?.trim();
            Some((id.trim(), first.to_string()))
        })
        .collect()
}

/// The files of one split and a cache of their decoded images.
pub struct Images {
    files: Vec<PathBuf>,
    labels: Vec<u32>,
    size: usize,
    cache: Vec<OnceLock<Box<[u8]>>>,
    cache_limit: u64,
    cache_used: AtomicU64,
    cache_count: AtomicUsize,
}

impl Images {
    fn new(files: Vec<PathBuf>, labels: Vec<u32>, size: usize, cache_limit: u64) -> Images {
        let cache = (0..files.len()).map(|_| OnceLock::new()).collect();
        Images {
            files,
            labels,
            size,
            cache,
            cache_limit,
            cache_used: AtomicU64::new(0),
            cache_count: AtomicUsize::new(0),
        }
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    pub fn label(&self, i: usize) -> usize {
        self.labels[i] as usize
    }

    pub fn path(&self, i: usize) -> &Path {
        &self.files[i]
    }

    pub fn cached(&self) -> (usize, u64) {
        (
            self.cache_count.load(Ordering::Relaxed),
            self.cache_used.load(Ordering::Relaxed),
        )
    }

    /// Image `i` at `size`² (RGB rows), from the cache or decoded (and cached while the cache
    /// has room).
    pub fn base(&self, i: usize) -> Result<std::borrow::Cow<'_, [u8]>, String> {
        if let Some(hit) = self.cache[i].get() {
            return Ok(std::borrow::Cow::Borrowed(hit));
        }
        let pixels = decode(&self.files[i], self.size)?;
        let bytes = pixels.len() as u64;
        let reserved = self
            .cache_used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                (used + bytes <= self.cache_limit).then_some(used + bytes)
            })
            .is_ok();
        if reserved {
            if self.cache[i].set(pixels.clone().into_boxed_slice()).is_ok() {
                self.cache_count.fetch_add(1, Ordering::Relaxed);
            } else {
                // Another thread cached it first.
                self.cache_used.fetch_sub(bytes, Ordering::Relaxed);
            }
        }
        Ok(std::borrow::Cow::Owned(pixels))
    }
}

/// Decodes a JPEG or PNG, resizes its shorter side to `size` and crops the centre square
/// (torchvision's `Resize(size)` + `CenterCrop(size)`), as RGB rows.
pub(crate) fn decode(path: &Path, size: usize) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let image = image::load_from_memory(&bytes)
        .map_err(|e| format!("cannot decode as a JPEG or PNG image: {e}"))?;
    Ok(square(image.to_rgb8(), size))
}

/// `image` with its shorter side resized to `size`, centre-cropped to `size`².
pub(crate) fn square(image: image::RgbImage, size: usize) -> Vec<u8> {
    let (w, h) = image.dimensions();
    let size32 = size as u32;
    let image = if w == size32 && h == size32 {
        image
    } else {
        let (nw, nh) = if w <= h {
            (
                size32,
                ((h as u64 * size as u64).div_ceil(w.max(1) as u64)) as u32,
            )
        } else {
            (
                ((w as u64 * size as u64).div_ceil(h.max(1) as u64)) as u32,
                size32,
            )
        };
        let resized =
            image::imageops::resize(&image, nw.max(size32), nh.max(size32), FilterType::Triangle);
        let (rw, rh) = resized.dimensions();
        image::imageops::crop_imm(
            &resized,
            (rw - size32) / 2,
            (rh - size32) / 2,
            size32,
            size32,
        )
        .to_image()
    };
    image.into_raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotations_name_plain_files_only() {
        let good = parse_annotations("val_0.JPEG\tn01\t0\t0\t8\t8\n\nval_1.JPEG\tn02\n").unwrap();
        let read: Vec<_> = good.iter().map(|a| (a.line, a.file, a.id)).collect();
        assert_eq!(read, [(1, "val_0.JPEG", "n01"), (3, "val_1.JPEG", "n02")]);
        for (text, says) in [
            (
                "../x.JPEG\tn01\n",
                "line 1: \"../x.JPEG\" is not a file name",
            ),
            (
                "a\tn01\nsub/x.JPEG\tn01\n",
                "line 2: \"sub/x.JPEG\" is not a file name",
            ),
            ("\tn01\n", "line 1: \"\" is not a file name"),
            (
                "no tab here\n",
                "line 1: expected FILE<TAB>WNID..., got \"no tab here\"",
            ),
        ] {
            assert_eq!(
                parse_annotations(text).err().as_deref(),
                Some(says),
                "{text:?}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn any_annotations_text_is_refused_or_names_plain_files(text in "[a-z./\t\n ]{0,80}") {
            if let Ok(lines) = parse_annotations(&text) {
                for a in lines {
                    proptest::prop_assert!(!a.file.is_empty() && !a.file.contains('/') && !a.file.contains(".."));
                }
            }
            proptest::prop_assert!(parse_words(&text).len() <= text.lines().count());
        }
    }

    fn write_png(path: &Path, w: u32, h: u32, value: u8) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        image::RgbImage::from_pixel(w, h, image::Rgb([value, value / 2, 255 - value]))
            .save(path)
            .unwrap();
    }

    #[test]
    fn an_image_folder_is_detected_classes_sorted_and_val_labelled_by_folder() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for (class, n) in [("zebra", 2), ("ant", 3)] {
            for i in 0..n {
                write_png(
                    &root.join(format!("train/{class}/sub/{i}.png")),
                    8,
                    8,
                    10 * i as u8,
                );
            }
            write_png(&root.join(format!("val/{class}/v.PNG")), 8, 8, 1);
        }
        std::fs::write(root.join("train/ant/notes.txt"), "not an image").unwrap();
        let layout = Layout::locate(root).unwrap();
        assert_eq!(layout, Layout::ImageFolder(root.to_path_buf()));
        let (classes, train) = layout.scan(Split::Train, 8, 1 << 20).unwrap();
        assert_eq!(classes, ["ant", "zebra"]);
        assert_eq!(train.len(), 5);
        assert_eq!(
            (0..5).map(|i| train.label(i)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 1]
        );
        let (_, val) = layout.scan(Split::Eval, 8, 0).unwrap();
        assert_eq!(val.len(), 2);
        assert_eq!((val.label(0), val.label(1)), (0, 1));

        write_png(&root.join("val/unknown/x.png"), 8, 8, 1);
        let err = layout.scan(Split::Eval, 8, 0).err().unwrap().to_string();
        assert!(
            err.contains("\"unknown\" is not among the 2 training classes"),
            "{err}"
        );
    }

    #[test]
    fn tiny_imagenets_layout_reads_annotations_and_words() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join(TINY_DIR);
        for id in ["n02", "n01"] {
            write_png(
                &root.join(format!("train/{id}/images/{id}_0.JPEG")),
                64,
                64,
                3,
            );
            std::fs::write(root.join(format!("train/{id}/{id}_boxes.txt")), "").unwrap();
        }
        write_png(&root.join("val/images/val_0.JPEG"), 64, 64, 3);
        write_png(&root.join("val/images/val_1.JPEG"), 64, 64, 3);
        std::fs::write(
            root.join("val/val_annotations.txt"),
            "val_0.JPEG\tn02\t0\t1\t2\t3\nval_1.JPEG\tn01\t0\t1\t2\t3\n",
        )
        .unwrap();
        std::fs::write(
            root.join("words.txt"),
            "n01\tgoldfish, Carassius auratus\nn02\tant, emmet\nn03\tother\n",
        )
        .unwrap();
        // Found from the folder above, as `--data DIR` after a download.
        let layout = Layout::locate(dir.path()).unwrap();
        assert_eq!(layout, Layout::TinyImageNet(root.clone()));
        let (classes, train) = layout.scan(Split::Train, 64, 0).unwrap();
        assert_eq!(classes, ["goldfish", "ant"]);
        assert_eq!(train.len(), 2);
        let (_, val) = layout.scan(Split::Eval, 64, 0).unwrap();
        assert_eq!((val.label(0), val.label(1)), (1, 0));
        assert!(val.path(0).ends_with("val/images/val_0.JPEG"));
    }

    #[test]
    fn neither_layout_is_not_located() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Layout::locate(dir.path()), None);
        std::fs::create_dir_all(dir.path().join("train")).unwrap();
        assert_eq!(
            Layout::locate(dir.path()),
            None,
            "train/ without class folders"
        );
    }

    #[test]
    fn decoding_resizes_the_shorter_side_and_crops_the_centre() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wide.png");
        let mut img = image::RgbImage::from_pixel(40, 20, image::Rgb([0, 0, 0]));
        for y in 0..20 {
            for x in 10..30 {
                img.put_pixel(x, y, image::Rgb([200, 100, 50]));
            }
        }
        img.save(&path).unwrap();
        let pixels = decode(&path, 10).unwrap();
        assert_eq!(pixels.len(), 300);
        // The centre square of the wide image is the coloured band.
        assert!(pixels.chunks(3).all(|p| p[0] > 150), "{pixels:?}");

        std::fs::write(&path, b"\x89PNG\r\n\x1a\nnot really").unwrap();
        let err = decode(&path, 10).unwrap_err();
        assert!(err.contains("cannot decode"), "{err}");
    }

    #[test]
    fn the_cache_keeps_images_up_to_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<PathBuf> = (0..4)
            .map(|i| {
                let p = dir.path().join(format!("{i}.png"));
                write_png(&p, 4, 4, i as u8);
                p
            })
            .collect();
        // Room for two 4×4 RGB images.
        let images = Images::new(files.clone(), vec![0; 4], 4, 2 * 48);
        for i in 0..4 {
            images.base(i).unwrap();
        }
        assert_eq!(images.cached(), (2, 96));
        // A cached image no longer needs its file; one that did not fit does.
        std::fs::remove_file(&files[0]).unwrap();
        std::fs::remove_file(&files[3]).unwrap();
        assert!(images.base(0).is_ok());
        assert!(images.base(3).unwrap_err().contains("cannot read"));
    }
}
