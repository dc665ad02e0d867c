//! Data-parallel training: every rank runs the same model on its shard of each batch,
//! gradients are averaged with the ring all-reduce, and every rank applies the same update.
//!
//! Invariant: after every step all ranks hold bit-identical parameters and BatchNorm buffers
//! (same start from rank 0's broadcast, same averaged gradients, same arithmetic, buffers
//! re-broadcast from rank 0 as PyTorch DDP does).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor, TensorData};
use collective::{ProcessGroup, World};

use crate::checkpoint::{ModelInfo, save_model};
use crate::cifar::{DataProgress, DownloadOptions};
use crate::data::loader::{Batch, Loader, LoaderOptions};
use crate::data::{self, Augment, Dataset, Split, Unreadable};
use crate::device::{set_cpu_threads, training_device};
use crate::error::{Result, TrainError};
use crate::eval::{Confusion, evaluate, inference_model};
use crate::model::{Architecture, Model, buffers, gradients, load, snapshot, to_vec};
use crate::record::Recorder;
use crate::sampler::Shard;

mod state;

use state::TrainState;

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub model: Architecture,
    pub data: PathBuf,
    /// Downloaded into `data` when it holds no data set.
    pub dataset: Dataset,
    pub download: DownloadOptions,
    /// Side of the square images; `None`: the data set's default (CIFAR 32, folders 64).
    pub image_size: Option<usize>,
    /// Training augmentation; `None`: the data set's default ([`data::Layout::default_augment`]).
    pub augment: Option<Augment>,
    /// Threads decoding images, and batches prepared ahead of the step.
    pub loader_threads: usize,
    pub prefetch: usize,
    /// Decoded training images kept in memory, in bytes.
    pub cache_bytes: u64,
    pub epochs: usize,
    pub batch_size: usize,
    pub learning_rate: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub print_freq: usize,
    pub model_file: PathBuf,
    pub checkpoint_file: PathBuf,
    /// Also checkpoint every this many steps (besides every epoch end).
    pub checkpoint_every: Option<u64>,
    pub seed: u64,
    pub threads: usize,
    /// Evaluate on the test set after training.
    pub evaluate: bool,
    /// Where the metrics files (`metrics/`) and TensorBoard events (`tensorboard/`) go.
    pub run_dir: PathBuf,
    /// Set (by a SIGTERM handler) to stop after the step in progress: every rank learns it in
    /// that step's all-reduce, rank 0 checkpoints, and all return [`TrainError::Preempted`].
    pub stop: Arc<AtomicBool>,
}

/// What the trainer tells its caller as it goes; only the caller prints.
#[derive(Debug, Clone)]
pub enum Event {
    Resumed {
        epoch: usize,
        position: usize,
        global_step: u64,
        saved_world_size: usize,
    },
    /// Mean loss over the last `print_freq` steps (seed format: `[epoch, iter] loss`).
    Loss {
        epoch: usize,
        iter: usize,
        /// Steps of this epoch at this world size.
        steps: usize,
        loss: f32,
        images_per_sec: f64,
        seconds_per_step: f64,
    },
    /// Every step, on every rank (what the metrics file records).
    Step(Box<telemetry::Step>),
    CheckpointSaved {
        global_step: u64,
        epoch: usize,
        position: usize,
    },
    EpochDone {
        epoch: usize,
        seconds: f64,
    },
    ModelSaved {
        path: PathBuf,
    },
    Evaluated(Box<Confusion>),
    /// Every rank: its step count and a fingerprint of its weights, equal on all ranks.
    Finished {
        global_step: u64,
        samples_seen: u64,
        world_size: usize,
        fingerprint: u32,
    },
    Warning(String),
    /// Downloading or extracting the data set (the node's local rank 0 only).
    Data(DataProgress),
}

