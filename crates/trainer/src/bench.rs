//! Measurements behind `trainctl bench` that need the framework: one training step of the seed
//! CNN or a ResNet, split into its parts, and the data loader alone. The kernels' and the
//! collective's own benchmarks live in their crates (`kernels::bench`, `collective::bench`).

use std::time::Instant;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor, TensorData};
use kernels::sgd::Sgd;

use crate::data::synthetic;
use crate::device::{on_compute_threads, set_cpu_threads, training_device};
use crate::model::{
    Architecture, Model, Net, ParamGradients, StepGradients, buffers, load, sgd_step, snapshot,
    to_vec,
};

/// Classes of a timed network: CIFAR-10's for the seed, tiny-imagenet's 200 for a ResNet.
pub(crate) fn bench_classes(arch: Architecture) -> usize {
    match arch {
        Architecture::SeedCnn => 10,
        Architecture::ResNet(_) => 200,
    }
}

/// Median seconds of each part of a training step.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepTimes {
    pub model: &'static str,
    pub image_size: usize,
    pub threads: usize,
    pub batch_size: usize,
    pub steps: usize,
    /// Untimed steps before the timed ones (see [`WARMUP_STEPS`]).
    pub warmup_steps: usize,
    /// The convolutions' arithmetic (`crate::device::set_precision`): fp32 or bf16.
    pub precision: &'static str,
    pub step_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    pub gradients_out_s: f64,
    pub update_s: f64,
    pub images_per_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Untimed steps `trainctl bench` runs before it times any (bench/pytorch_step.py runs as many
/// for PyTorch). A process's memory grows through its first steps: trainctl's allocator
/// (mimalloc) places each step's large buffers first-fit in its arena, and until their places
/// settle some land on memory never touched before, which the kernel must zero (resnet18 at
/// batch 32: 17 new 2 MiB pages in step 1, 7 in step 4, 5 in step 5, none after; resnet50 at 2
/// threads 42, 3, 3 and 9 in steps 1 to 5). On this project's virtual machines a new page
/// sometimes costs 4.5 ms, and with one warm-up step a median of 5 timed steps could be one of
/// those steps: a process's figure came out 10–25 % slow at random. A long run pays this once.
pub const WARMUP_STEPS: usize = 5;

/// Times `steps` training steps (after `warmup` untimed ones) of `model` on `image_size`² images
/// with `threads` CPU threads: the same work as a step of a lone `trainctl train` worker (the
/// gradients never copied into an all-reduce buffer: see `model::StepGradients`).
///
/// # Panics
/// The seed CNN at any size but 32 (its classifier is sized for 32×32 inputs).
pub fn training_step(
    model: Architecture,
    image_size: usize,
    threads: usize,
    batch_size: usize,
    steps: usize,
    warmup: usize,
) -> StepTimes {
    timed_training(
        model,
        image_size,
        threads,
        batch_size,
        (steps, warmup),
        false,
    )
}

/// One operation of trainctl's at one shape in a training step: what `trainctl bench --layers`
/// prints for a ResNet, one per line; the operation `other` is the rest of the step (burn's
/// own operations: ReLU, residual additions, pooling, the classifier, the loss, and its sums of
/// a tensor's gradients when the tensor is used twice; the gradients' way out and the update).
/// An operation's backward is timed up to the gradients it hands to burn, not burn's sums.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpRow {
    pub model: &'static str,
    pub threads: usize,
    pub op: String,
    /// A convolution's shape.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conv: Option<kernels::conv::ConvShape>,
    pub calls_per_step: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// Of a training step's time.
    pub step_share: f64,
    /// The direct algorithm's arithmetic (forward, and twice that backward) over the time:
    /// comparable across algorithms, so Winograd can beat the machine's peak.
    pub gflops_per_s: Option<f64>,
    /// The arithmetic the layer's algorithm executes (Winograd's products, the direct kernel's
    /// taps inside the image; forward and twice that backward) over the time: against the
    /// peak (`trainctl bench --gemm`), how near it the layer runs, transforms and all.
    pub executed_gflops_per_s: Option<f64>,
}

/// One phase inside a kernel at one shape in a training step (`kernels::phases`): what
/// `trainctl bench --layers` prints after the operations, one per line, by operation and in
/// the order of their names. Where an operation's rate falls short of the peak, which of its
/// passes (a Winograd layer's transforms, its products, its weight's transform) takes the time.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PhaseRow {
    pub model: &'static str,
    pub threads: usize,
    /// `conv 3x3/1 256->256 at 4x4 (winograd): input transform`.
    pub phase: String,
    pub calls_per_step: f64,
    pub ms_per_step: f64,
    /// Of a training step's time.
    pub step_share: f64,
}

