//! What the trainer trains and evaluates on: CIFAR-10 (both official layouts) and image folders
//! (torchvision's `ImageFolder` layout and tiny-imagenet-200's own), behind one [`Samples`],
//! with training augmentation that is a pure function of (seed, epoch, sample) and a
//! [`loader::Loader`] that decodes the next batches in parallel while the current step runs.

pub(crate) mod archive;
pub(crate) mod augment;
pub mod cifar;
mod download;
pub(crate) mod folder;
mod handoff;
pub(crate) mod loader;
pub mod synthetic;
pub(crate) mod tiny;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use archive::{Archive, extract_present, fetch_into};
use cifar::IMAGE_BYTES;

pub use augment::Augment;
pub use download::{DEFAULT_STALL_TIMEOUT, DataProgress, DownloadOptions};
pub use handoff::Handoff;

/// How pixels become the network's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Normalisation {
    /// The seed's `(x/255 − 0.5) / 0.5`.
    Cifar,
    /// torchvision's ImageNet mean and standard deviation per channel.
    ImageNet,
}

impl Normalisation {
    /// Per channel: `value = byte · scale + offset`.
    pub fn coefficients(self) -> [(f32, f32); 3] {
        match self {
            Normalisation::Cifar => [(2.0 / 255.0, -1.0); 3],
            Normalisation::ImageNet => {
                let mean = [0.485f32, 0.456, 0.406];
                let std = [0.229f32, 0.224, 0.225];
                std::array::from_fn(|c| (1.0 / (255.0 * std[c]), -mean[c] / std[c]))
            }
        }
    }
}

/// Which data set `--dataset` downloads when `--data` holds none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetName {
    Cifar10,
    TinyImageNet,
}

impl DatasetName {
    pub const CHOICES: &str = contract::DATASET_CHOICES;
    pub const ALL: [DatasetName; 2] = [DatasetName::Cifar10, DatasetName::TinyImageNet];

    /// Its name, aliases and official archive, as every crate knows them.
    pub fn contract(self) -> contract::Dataset {
        match self {
            DatasetName::Cifar10 => contract::CIFAR10,
            DatasetName::TinyImageNet => contract::TINY_IMAGENET,
        }
    }

    pub fn parse(name: &str) -> Option<DatasetName> {
        let wanted = contract::Dataset::parse(name)?;
        DatasetName::ALL
            .into_iter()
            .find(|d| d.contract() == wanted)
    }

    pub fn name(self) -> &'static str {
        self.contract().name
    }

    /// The official archive's file name (`cifar-10-binary.tar.gz`, `tiny-imagenet-200.zip`).
    pub fn archive_file(self) -> &'static str {
        self.archive().file
    }

    fn archive(self) -> &'static Archive {
        match self {
            DatasetName::Cifar10 => &cifar::CIFAR,
            DatasetName::TinyImageNet => &tiny::TINY,
        }
    }

    /// The official archive's address, MD5 and size.
    pub fn official(self) -> DownloadOptions {
        let archive = self.contract();
        DownloadOptions {
            enabled: true,
            url: archive.url.into(),
            md5: archive.md5.into(),
            size: Some(archive.size),
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            turn_on: None,
        }
    }
}

/// The part of a data set a run reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    /// CIFAR-10's test batch; an image folder's `val/`.
    Eval,
}

/// A data set on disk, as detected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    Cifar(cifar::Layout),
    Folder(folder::Layout),
}

impl Layout {
    /// Looks for CIFAR-10, then for an image folder, in `dir`.
    pub fn locate(dir: &Path) -> Option<Layout> {
        cifar::Layout::locate(dir)
            .map(Layout::Cifar)
            .or_else(|| folder::Layout::locate(dir).map(Layout::Folder))
    }

    pub fn dir(&self) -> &Path {
        match self {
            Layout::Cifar(l) => l.dir(),
            Layout::Folder(l) => l.root(),
        }
    }

    /// The image side a run uses when `--image-size` is not given: CIFAR's 32, else 64
    /// (tiny-imagenet's own size).
    pub(crate) fn default_image_size(&self) -> usize {
        match self {
            Layout::Cifar(_) => 32,
            Layout::Folder(_) => 64,
        }
    }

    /// Training augmentation when `--augment` is not given: none for CIFAR-10 (the seed's
    /// transforms), a padded random crop and flip for image folders.
    pub(crate) fn default_augment(&self) -> Augment {
        match self {
            Layout::Cifar(_) => Augment::None,
            Layout::Folder(_) => Augment::Crop,
        }
    }

    /// Reads one split: CIFAR-10 into memory; an image folder's file list (the images are
    /// decoded by the loader, cached up to `cache_bytes`).
    pub fn open(&self, split: Split, image_size: usize, cache_bytes: u64) -> Result<Samples> {
        match self {
            Layout::Cifar(layout) => {
                if image_size != 32 {
                    return Err(TrainError::Config(format!(
                        "CIFAR-10's images are 32×32, not {image_size}×{image_size}"
                    )));
                }
                let data = layout.load(match split {
                    Split::Train => cifar::Split::Train,
                    Split::Eval => cifar::Split::Test,
                })?;
                Ok(Samples {
                    source: Source::Cifar(data),
                    classes: cifar::CLASS_NAMES.iter().map(|c| c.to_string()).collect(),
                    image_size,
                    normalisation: Normalisation::Cifar,
                })
            }
            Layout::Folder(layout) => {
                let (classes, images) = layout.scan(split, image_size, cache_bytes)?;
                Ok(Samples {
                    source: Source::Folder(images),
                    classes,
                    image_size,
                    normalisation: Normalisation::ImageNet,
                })
            }
        }
    }
}

