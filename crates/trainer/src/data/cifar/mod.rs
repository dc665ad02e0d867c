//! CIFAR-10 on disk: both official layouts, detection, loading, and the official archive.

mod pickle;

use std::path::{Path, PathBuf};

use super::archive::{Archive, untar_gz};
use crate::error::{IoContext, Result, TrainError};

/// CIFAR-10's binary archive.
pub(crate) const CIFAR: Archive = Archive {
    what: contract::CIFAR10.what,
    file: contract::CIFAR10.file,
    folder: BIN_DIR,
    unpack: untar_gz,
    present: |dir| Layout::locate(dir).is_some(),
};

pub(crate) const IMAGE_BYTES: usize = 3 * 32 * 32;
pub(crate) const NUM_CLASSES: usize = 10;
/// The names the seed jobs print.
pub(crate) const CLASS_NAMES: [&str; NUM_CLASSES] = [
    "plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
];
pub const BIN_DIR: &str = contract::cifar10::BIN_DIR;
pub const PY_DIR: &str = contract::cifar10::PY_DIR;

/// Images as CIFAR stores them: per image 1024 red, 1024 green, then 1024 blue bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CifarImages {
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
}

impl CifarImages {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    pub fn image(&self, i: usize) -> &[u8] {
        &self.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES]
    }

    /// Appends the normalised pixels ((x/255 - 0.5) / 0.5, as the seed's transforms do) and labels
    /// of `indices` to `pixels` and `labels`.
    pub(crate) fn fill_batch(
        &self,
        indices: &[usize],
        pixels: &mut Vec<f32>,
        labels: &mut Vec<i64>,
    ) {
        pixels.clear();
        labels.clear();
        for &i in indices {
            pixels.extend(self.image(i).iter().map(|&b| normalise(b)));
            labels.push(self.labels[i] as i64);
        }
    }
}

pub(crate) fn normalise(byte: u8) -> f32 {
    byte as f32 * (2.0 / 255.0) - 1.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Test,
}

/// Which of the two official layouts a directory holds, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    Binary(PathBuf),
    Python(PathBuf),
}

impl Layout {
    /// Looks in `dir` itself, then in the folder each official archive extracts to.
    pub fn locate(dir: &Path) -> Option<Layout> {
        use contract::cifar10::{BINARY_MARK, PYTHON_MARK, folders};
        folders(dir).into_iter().find_map(|d| {
            if d.join(BINARY_MARK).is_file() {
                Some(Layout::Binary(d))
            } else if d.join(PYTHON_MARK).is_file() {
                Some(Layout::Python(d))
            } else {
                None
            }
        })
    }

    pub fn dir(&self) -> &Path {
        match self {
            Layout::Binary(d) | Layout::Python(d) => d,
        }
    }

    fn files(&self, split: Split) -> Vec<PathBuf> {
        let ext = match self {
            Layout::Binary(_) => ".bin",
            Layout::Python(_) => "",
        };
        match split {
            Split::Test => vec![self.dir().join(format!("test_batch{ext}"))],
            Split::Train => (1..=5)
                .map(|i| self.dir().join(format!("data_batch_{i}{ext}")))
                .take_while(|p| p.is_file())
                .collect(),
        }
    }

    pub fn load(&self, split: Split) -> Result<CifarImages> {
        let mut all = CifarImages::default();
        for file in self.files(split) {
            let bytes = std::fs::read(&file).at(&file)?;
            let part = match self {
                Layout::Binary(_) => parse_binary(&bytes),
                Layout::Python(_) => parse_python(&bytes),
            }
            .map_err(|problem| TrainError::BadData {
                path: file.clone(),
                problem,
            })?;
            all.images.extend(part.images);
            all.labels.extend(part.labels);
        }
        Ok(all)
    }
}