/// Times `steps` training steps as [`training_step`] does, each of trainctl's operations apart:
/// the step's times, one row per operation and shape, the slowest first, and one row per
/// phase inside the kernels.
pub fn layer_profile(
    model: Architecture,
    image_size: usize,
    threads: usize,
    batch_size: usize,
    steps: usize,
    warmup: usize,
) -> (StepTimes, Vec<OpRow>, Vec<PhaseRow>) {
    let times = timed_training(
        model,
        image_size,
        threads,
        batch_size,
        (steps, warmup),
        true,
    );
    let recorded = crate::ops::profile::finish();
    let per_step = |seconds: f64| seconds / steps.max(1) as f64;
    let step_s = times.step_s;
    let phases = kernels::phases::finish()
        .into_iter()
        .map(|(phase, t)| PhaseRow {
            model: times.model,
            threads,
            phase,
            calls_per_step: t.calls as f64 / steps.max(1) as f64,
            ms_per_step: per_step(t.seconds) * 1e3,
            step_share: per_step(t.seconds) / step_s,
        })
        .collect();
    let mut rows: Vec<OpRow> = recorded
        .into_iter()
        .map(|(op, t)| {
            let (forward, backward) = (per_step(t.forward_s), per_step(t.backward_s));
            let calls = t.calls as f64 / steps.max(1) as f64;
            let rate = |flops: f64| {
                (flops > 0.0).then(|| 3.0 * flops * calls / (forward + backward) / 1e9)
            };
            OpRow {
                model: times.model,
                threads,
                op,
                conv: t.conv,
                calls_per_step: calls,
                forward_ms: forward * 1e3,
                backward_ms: backward * 1e3,
                step_share: (forward + backward) / step_s,
                gflops_per_s: rate(t.forward_flops.nominal),
                executed_gflops_per_s: rate(t.forward_flops.executed),
            }
        })
        .collect();
    let ours: f64 = rows
        .iter()
        .map(|r| (r.forward_ms + r.backward_ms) / 1e3)
        .sum();
    rows.sort_by(|a, b| b.step_share.total_cmp(&a.step_share));
    rows.push(OpRow {
        model: times.model,
        threads,
        op: "other".into(),
        conv: None,
        calls_per_step: 1.0,
        forward_ms: (times.forward_s * 1e3 - rows.iter().map(|r| r.forward_ms).sum::<f64>()),
        backward_ms: (step_s - times.forward_s) * 1e3
            - rows.iter().map(|r| r.backward_ms).sum::<f64>(),
        step_share: (step_s - ours) / step_s,
        gflops_per_s: None,
        executed_gflops_per_s: None,
    });
    (times, rows, phases)
}

fn timed_training(
    model: Architecture,
    image_size: usize,
    threads: usize,
    batch_size: usize,
    (steps, warmup): (usize, usize),
    profile: bool,
) -> StepTimes {
    set_cpu_threads(threads);
    let device = training_device();
    let (pixels, labels) = if image_size == 32 {
        let data = synthetic::cifar(batch_size, 3);
        let indices: Vec<usize> = (0..batch_size).collect();
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        data.fill_batch(&indices, &mut pixels, &mut labels);
        (pixels, labels)
    } else {
        let n = batch_size * 3 * image_size * image_size;
        let pixels = (0..n)
            .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
            .collect();
        let classes = bench_classes(model) as i64;
        (
            pixels,
            (0..batch_size as i64).map(|i| i % classes).collect(),
        )
    };
    if model == Architecture::SeedCnn {
        assert_eq!(image_size, 32, "the seed CNN takes 32×32 images");
    }
    let mut times = time_steps(
        Model::new(model, bench_classes(model), &device),
        (&pixels, &labels, image_size),
        batch_size,
        (steps, warmup),
        profile,
    );
    times.model = model.name();
    times.threads = threads;
    times.precision = crate::device::precision().name();
    times
}

