//! Evaluation (top-1 and top-5, per-class accuracy, confusion matrix) and prediction on
//! images, for any [`Model`] with the classes and input its model file describes.

use std::path::Path;
use std::sync::Arc;

use burn::tensor::activation::softmax;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::{ModelInfo, read_model};
use crate::data::augment;
use crate::data::loader::{Loader, LoaderOptions};
use crate::data::{Augment, Samples};
use crate::device::{inference_device, on_compute_threads};
use crate::error::{Result, TrainError};
use crate::model::{Architecture, Model, load, snapshot, to_vec};

/// Per-class lines a report shows in full; above this, the best and the worst ten.
const FULL_TABLE: usize = 20;

/// Counts of (true class, predicted class), and how often the true class was among the top
/// five.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Confusion {
    pub classes: Vec<String>,
    /// `counts[true * classes + predicted]`.
    pub counts: Vec<u64>,
    pub top5: u64,
}

impl Confusion {
    pub fn new(classes: Vec<String>) -> Confusion {
        let n = classes.len();
        Confusion {
            classes,
            counts: vec![0; n * n],
            top5: 0,
        }
    }

    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    pub fn count(&self, truth: usize, predicted: usize) -> u64 {
        self.counts[truth * self.classes() + predicted]
    }

    /// Row `truth` of the matrix.
    pub fn row(&self, truth: usize) -> &[u64] {
        let n = self.classes();
        &self.counts[truth * n..(truth + 1) * n]
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn correct(&self) -> u64 {
        (0..self.classes()).map(|c| self.count(c, c)).sum()
    }

    /// Top-1 accuracy in percent.
    pub fn accuracy(&self) -> f64 {
        percent(self.correct(), self.total())
    }

    /// Top-5 accuracy in percent, for more than five classes.
    pub fn top5_accuracy(&self) -> Option<f64> {
        (self.classes() > 5).then(|| percent(self.top5, self.total()))
    }

    /// Accuracy of one true class in percent (`None` when the class never occurs).
    pub fn class_accuracy(&self, class: usize) -> Option<f64> {
        let n: u64 = self.row(class).iter().sum();
        (n > 0).then(|| percent(self.count(class, class), n))
    }

    /// The counts then the top-5 count, as `f32`s for summing across ranks (exact below 2^24
    /// images).
    pub fn to_f32(&self) -> Vec<f32> {
        self.counts
            .iter()
            .chain([&self.top5])
            .map(|&c| c as f32)
            .collect()
    }

    pub(crate) fn from_f32(classes: Vec<String>, values: &[f32]) -> Self {
        let mut out = Confusion::new(classes);
        let n = out.counts.len();
        for (slot, v) in out.counts.iter_mut().zip(values) {
            *slot = v.round().max(0.0) as u64;
        }
        out.top5 = values.get(n).map_or(0, |v| v.round().max(0.0) as u64);
        out
    }

    /// The seed's report: overall accuracy, then one line per class (for many classes, the
    /// best ten and the worst ten).
    pub fn report(&self) -> String {
        let mut out = format!(
            "Accuracy of the network on the {} test images: {:.1} %\n",
            self.total(),
            self.accuracy()
        );
        if let Some(top5) = self.top5_accuracy() {
            out.push_str(&format!("Top-5 accuracy: {top5:.1} %\n"));
        }
        let line = |class: usize| {
            let name = &self.classes[class];
            match self.class_accuracy(class) {
                Some(acc) => format!("Accuracy for class: {name:5} is {acc:.1} %\n"),
                None => format!("Accuracy for class: {name:5} is n/a (no test images)\n"),
            }
        };
        if self.classes() <= FULL_TABLE {
            (0..self.classes()).for_each(|c| out.push_str(&line(c)));
            return out;
        }
        let mut ranked: Vec<(usize, f64)> = (0..self.classes())
            .filter_map(|c| self.class_accuracy(c).map(|a| (c, a)))
            .collect();
        // Best first; ties in class order.
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let shown = ranked.len().min(10);
        out.push_str(&format!("Best {shown} classes:\n"));
        ranked[..shown]
            .iter()
            .for_each(|&(c, _)| out.push_str(&line(c)));
        out.push_str(&format!("Worst {shown} classes:\n"));
        ranked[ranked.len() - shown..]
            .iter()
            .rev()
            .for_each(|&(c, _)| out.push_str(&line(c)));
        out.push_str(&format!(
            "({} classes; the whole table is in the eval record and --confusion-matrix FILE)\n",
            self.classes()
        ));
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

/// A trained network ready for inference, with what its file says of it.
pub struct Loaded {
    pub model: Model,
    pub info: ModelInfo,
}

/// A model for inference of `arch` with `classes` classes, built from flat parameters and
/// buffers.
pub(crate) fn inference_model(
    arch: Architecture,
    classes: usize,
    params: &[f32],
    buffers: &[f32],
) -> Model {
    load(
        Model::new(arch, classes, &inference_device()),
        Some(params),
        buffers,
    )
}

/// Loads a model file: trainctl's, the seed's PyTorch model, or a torchvision ResNet, all as
/// safetensors.
pub fn load_model_file(path: &Path) -> Result<Loaded> {
    let file = read_model(path)?;
    let bad = |problem: String| TrainError::BadModel {
        path: path.to_path_buf(),
        problem,
    };
    let arch = file.info.architecture().map_err(bad)?;
    let classes = file.info.classes.len();
    let template = snapshot(&Model::new(arch, classes, &inference_device()));
    let (params, buffers) = file.tensors(&template)?;
    Ok(Loaded {
        model: inference_model(arch, classes, &params, &buffers),
        info: file.info,
    })
}

/// Class probabilities of `n` images (channels first, normalised) of side `size`.
fn classify(model: &Model, pixels: Vec<f32>, n: usize, size: usize) -> Vec<Vec<f32>> {
    let x = Tensor::<4>::from_data(
        TensorData::new(pixels, [n, 3, size, size]),
        &inference_device(),
    );
    let values = on_compute_threads(|| to_vec(softmax(model.forward(x), 1)));
    let classes = values.len() / n.max(1);
    values.chunks(classes.max(1)).map(|c| c.to_vec()).collect()
}

/// Class indices by falling probability, the first `k`.
fn top_k(p: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Evaluates `model` on the images of `data` at `indices`, `batch_size` at a time, decoding
/// on `threads` threads ahead of the network. Images that cannot be read are left out and
/// handed to `unreadable`; `progress` hears (images done, images in all) after each batch.
pub fn evaluate(
    model: &Model,
    data: &Arc<Samples>,
    indices: &[usize],
    batch_size: usize,
    threads: usize,
    unreadable: &mut dyn FnMut(&Path, &str),
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Confusion> {
    let mut done = 0;
    let mut confusion = Confusion::new(data.classes.clone());
    let plan: Vec<Vec<usize>> = indices
        .chunks(batch_size.max(1))
        .map(<[usize]>::to_vec)
        .collect();
    let mut loader = Loader::start(
        Arc::clone(data),
        plan,
        LoaderOptions {
            threads,
            prefetch: 2,
            augment: Augment::None,
            seed: 0,
            epoch: 0,
        },
    )
    .map_err(|e| TrainError::Config(format!("cannot start the data loader: {e}")))?;
    while let Some(batch) = loader.next_batch() {
        for (path, problem) in &batch.unreadable {
            unreadable(path, problem);
        }
        done += batch.labels.len() + batch.unreadable.len();
        progress(done, indices.len());
        if batch.labels.is_empty() {
            continue;
        }
        let probs = classify(model, batch.pixels, batch.labels.len(), data.image_size);
        for (p, &label) in probs.iter().zip(&batch.labels) {
            let best = top_k(p, 5);
            let label = label as usize;
            let n = confusion.classes();
            confusion.counts[label * n + best[0]] += 1;
            if best.contains(&label) {
                confusion.top5 += 1;
            }
        }
    }
    Ok(confusion)
}

/// One image's prediction: the most probable classes (up to five) with their probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub top: Vec<(String, f32)>,
}

/// Classifies PNG or JPEG images of any size, prepared as the model's evaluation images are
/// (shorter side resized to its image size, centre crop, its normalisation).
pub fn predict(loaded: &Loaded, images: &[&Path]) -> Result<Vec<Prediction>> {
    let size = loaded.info.image_size;
    let floats = 3 * size * size;
    let mut pixels = vec![0.0; images.len() * floats];
    for (path, out) in images.iter().zip(pixels.chunks_mut(floats)) {
        let base =
            crate::data::folder::decode(path, size).map_err(|problem| TrainError::BadData {
                path: path.to_path_buf(),
                problem,
            })?;
        augment::apply(
            &base,
            size,
            Augment::None,
            0,
            loaded.info.normalisation,
            out,
        );
    }
    Ok(classify(&loaded.model, pixels, images.len(), size)
        .into_iter()
        .map(|probs| Prediction {
            top: top_k(&probs, 5)
                .into_iter()
                .map(|c| {
                    let name = loaded
                        .info
                        .classes
                        .get(c)
                        .cloned()
                        .unwrap_or_else(|| format!("class {c}"));
                    (name, probs[c])
                })
                .collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("c{i}")).collect()
    }

    #[test]
    fn report_has_the_seed_format() {
        let mut c = Confusion::new(
            crate::data::cifar::CLASS_NAMES
                .iter()
                .map(|s| s.to_string())
                .collect(),
        );
        c.counts[0] = 3;
        c.counts[1] = 1;
        c.counts[10 + 1] = 4;
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
        assert!(
            report.contains("Accuracy for class: truck is n/a"),
            "{report}"
        );
        assert!(
            report.contains("Top-5 accuracy"),
            "ten classes have a top-5: {report}"
        );
        assert_eq!(Confusion::from_f32(c.classes.clone(), &c.to_f32()), c);
    }

    /// With many classes the report lists the best and the worst ten, and top-5.
    #[test]
    fn many_classes_show_the_best_and_worst_ten() {
        let n = 30;
        let mut c = Confusion::new(names(n));
        // Class k: k right of 29.
        for k in 0..n {
            c.counts[k * n + k] = k as u64;
            c.counts[k * n + (k + 1) % n] = (n - 1 - k) as u64;
        }
        c.top5 = 500;
        let report = c.report();
        let lines: Vec<&str> = report.lines().collect();
        assert!(report.contains("Top-5 accuracy: "), "{report}");
        let best = lines.iter().position(|l| *l == "Best 10 classes:").unwrap();
        let worst = lines
            .iter()
            .position(|l| *l == "Worst 10 classes:")
            .unwrap();
        assert!(lines[best + 1].contains("class: c29 "), "{report}");
        assert!(lines[worst + 1].contains("class: c0 "), "{report}");
        assert_eq!(worst - best, 11, "{report}");
        assert!(
            !report.contains("class: c15 "),
            "middle classes left out: {report}"
        );
    }

    #[test]
    fn top_k_orders_by_probability_then_index() {
        assert_eq!(top_k(&[0.1, 0.5, 0.1, 0.3], 3), [1, 3, 0]);
        assert_eq!(top_k(&[0.2, 0.8], 5), [1, 0]);
    }
}