/// Returns the data set in `dir`: there already, extracted from `which`'s archive found in
/// `dir` under its official name (staged or copied there; checked like a download), or
/// downloaded there first. Safe against concurrent callers sharing `dir` (see [`fetch_into`]).
pub fn ensure(
    dir: &Path,
    which: DatasetName,
    opts: &DownloadOptions,
    progress: &mut dyn FnMut(DataProgress),
) -> Result<Layout> {
    if let Some(layout) = Layout::locate(dir) {
        return Ok(layout);
    }
    let archive = which.archive();
    let source = if extract_present(dir, opts, archive, progress)? {
        dir.join(archive.file).display().to_string()
    } else if opts.enabled {
        fetch_into(dir, opts, archive, progress)?;
        opts.url.clone()
    } else {
        let or_fetch = opts
            .turn_on
            .map(|how| format!(", or {how} to fetch --dataset {}", which.name()))
            .unwrap_or_default();
        return Err(TrainError::BadData {
            path: dir.to_path_buf(),
            problem: format!(
                "no data set here: expected CIFAR-10 (data_batch_1.bin or data_batch_1, also under {}/), {}, or {}'s archive {}; put one there{or_fetch}",
                cifar::BIN_DIR,
                folder::EXPECTED,
                which.name(),
                archive.file,
            ),
        });
    };
    Layout::locate(dir).ok_or_else(|| TrainError::BadData {
        path: dir.to_path_buf(),
        problem: format!(
            "the archive from {source} held no {} data set",
            archive.what
        ),
    })
}

/// One split of a data set.
pub struct Samples {
    source: Source,
    /// Class names, by label.
    pub classes: Vec<String>,
    /// Side of the square images the network gets.
    pub image_size: usize,
    pub normalisation: Normalisation,
}

enum Source {
    Cifar(cifar::CifarImages),
    Folder(folder::Images),
}

impl Samples {
    pub fn len(&self) -> usize {
        match &self.source {
            Source::Cifar(d) => d.len(),
            Source::Folder(f) => f.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn label(&self, i: usize) -> usize {
        match &self.source {
            Source::Cifar(d) => d.labels[i] as usize,
            Source::Folder(f) => f.label(i),
        }
    }

    /// The file of sample `i` (image folders only).
    pub fn path(&self, i: usize) -> Option<&Path> {
        match &self.source {
            Source::Cifar(_) => None,
            Source::Folder(f) => Some(f.path(i)),
        }
    }

    /// Floats per image: `3 × size²`.
    pub(crate) fn image_floats(&self) -> usize {
        3 * self.image_size * self.image_size
    }

    /// Writes sample `i` into `out` (channels first, normalised), augmented with `augment`
    /// drawn from `rng_seed` when given. An image that cannot be decoded is an `Err` naming
    /// the problem (the caller knows the path), never a panic.
    pub fn fill(
        &self,
        i: usize,
        augment: Augment,
        rng_seed: u64,
        out: &mut [f32],
    ) -> Result<(), String> {
        let size = self.image_size;
        match &self.source {
            Source::Cifar(d) => {
                let hwc = chw_to_hwc(d.image(i), size);
                augment::apply(&hwc, size, augment, rng_seed, self.normalisation, out);
            }
            Source::Folder(f) => {
                let base = f.base(i)?;
                augment::apply(&base, size, augment, rng_seed, self.normalisation, out);
            }
        }
        Ok(())
    }

    /// Images decoded and kept in memory so far, and their bytes (image folders).
    pub fn cached(&self) -> (usize, u64) {
        match &self.source {
            Source::Cifar(d) => (d.len(), (d.len() * IMAGE_BYTES) as u64),
            Source::Folder(f) => f.cached(),
        }
    }
}

fn chw_to_hwc(chw: &[u8], size: usize) -> Vec<u8> {
    let plane = size * size;
    let mut hwc = vec![0u8; 3 * plane];
    for (p, px) in hwc.chunks_exact_mut(3).enumerate() {
        for (c, v) in px.iter_mut().enumerate() {
            *v = chw[c * plane + p];
        }
    }
    hwc
}

/// Where a run's data lives, for messages.
pub fn describe(layout: &Layout) -> String {
    match layout {
        Layout::Cifar(cifar::Layout::Binary(d)) => format!("CIFAR-10 (binary) in {}", d.display()),
        Layout::Cifar(cifar::Layout::Python(d)) => format!("CIFAR-10 (python) in {}", d.display()),
        Layout::Folder(f) => f.describe(),
    }
}

/// Paths of unreadable images already reported, so each is reported once per run.
#[derive(Default)]
pub(crate) struct Unreadable {
    seen: std::collections::HashSet<PathBuf>,
}

impl Unreadable {
    /// True the first time `path` is seen.
    pub(crate) fn first(&mut self, path: &Path) -> bool {
        self.seen.insert(path.to_path_buf())
    }

    pub(crate) fn count(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::DatasetName;

    /// Every data set the other crates offer (`data.dataset`) is one the trainer downloads.
    #[test]
    fn every_data_set_of_the_contract_is_known_by_name_and_alias() {
        assert_eq!(DatasetName::ALL.len(), contract::DATASETS.len());
        for archive in contract::DATASETS {
            for name in archive.aliases.iter().chain([&archive.name]) {
                let known = DatasetName::parse(name).unwrap_or_else(|| panic!("{name}"));
                assert_eq!(known.contract(), archive);
            }
        }
    }
}
