//! What a run is asked to do, checked before anything starts.

use super::stragglers::StragglerConfig;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use collective::World;

use crate::data::{Augment, DatasetName, DownloadOptions};
use crate::error::{Result, TrainError};
use crate::model::Architecture;

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub model: Architecture,
    pub data: PathBuf,
    /// Downloaded into `data` when it holds no data set.
    pub dataset: DatasetName,
    pub download: DownloadOptions,
    /// Side of the square images; `None`: the data set's default (CIFAR 32, folders 64).
    pub image_size: Option<usize>,
    /// Training augmentation; `None`: the data set's default ([`crate::data::Layout::default_augment`]).
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
    /// When the checkpoint holds a finished run, train again from scratch (replacing it)
    /// instead of refusing.
    pub train_again: bool,
    /// Set (by a SIGTERM handler) to stop after the step in progress: every rank learns it in
    /// that step's all-reduce, rank 0 checkpoints, and all return [`TrainError::Preempted`].
    pub stop: Arc<AtomicBool>,
    /// How a slow node is found (`None`: not looked for).
    pub stragglers: Option<StragglerConfig>,
    /// The convolutions' arithmetic ([`crate::device::set_precision`]).
    pub precision: kernels::Precision,
}

pub(super) fn run_config(
    cfg: &TrainConfig,
    world: &World,
    image_size: usize,
) -> telemetry::RunConfig {
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
        precision: cfg.precision.name().into(),
    }
}

pub(super) fn validate(cfg: &TrainConfig) -> Result<()> {
    check_sgd(
        cfg.batch_size,
        cfg.learning_rate,
        cfg.momentum,
        cfg.weight_decay,
    )?;
    if let Some(s) = cfg.stragglers {
        check_stragglers(s.factor, s.window)?;
    }
    crate::device::check_precision(cfg.precision, kernels::available(cfg.precision))
        .map_err(TrainError::Config)?;
    Ok(())
}

/// The straggler watch's settings in range (`--straggler-factor`, `--straggler-window`).
pub fn check_stragglers(factor: f64, window: usize) -> Result<()> {
    if !(factor.is_finite() && factor > 1.0) {
        return Err(TrainError::Config(format!(
            "--straggler-factor {factor}: must be above 1 (1.5: a node 50 % slower than the others)"
        )));
    }
    if window > 10_000 {
        return Err(TrainError::Config(format!(
            "--straggler-window {window}: at most 10000 steps (0: do not look for stragglers)"
        )));
    }
    Ok(())
}

/// The step's settings every run needs in range: checked by the worker, and by `trainctl
/// run` on a `train` command line before it starts any worker.
pub fn check_sgd(
    batch_size: usize,
    learning_rate: f64,
    momentum: f64,
    weight_decay: f64,
) -> Result<()> {
    let bad = |what: String| Err(TrainError::Config(what));
    if batch_size == 0 {
        return bad("--batch-size 0: must be at least 1".into());
    }
    if !(learning_rate.is_finite() && learning_rate > 0.0) {
        return bad(format!(
            "--learning-rate {learning_rate}: must be a positive number (e.g. 0.001)"
        ));
    }
    if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
        return bad(format!(
            "--momentum {momentum}: must be at least 0 and below 1 (0.9 is usual)"
        ));
    }
    if !(weight_decay.is_finite() && weight_decay >= 0.0) {
        return bad(format!(
            "--weight-decay {weight_decay}: must be 0 or a positive number (e.g. 0.0001)"
        ));
    }
    Ok(())
}