/// Trains on the world described by `world`, calling `report` on the way.
pub fn train(cfg: &TrainConfig, world: &World, report: &mut dyn FnMut(Event)) -> Result<()> {
    validate(cfg)?;
    let _span =
        tracing::info_span!("worker", rank = world.rank, restart = world.restart_count).entered();
    set_cpu_threads(cfg.threads);
    let mut group = ProcessGroup::join(world)?;
    let (rank, world_size) = (group.rank(), group.world_size());

    // One download per node; the others wait at the barrier.
    let ensured = if world.local_rank == 0 {
        data::ensure(&cfg.data, cfg.dataset, &cfg.download, &mut |p| {
            report(Event::Data(p))
        })
        .map(|_| ())
    } else {
        Ok(())
    };
    group.barrier()?;
    ensured?;
    let layout = data::ensure(
        &cfg.data,
        cfg.dataset,
        &DownloadOptions {
            enabled: false,
            ..cfg.download.clone()
        },
        &mut |_| {},
    )?;
    let image_size = cfg
        .image_size
        .unwrap_or_else(|| layout.default_image_size());
    cfg.model
        .check_image_size(image_size)
        .map_err(TrainError::Config)?;
    let augment = cfg.augment.unwrap_or_else(|| layout.default_augment());
    let dataset = Arc::new(layout.open(Split::Train, image_size, cfg.cache_bytes)?);
    if dataset.is_empty() {
        return Err(TrainError::BadData {
            path: layout.dir().to_path_buf(),
            problem: "the training set is empty".into(),
        });
    }
    // Read before training, so that a missing validation set stops the run now, not after it.
    let eval_set = cfg
        .evaluate
        // Evaluated once, at the end: its images are not worth keeping in memory.
        .then(|| layout.open(Split::Eval, image_size, 0))
        .transpose()?
        .map(Arc::new);
    let info = ModelInfo {
        architecture: cfg.model.name().into(),
        classes: dataset.classes.clone(),
        image_size,
        normalisation: dataset.normalisation,
    };

    let device = training_device();
    device.seed(cfg.seed);
    let mut model = Model::new(cfg.model, info.classes.len(), &device);
    let template = snapshot(&model);
    let mut state = TrainState::fresh(cfg, &template, world_size, dataset.len(), info);
    let resumed = if rank == 0 {
        state.resume(cfg, report)?
    } else {
        false
    };

    // Rank 0's state (fresh or resumed) becomes everyone's.
    let mut header = state.header(resumed);
    group.broadcast_bytes(&mut header, 0)?;
    let resumed = state.apply_header(&header);
    group.broadcast(&mut state.params, 0)?;
    group.broadcast(&mut state.buffers, 0)?;
    if resumed {
        group.broadcast(&mut state.momentum, 0)?;
    }
    model = load(model, Some(&state.params), &state.buffers);

    let mut recorder = Recorder::open(&cfg.run_dir, world, report);
    recorder.start(
        telemetry::metrics::Start {
            v: telemetry::metrics::SCHEMA_VERSION,
            time: telemetry::unix_time(),
            rank: rank as u32,
            world_size: world_size as u32,
            restart: world.restart_count,
            step: state.progress.global_step,
            resumed,
            config: run_config(cfg, world, image_size),
        },
        world_size,
        report,
    );

    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut unreadable = Unreadable::default();
    // The gradients, then the loss, the accuracy and the stop flag, all-reduced together.
    let mut grads_flat = Vec::with_capacity(state.params.len() + 3);
    let mut last_checkpoint_step = state.progress.global_step;
    while state.progress.epoch < cfg.epochs {
        let epoch = state.progress.epoch;
        let _epoch_span = tracing::info_span!("epoch", epoch = epoch + 1).entered();
        let epoch_start = Instant::now();
        let shard = Shard::new(
            dataset.len(),
            cfg.seed,
            epoch,
            state.progress.position,
            world_size,
            rank,
            cfg.batch_size,
        );
        // Steps of this epoch already taken before the shard started (for the seed's counter).
        let steps_before = state
            .progress
            .position
            .div_ceil(cfg.batch_size * world_size);
        let (mut running_loss, mut window, mut window_start, mut window_images) =
            (0.0f64, 0usize, Instant::now(), 0usize);
        let steps_in_epoch = steps_before + shard.steps();
        let plan = (0..shard.steps())
            .map(|s| shard.batch(s).to_vec())
            .collect();
        let mut loader = Loader::start(
            Arc::clone(&dataset),
            plan,
            LoaderOptions {
                threads: cfg.loader_threads,
                prefetch: cfg.prefetch,
                augment,
                seed: cfg.seed,
                epoch,
            },
        )
        .map_err(|e| TrainError::Config(format!("cannot start the data loader: {e}")))?;
        for step in 0..shard.steps() {
            let step_start = Instant::now();
            let batch = next_batch(&mut loader, &mut unreadable, report)?;
            let labels = batch.labels;
            let n = labels.len();
            let x = Tensor::<4>::from_data(
                TensorData::new(batch.pixels, [n, 3, image_size, image_size]),
                &device,
            );
            let y = Tensor::<1, Int>::from_data(TensorData::new(labels.clone(), [n]), &device);
            let data_s = step_start.elapsed().as_secs_f64();

            let timer = Instant::now();
            let logits = model.forward(x);
            let loss = loss_fn.forward(logits.clone(), y);
            let grads = loss.backward();
            gradients(&model, &grads, &mut grads_flat);
            grads_flat.push(to_vec(loss)[0]);
            grads_flat.push(batch_accuracy(&to_vec(logits), &labels));
            grads_flat.push(if cfg.stop.load(Ordering::Relaxed) {
                1.0
            } else {
                0.0
            });
            let mut compute_s = timer.elapsed().as_secs_f64();

            let timer = Instant::now();
            group.all_reduce_mean(&mut grads_flat)?;
            let mut allreduce_s = timer.elapsed().as_secs_f64();
            // Some rank was asked to stop: all finish this step, then stop together.
            let stopping = grads_flat.pop().is_some_and(|v| v > 0.0);
            let accuracy = grads_flat.pop().unwrap_or(f32::NAN);
            let mean_loss = grads_flat.pop().unwrap_or(f32::NAN);
            let global_step = state.progress.global_step + 1;
            if !mean_loss.is_finite() {
                return Err(TrainError::NonFiniteLoss {
                    value: mean_loss,
                    epoch: epoch + 1,
                    step: steps_before + step + 1,
                    global_step,
                });
            }
            let timer = Instant::now();
            state.sgd_step(cfg, &grads_flat);
            state.buffers = buffers(&model);
            compute_s += timer.elapsed().as_secs_f64();
            let timer = Instant::now();
            group.broadcast(&mut state.buffers, 0)?;
            allreduce_s += timer.elapsed().as_secs_f64();
            let timer = Instant::now();
            model = load(model, Some(&state.params), &state.buffers);
            compute_s += timer.elapsed().as_secs_f64();
            state.progress.global_step = global_step;
            state.progress.position = shard.position_after(step + 1);
            let images = shard.position_after(step + 1) - shard.position_after(step);
            state.progress.samples_seen += images as u64;

            let iter = steps_before + step + 1;
            let step_s = step_start.elapsed().as_secs_f64();
            let record = telemetry::Step {
                time: telemetry::unix_time(),
                rank: rank as u32,
                world_size: world_size as u32,
                restart: world.restart_count,
                epoch: epoch + 1,
                step: global_step,
                iter,
                steps_in_epoch,
                loss: mean_loss,
                accuracy,
                lr: cfg.learning_rate,
                images,
                images_per_sec: images as f64 / step_s,
                step_s,
                data_s,
                compute_s,
                allreduce_s,
            };
            recorder.step(&record, report);
            report(Event::Step(Box::new(record)));

            running_loss += mean_loss as f64;
            window += 1;
            window_images += images;
            if rank == 0 && cfg.print_freq > 0 && iter.is_multiple_of(cfg.print_freq) {
                let seconds = window_start.elapsed().as_secs_f64();
                report(Event::Loss {
                    epoch: epoch + 1,
                    iter,
                    steps: steps_in_epoch,
                    loss: (running_loss / window as f64) as f32,
                    images_per_sec: window_images as f64 / seconds,
                    seconds_per_step: seconds / window as f64,
                });
                (running_loss, window, window_start, window_images) = (0.0, 0, Instant::now(), 0);
            }
            if stopping {
                state.checkpoint(cfg, &template, rank, &mut recorder, report)?;
                // Nobody leaves before rank 0's checkpoint is on disk.
                group.barrier()?;
                return Err(TrainError::Preempted {
                    global_step,
                    epoch: epoch + 1,
                });
            }
            let due = cfg
                .checkpoint_every
                .is_some_and(|n| n > 0 && global_step - last_checkpoint_step >= n);
            if due && step + 1 < shard.steps() {
                state.checkpoint(cfg, &template, rank, &mut recorder, report)?;
                last_checkpoint_step = global_step;
            }
        }
        state.progress.epoch += 1;
        state.progress.position = 0;
        state.checkpoint(cfg, &template, rank, &mut recorder, report)?;
        last_checkpoint_step = state.progress.global_step;
        let seconds = epoch_start.elapsed().as_secs_f64();
        recorder.epoch(epoch + 1, state.progress.global_step, seconds, report);
        if rank == 0 {
            report(Event::EpochDone {
                epoch: epoch + 1,
                seconds,
            });
        }
    }

    if unreadable.count() > 0 {
        report(Event::Warning(format!(
            "rank {rank}: {} unreadable images were skipped (each named above)",
            unreadable.count()
        )));
    }
    if rank == 0 {
        save_model(
            &cfg.model_file,
            &state.snapshot(&template),
            state.progress.global_step,
            &state.info,
        )?;
        report(Event::ModelSaved {
            path: cfg.model_file.clone(),
        });
    }
    if let Some(test) = &eval_set {
        let mine: Vec<usize> = (rank..test.len()).step_by(world_size).collect();
        let model = inference_model(
            cfg.model,
            state.info.classes.len(),
            &state.params,
            &state.buffers,
        );
        let mut counts = evaluate(
            &model,
            test,
            &mine,
            (2 * cfg.batch_size).min(500),
            cfg.loader_threads,
            &mut |path, problem| {
                report(Event::Warning(format!(
                    "{}: {problem}; left out of the evaluation",
                    path.display()
                )))
            },
            &mut |_, _| {},
        )?
        .to_f32();
        group.all_reduce_sum(&mut counts)?;
        if rank == 0 {
            let confusion = Confusion::from_f32(state.info.classes.clone(), &counts);
            recorder.eval(state.progress.global_step, &confusion, report);
            report(Event::Evaluated(Box::new(confusion)));
        }
    }
    group.barrier()?;
    report(Event::Finished {
        global_step: state.progress.global_step,
        samples_seen: state.progress.samples_seen,
        world_size,
        fingerprint: state.fingerprint(),
    });
    Ok(())
}

