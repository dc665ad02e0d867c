//! One data-parallel training step: batch → forward → backward → all-reduce → SGD → buffers.

use std::time::Instant;

use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use collective::ProcessGroup;

use super::TrainConfig;
use super::state::TrainState;
use crate::device::on_compute_threads;
use crate::error::Result;
use crate::model::{Model, Net, buffers, gradients, load, to_vec};

/// The model being trained and what a step needs beside it.
pub(super) struct Step {
    /// `None` only inside [`Step::run`] (burn's `load` takes the model by value).
    model: Option<Model>,
    loss_fn: CrossEntropyLoss,
    device: Device,
    image_size: usize,
    /// The gradients, then the loss, the accuracy and the stop flag, all-reduced together.
    reduced: Vec<f32>,
}

/// What one step did, as every rank agrees.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepOutcome {
    /// Mean over the ranks of each rank's mean loss. Not finite: nothing was applied.
    pub(super) loss: f32,
    pub(super) accuracy: f32,
    /// Some rank was asked to stop: all finish this step, then stop together.
    pub(super) stopping: bool,
    pub(super) compute_s: f64,
    pub(super) allreduce_s: f64,
}

impl Step {
    /// `model` must hold `state`'s parameters and buffers.
    pub(super) fn new(model: Model, device: &Device, image_size: usize, params: usize) -> Step {
        Step {
            model: Some(model),
            loss_fn: CrossEntropyLossConfig::new().init(device),
            device: device.clone(),
            image_size,
            reduced: Vec::with_capacity(params + 3),
        }
    }

    /// Trains on `pixels` (`[n, 3, size, size]`) and `labels`: the gradients, loss, accuracy and
    /// `stop` are averaged over the ranks, SGD updates `state.params`, rank 0's BatchNorm
    /// buffers become everyone's, and the model is loaded with both. A non-finite mean loss
    /// leaves the weights as they were (the caller stops the run). Every rank ends the step
    /// holding bit-identical parameters and buffers.
    pub(super) fn run(
        &mut self,
        pixels: Vec<f32>,
        labels: &[i64],
        stop: bool,
        group: &mut ProcessGroup,
        state: &mut TrainState,
        cfg: &TrainConfig,
    ) -> Result<StepOutcome> {
        let model = self
            .model
            .as_ref()
            .expect("a step's model is back after every run");
        let n = labels.len();
        let timer = Instant::now();
        let (device, image_size, loss_fn) = (&self.device, self.image_size, &self.loss_fn);
        let reduced = &mut self.reduced;
        on_compute_threads(|| {
            let x = Tensor::<4>::from_data(
                TensorData::new(pixels, [n, 3, image_size, image_size]),
                device,
            );
            let y = Tensor::<1, Int>::from_data(TensorData::new(labels.to_vec(), [n]), device);
            let logits = model.forward(x);
            let loss = loss_fn.forward(logits.clone(), y);
            let mut grads = loss.backward();
            gradients(model, &mut grads, reduced);
            // On the thread that ran the forward: settling elsewhere misses its update.
            model.settle();
            reduced.push(to_vec(loss)[0]);
            reduced.push(batch_accuracy(&to_vec(logits), labels));
        });
        self.reduced.push(if stop { 1.0 } else { 0.0 });
        let mut compute_s = timer.elapsed().as_secs_f64();

        let timer = Instant::now();
        group.all_reduce_mean(&mut self.reduced)?;
        let mut allreduce_s = timer.elapsed().as_secs_f64();
        let stopping = self.reduced.pop().is_some_and(|v| v > 0.0);
        let accuracy = self.reduced.pop().unwrap_or(f32::NAN);
        let loss = self.reduced.pop().unwrap_or(f32::NAN);
        let outcome = |compute_s, allreduce_s| StepOutcome {
            loss,
            accuracy,
            stopping,
            compute_s,
            allreduce_s,
        };
        if !loss.is_finite() {
            return Ok(outcome(compute_s, allreduce_s));
        }

        let timer = Instant::now();
        state.sgd_step(cfg, &self.reduced);
        state.buffers = buffers(model);
        compute_s += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        group.broadcast(&mut state.buffers, 0)?;
        allreduce_s += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        let model = self
            .model
            .take()
            .expect("a step's model is back after every run");
        self.model = Some(load(model, Some(&state.params), &state.buffers));
        compute_s += timer.elapsed().as_secs_f64();
        Ok(outcome(compute_s, allreduce_s))
    }
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
