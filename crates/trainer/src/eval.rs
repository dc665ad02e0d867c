//! Evaluation (overall and per-class accuracy, confusion matrix) and prediction on images.

use std::path::Path;

use burn::tensor::{Tensor, TensorData};

use crate::cifar::{CLASS_NAMES, Dataset, IMAGE_BYTES, NUM_CLASSES, normalise};
use crate::device::inference_device;
use crate::error::{Result, TrainError};
use crate::model::{SeedCnn, load, snapshot, to_vec};

/// Counts of (true class, predicted class).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Confusion {
    pub counts: [[u64; NUM_CLASSES]; NUM_CLASSES],
}

impl Confusion {
    pub fn total(&self) -> u64 {
        self.counts.iter().flatten().sum()
    }

    pub fn correct(&self) -> u64 {
        (0..NUM_CLASSES).map(|c| self.counts[c][c]).sum()
    }

    /// Overall accuracy in percent.
    pub fn accuracy(&self) -> f64 {
        percent(self.correct(), self.total())
    }

    /// Accuracy of one true class in percent (`None` when the class never occurs).
    pub fn class_accuracy(&self, class: usize) -> Option<f64> {
        let n: u64 = self.counts[class].iter().sum();
        (n > 0).then(|| percent(self.counts[class][class], n))
    }

    /// As `f32`s, for summing across ranks (exact below 2^24 images).
    pub fn to_f32(&self) -> Vec<f32> {
        self.counts.iter().flatten().map(|&c| c as f32).collect()
    }

    pub fn from_f32(values: &[f32]) -> Self {
        let mut out = Confusion::default();
        for (i, v) in values.iter().enumerate().take(NUM_CLASSES * NUM_CLASSES) {
            out.counts[i / NUM_CLASSES][i % NUM_CLASSES] = v.round().max(0.0) as u64;
        }
        out
    }

    /// The seed's report: overall accuracy, then one line per class.
    pub fn report(&self) -> String {
        let mut out = format!(
            "Accuracy of the network on the {} test images: {:.1} %\n",
            self.total(),
            self.accuracy()
        );
        for (class, name) in CLASS_NAMES.iter().enumerate() {
            match self.class_accuracy(class) {
                Some(acc) => out.push_str(&format!("Accuracy for class: {name:5} is {acc:.1} %\n")),
                None => out.push_str(&format!(
                    "Accuracy for class: {name:5} is n/a (no test images)\n"
                )),
            }
        }
        out
    }
}

fn percent(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

/// A model for inference, built from flat parameters and buffers.
pub fn inference_model(params: &[f32], buffers: &[f32]) -> SeedCnn {
    load(SeedCnn::new(&inference_device()), Some(params), buffers)
}

/// Loads a model file (trainctl's, or the seed's PyTorch model saved as safetensors).
pub fn load_model_file(path: &Path) -> Result<SeedCnn> {
    let template = snapshot(&SeedCnn::new(&inference_device()));
    let (params, buffers) = crate::checkpoint::load_model(path, &template)?;
    Ok(inference_model(&params, &buffers))
}

/// Predicted classes of `batch` (CHW images, normalised).
fn classify(model: &SeedCnn, pixels: Vec<f32>, n: usize) -> Vec<Vec<f32>> {
    let x = Tensor::<4>::from_data(TensorData::new(pixels, [n, 3, 32, 32]), &inference_device());
    let probs = burn::tensor::activation::softmax(model.forward(x), 1);
    to_vec(probs)
        .chunks(NUM_CLASSES)
        .map(|c| c.to_vec())
        .collect()
}

fn argmax(p: &[f32]) -> usize {
    p.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0
}

/// Evaluates `model` on the images of `data` at `indices`.
pub fn evaluate(
    model: &SeedCnn,
    data: &Dataset,
    indices: &[usize],
    batch_size: usize,
) -> Confusion {
    let mut confusion = Confusion::default();
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for chunk in indices.chunks(batch_size.max(1)) {
        data.fill_batch(chunk, &mut pixels, &mut labels);
        for (probs, &label) in classify(model, pixels.clone(), chunk.len())
            .iter()
            .zip(&labels)
        {
            confusion.counts[label as usize][argmax(probs)] += 1;
        }
    }
    confusion
}

/// One image's prediction: the top-3 classes with their probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub top: Vec<(&'static str, f32)>,
}

/// Classifies PNG or JPEG images of any size (resized to 32×32, as CIFAR-10's images are).
pub fn predict(model: &SeedCnn, images: &[&Path]) -> Result<Vec<Prediction>> {
    let mut pixels = Vec::with_capacity(images.len() * IMAGE_BYTES);
    for path in images {
        let img = image::open(path).map_err(|e| TrainError::BadData {
            path: path.to_path_buf(),
            problem: format!("cannot read as a PNG or JPEG image: {e}"),
        })?;
        let img = image::imageops::resize(
            &img.to_rgb8(),
            32,
            32,
            image::imageops::FilterType::Triangle,
        );
        for channel in 0..3 {
            pixels.extend(img.pixels().map(|p| normalise(p.0[channel])));
        }
    }
    Ok(classify(model, pixels, images.len())
        .into_iter()
        .map(|probs| {
            let mut ranked: Vec<(&'static str, f32)> =
                CLASS_NAMES.iter().copied().zip(probs).collect();
            ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
            ranked.truncate(3);
            Prediction { top: ranked }
        })
        .collect())
}

/// Reads and verifies a checkpoint (envelope, checksum, tensor names and shapes) and returns
/// where its training stands.
pub fn inspect_checkpoint(path: &Path) -> Result<crate::checkpoint::Progress> {
    let template = snapshot(&SeedCnn::new(&inference_device()));
    match crate::checkpoint::load_checkpoint(path, &template)? {
        Some(ckpt) => Ok(ckpt.progress),
        None => Err(crate::TrainError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no checkpoint there"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_has_the_seed_format() {
        let mut c = Confusion::default();
        c.counts[0][0] = 3;
        c.counts[0][1] = 1;
        c.counts[1][1] = 4;
        let report = c.report();
        assert!(
            report.contains("Accuracy of the network on the 8 test images: 87.5 %"),
            "{report}"
        );
        assert!(
            report.contains("Accuracy for class: plane is 75.0 %"),
            "{report}"
        );
        assert!(
            report.contains("Accuracy for class: car   is 100.0 %"),
            "{report}"
        );
        assert_eq!(Confusion::from_f32(&c.to_f32()), c);
    }
}