/// The loader's next batch, its unreadable images reported (each path once per run). A batch
/// with no readable image at all is an error: there is nothing to train the step on.
fn next_batch(
    loader: &mut Loader,
    unreadable: &mut Unreadable,
    report: &mut dyn FnMut(Event),
) -> Result<Batch> {
    let batch = loader
        .next_batch()
        .ok_or_else(|| TrainError::Config("the data loader ended before the epoch did".into()))?;
    for (path, problem) in &batch.unreadable {
        if unreadable.first(path) {
            report(Event::Warning(format!(
                "{}: {problem}; skipped (left out of every batch it falls in)",
                path.display()
            )));
        }
    }
    if batch.labels.is_empty() {
        return Err(TrainError::BadData {
            path: batch
                .unreadable
                .first()
                .map(|u| u.0.clone())
                .unwrap_or_default(),
            problem: format!(
                "every image of a batch ({} of them) is unreadable: fix or remove them",
                batch.unreadable.len()
            ),
        });
    }
    Ok(batch)
}

/// Fraction of `labels` the `logits` (rows of classes) get right.
fn batch_accuracy(logits: &[f32], labels: &[i64]) -> f32 {
    let classes = logits.len() / labels.len().max(1);
    if classes == 0 {
        return 0.0;
    }
    let correct = logits
        .chunks(classes)
        .zip(labels)
        .filter(|(row, label)| {
            let best = row
                .iter()
                .enumerate()
                .fold(0, |best, (i, v)| if *v > row[best] { i } else { best });
            best as i64 == **label
        })
        .count();
    correct as f32 / labels.len() as f32
}