fn time_steps(
    mut model: Model,
    (pixels, labels, image_size): (&[f32], &[i64], usize),
    batch_size: usize,
    (steps, warmup): (usize, usize),
    profile: bool,
) -> StepTimes {
    let device = training_device();
    let mut momentum = vec![0.0; snapshot(&model).params.len()];
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut parts: [Vec<f64>; 5] = Default::default();
    for i in 0..warmup + steps {
        if profile && i == warmup {
            // After the warm-up steps.
            crate::ops::profile::start();
            kernels::phases::start();
        }
        let t0 = Instant::now();
        // As the trainer's step runs them (`train::step`).
        let (loss_value, t1, t2, taken) = on_compute_threads(|| {
            let x = Tensor::<4>::from_data(
                TensorData::new(pixels.to_vec(), [batch_size, 3, image_size, image_size]),
                &device,
            );
            let y = Tensor::<1, Int>::from_data(
                TensorData::new(labels.to_vec(), [batch_size]),
                &device,
            );
            let loss = loss_fn.forward(model.forward(x), y);
            let loss_value = to_vec(loss.clone())[0];
            let t1 = Instant::now();
            let mut grads = loss.backward();
            crate::ops::parts::assert_none_parked();
            let t2 = Instant::now();
            // As one rank alone takes them (`train::step`): no flat buffer to sum.
            let taken = ParamGradients::take(&model, &mut grads);
            model.settle();
            (loss_value, t1, t2, taken)
        });
        let t3 = Instant::now();
        // The trainer's update with bench/pytorch_step.py's hyper-parameters.
        let sgd = Sgd {
            learning_rate: 1e-3,
            momentum: 0.9,
            weight_decay: 1e-4,
            first: i == 0,
            grad_scale: 1.0,
        };
        // On the compute pool, as `train::step` runs it.
        model = on_compute_threads(|| {
            let model = sgd_step(model, &mut momentum, StepGradients::Parts(&taken), sgd);
            // Freed before the next step, as `train::step` frees them.
            drop(taken);
            let bufs = buffers(&model);
            load(model, None, &bufs)
        });
        let t4 = Instant::now();
        assert!(loss_value.is_finite());
        if i >= warmup {
            for (slot, d) in parts
                .iter_mut()
                .zip([t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3])
            {
                slot.push(d.as_secs_f64());
            }
        }
    }
    let [step, forward, backward, out, update] = parts.map(median);
    StepTimes {
        model: "",
        image_size,
        threads: 0,
        precision: "",
        batch_size,
        steps,
        warmup_steps: warmup,
        step_s: step,
        forward_s: forward,
        backward_s: backward,
        gradients_out_s: out,
        update_s: update,
        images_per_s: batch_size as f64 / step,
    }
}

/// Images per second the data loader prepares (decode, resize, augment, normalise), alone.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoaderTimes {
    pub data: String,
    pub image_size: usize,
    pub augment: &'static str,
    pub threads: usize,
    pub batch_size: usize,
    pub images: usize,
    /// Every image decoded from its file (the first epoch, or no room in the cache).
    pub decoded_images_per_s: f64,
    /// Every image from the in-memory cache (later epochs).
    pub cached_images_per_s: f64,
}

/// Runs the loader over `batches` batches of the training split of the data set in `dir`
/// with `threads` decoding threads: once decoding every image, once from the cache.
pub fn loader(
    dir: &std::path::Path,
    image_size: usize,
    augment: crate::data::Augment,
    threads: usize,
    batch_size: usize,
    batches: usize,
) -> crate::Result<LoaderTimes> {
    use crate::data::loader::{Loader, LoaderOptions};
    use crate::data::{Layout, Split};
    use std::sync::Arc;
    let layout = Layout::locate(dir).ok_or_else(|| crate::TrainError::BadData {
        path: dir.to_path_buf(),
        problem: "no data set here".into(),
    })?;
    let data = Arc::new(layout.open(Split::Train, image_size, u64::MAX)?);
    let images = (batches * batch_size).min(data.len());
    let plan: Vec<Vec<usize>> = (0..images)
        .collect::<Vec<_>>()
        .chunks(batch_size)
        .map(<[usize]>::to_vec)
        .collect();
    let pass = |epoch| -> crate::Result<f64> {
        let start = Instant::now();
        let mut loader = Loader::start(
            Arc::clone(&data),
            plan.clone(),
            LoaderOptions {
                threads,
                prefetch: 4,
                augment,
                seed: 0,
                epoch,
            },
        )
        .map_err(|e| crate::TrainError::Config(e.to_string()))?;
        let mut n = 0;
        while let Some(batch) = loader.next_batch() {
            n += batch.labels.len();
        }
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let decoded = pass(0)?;
    let cached = pass(1)?;
    Ok(LoaderTimes {
        data: crate::data::describe(&layout),
        image_size,
        augment: augment.name(),
        threads,
        batch_size,
        images,
        decoded_images_per_s: decoded,
        cached_images_per_s: cached,
    })
}