/// Binary layout: records of one label byte and 3072 pixel bytes.
pub(crate) fn parse_binary(bytes: &[u8]) -> Result<CifarImages, String> {
    const RECORD: usize = 1 + IMAGE_BYTES;
    if bytes.is_empty() || !bytes.len().is_multiple_of(RECORD) {
        return Err(format!(
            "{} bytes is not a whole number of {RECORD}-byte CIFAR-10 records (truncated or corrupt; an official batch is {} bytes): delete it to download again",
            bytes.len(),
            10_000 * RECORD
        ));
    }
    let mut out = CifarImages {
        images: Vec::with_capacity(bytes.len() / RECORD * IMAGE_BYTES),
        labels: Vec::with_capacity(bytes.len() / RECORD),
    };
    for (i, record) in bytes.chunks_exact(RECORD).enumerate() {
        if record[0] as usize >= NUM_CLASSES {
            return Err(format!(
                "record {i} has label {}, expected 0-9 (corrupt file)",
                record[0]
            ));
        }
        out.labels.push(record[0]);
        out.images.extend_from_slice(&record[1..]);
    }
    Ok(out)
}

/// Python layout: a pickled dict with `data` (uint8 array N×3072) and `labels`.
pub(crate) fn parse_python(bytes: &[u8]) -> Result<CifarImages, String> {
    let value = pickle::unpickle(bytes).map_err(|e| format!("not a readable pickle: {e}"))?;
    let data = value
        .get("data")
        .ok_or("the pickled dict has no 'data' entry")?;
    let (shape, raw) = pickle::numpy_u8(data)?;
    let labels = value
        .get("labels")
        .ok_or("the pickled dict has no 'labels' entry")?;
    let pickle::Value::List(labels) = labels else {
        return Err("'labels' is not a list".into());
    };
    let n = labels.len();
    if shape != [n, IMAGE_BYTES] || raw.len() != n * IMAGE_BYTES {
        return Err(format!(
            "'data' has shape {shape:?} and {} bytes, expected [{n}, {IMAGE_BYTES}] for {n} labels (truncated or corrupt)",
            raw.len()
        ));
    }
    let labels = labels
        .iter()
        .enumerate()
        .map(|(i, l)| match l {
            pickle::Value::Int(v) if (0..NUM_CLASSES as i64).contains(v) => Ok(*v as u8),
            other => Err(format!("label {i} is {other:?}, expected 0-9")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(CifarImages {
        images: raw.to_vec(),
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_load_the_same_images() {
        let data = crate::data::synthetic::cifar(40, 7);
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        let py = dir.path().join("py");
        crate::data::synthetic::write_binary(&bin, &data, &data).unwrap();
        crate::data::synthetic::write_python(&py, &data, &data).unwrap();
        let a = Layout::locate(&bin).unwrap();
        let b = Layout::locate(&py).unwrap();
        assert!(matches!(a, Layout::Binary(_)) && matches!(b, Layout::Python(_)));
        assert_eq!(a.load(Split::Train).unwrap(), data);
        assert_eq!(b.load(Split::Train).unwrap(), data);
        assert_eq!(b.load(Split::Test).unwrap(), data);
    }

    #[test]
    fn truncated_files_name_the_file_and_the_expectation() {
        let data = crate::data::synthetic::cifar(5, 1);
        let dir = tempfile::tempdir().unwrap();
        crate::data::synthetic::write_binary(dir.path(), &data, &data).unwrap();
        let file = dir.path().join("data_batch_1.bin");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 10]).unwrap();
        let err = Layout::locate(dir.path())
            .unwrap()
            .load(Split::Train)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data_batch_1.bin") && err.contains("3073-byte"),
            "{err}"
        );

        let py = dir.path().join("py");
        crate::data::synthetic::write_python(&py, &data, &data).unwrap();
        let file = py.join("test_batch");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
        let err = Layout::locate(&py)
            .unwrap()
            .load(Split::Test)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("test_batch") && err.contains("truncated"),
            "{err}"
        );
    }
}