fn run_config(cfg: &TrainConfig, world: &World, image_size: usize) -> telemetry::RunConfig {
    telemetry::RunConfig {
        run_id: world.run_id.clone(),
        epochs: cfg.epochs,
        batch_size: cfg.batch_size,
        learning_rate: cfg.learning_rate,
        momentum: cfg.momentum,
        weight_decay: cfg.weight_decay,
        seed: cfg.seed,
        threads: cfg.threads,
        checkpoint_every: cfg.checkpoint_every,
        data: cfg.data.display().to_string(),
        backend: crate::device::BACKEND.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        model: cfg.model.name().into(),
        image_size,
    }
}

fn validate(cfg: &TrainConfig) -> Result<()> {
    let positive = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(TrainError::Config(format!(
                "{name} must be a positive number, got {v}"
            )))
        }
    };
    if cfg.batch_size == 0 {
        return Err(TrainError::Config(
            "--batch-size must be at least 1, got 0".into(),
        ));
    }
    positive("--learning-rate", cfg.learning_rate)?;
    if !(0.0..1.0).contains(&cfg.momentum) {
        return Err(TrainError::Config(format!(
            "--momentum must be in [0, 1), got {}",
            cfg.momentum
        )));
    }
    if !(cfg.weight_decay.is_finite() && cfg.weight_decay >= 0.0) {
        return Err(TrainError::Config(format!(
            "--weight-decay must be zero or positive, got {}",
            cfg.weight_decay
        )));
    }
    Ok(())
}
