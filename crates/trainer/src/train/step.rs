//! One data-parallel training step: batch → forward → backward → all-reduce → SGD → buffers.

use std::time::Instant;

use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use collective::ProcessGroup;
use collective::regroup::{Agreed, Raised};

use super::TrainConfig;
use super::state::TrainState;
use super::stragglers::{self, RankTimes};
use crate::device::on_compute_threads;
use crate::error::Result;
use crate::model::{Model, Net, ParamGradients, StepGradients, buffers, load, to_vec};

/// The model being trained and what a step needs beside it.
pub(super) struct Step {
    /// `None` only inside [`Step::run`] (burn's `load` takes the model by value).
    model: Option<Model>,
    loss_fn: CrossEntropyLoss,
    device: Device,
    image_size: usize,
    /// The gradients (with more than one rank), then the loss, the accuracy, every rank's
    /// times, the samples' digest and the flags, all-reduced together.
    reduced: Vec<f32>,
}

/// One rank's share of a step.
pub(super) struct StepInput<'a> {
    /// `[n, 3, size, size]`.
    pub(super) pixels: Vec<f32>,
    pub(super) labels: &'a [i64],
    /// The [`digest`](crate::sampler::digest) of the samples' ids.
    pub(super) digest: u64,
    /// How many samples of the data set the digest counts (padding and unreadable images
    /// left out).
    pub(super) samples: usize,
    /// How long this rank waited for the batch.
    pub(super) data_s: f64,
    /// This rank's node (its group rank), for the straggler watch.
    pub(super) node: u32,
}

/// What one step did, as every rank agrees.
#[derive(Debug, Clone)]
pub(super) struct StepOutcome {
    /// Mean over the ranks of each rank's mean loss. Not finite: nothing was applied.
    pub(super) loss: f32,
    pub(super) accuracy: f32,
    /// The step's flags over the ranks: what follows it is [`collective::regroup::after_step`]'s.
    pub(super) agreed: Agreed,
    /// The [`digest`](crate::sampler::digest) of the step's samples over all ranks.
    pub(super) digest: u64,
    /// The samples the digest counts, over all ranks.
    pub(super) samples: usize,
    pub(super) compute_s: f64,
    pub(super) allreduce_s: f64,
    /// Every rank's data and compute time at this step, as the all-reduce brought them.
    pub(super) times: Vec<RankTimes>,
}

impl Step {
    /// `model` must hold `state`'s parameters and buffers.
    pub(super) fn new(model: Model, device: &Device, image_size: usize) -> Step {
        Step {
            model: Some(model),
            loss_fn: CrossEntropyLossConfig::new().init(device),
            device: device.clone(),
            image_size,
            reduced: Vec::with_capacity(6 + DIGEST_LIMBS),
        }
    }

    /// Loads `state`'s parameters and buffers into the model (after they came from a peer, or
    /// from a checkpoint).
    pub(super) fn load(&mut self, state: &TrainState) {
        let model = self
            .model
            .take()
            .expect("a step's model is back after every run");
        self.model = Some(load(model, Some(state.params()), &state.buffers));
    }

    /// Brings the parameters the model holds back into `state` (before it is saved or sent).
    pub(super) fn store(&self, state: &mut TrainState) {
        state.take_params(
            self.model
                .as_ref()
                .expect("a step's model is back after every run"),
        );
    }

    /// The forward and backward of this rank's batch on the compute threads: the gradients
    /// flattened into `reduced` to be summed (or, for a rank alone, left where burn put them:
    /// returned), then the loss and accuracy. Returns how many of `reduced` are gradients.
    fn forward_backward(
        &mut self,
        pixels: Vec<f32>,
        labels: &[i64],
        world_size: usize,
    ) -> (usize, Option<ParamGradients>) {
        let model = self
            .model
            .as_ref()
            .expect("a step's model is back after every run");
        let n = labels.len();
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
            crate::ops::parts::assert_none_parked();
            let taken = ParamGradients::take(model, &mut grads);
            // A rank alone sums nothing: the update reads each parameter's gradient where burn
            // left it, and the gradients' buffer goes (it comes back if the world grows).
            let alone = if world_size > 1 {
                taken.flatten_into(reduced);
                None
            } else {
                *reduced = Vec::new();
                Some(taken)
            };
            // On the thread that ran the forward: settling elsewhere misses its update.
            model.settle();
            let gradients_len = reduced.len();
            reduced.push(to_vec(loss)[0]);
            reduced.push(batch_accuracy(&to_vec(logits), labels));
            (gradients_len, alone)
        })
    }

    /// Trains on this rank's `input`: the gradients, loss, accuracy and `raised` flags are averaged
    /// over the ranks (the gradients' sums scaled as the update reads them) and the samples'
    /// digests summed, SGD updates the model's parameters in place (`state`'s flat ones are
    /// then behind: [`Step::store`]), and rank 0's BatchNorm buffers become everyone's. A
    /// non-finite mean loss leaves the weights as they were (the caller stops the run). Every
    /// rank ends the step holding bit-identical parameters and buffers.
    pub(super) fn run(
        &mut self,
        input: StepInput,
        raised: Raised,
        group: &mut ProcessGroup,
        state: &mut TrainState,
        cfg: &TrainConfig,
    ) -> Result<StepOutcome> {
        let StepInput {
            pixels,
            labels,
            digest,
            samples,
            data_s,
            node,
        } = input;
        let timer = Instant::now();
        let world_size = group.world_size();
        let (gradients_len, alone) = self.forward_backward(pixels, labels, world_size);
        let mut compute_s = timer.elapsed().as_secs_f64();
        let rider = Rider {
            data_s,
            compute_s,
            node,
            digest,
            samples,
            raised,
        };
        rider.push(&mut self.reduced, group.rank(), world_size);

        let timer = Instant::now();
        group.all_reduce_sum(&mut self.reduced)?;
        // Means: the values after the gradients are scaled here, the gradients by the update
        // as it reads them (`Sgd::grad_scale`), which spares a pass over all of them.
        let grad_scale = 1.0 / world_size as f32;
        if world_size > 1 {
            for v in &mut self.reduced[gradients_len..] {
                *v *= grad_scale;
            }
        }
        let mut allreduce_s = timer.elapsed().as_secs_f64();
        let Riders {
            times,
            digest,
            samples,
            agreed,
        } = Riders::pop(&mut self.reduced, world_size);
        let accuracy = self.reduced.pop().unwrap_or(f32::NAN);
        let loss = self.reduced.pop().unwrap_or(f32::NAN);
        let outcome = |compute_s, allreduce_s, times| StepOutcome {
            loss,
            accuracy,
            agreed,
            digest,
            samples,
            compute_s,
            allreduce_s,
            times,
        };
        if !loss.is_finite() {
            return Ok(outcome(compute_s, allreduce_s, times));
        }

        // Both collectives before the model or `state` changes: when one fails (a peer lost),
        // they still hold the last step this rank completed, whole, and it can be checkpointed.
        let timer = Instant::now();
        let mut synced = buffers(
            self.model
                .as_ref()
                .expect("a step's model is back after every run"),
        );
        compute_s += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        group.broadcast(&mut synced, 0)?;
        allreduce_s += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        let model = self
            .model
            .take()
            .expect("a step's model is back after every run");
        let grads = match &alone {
            Some(parts) => StepGradients::Parts(parts),
            None => StepGradients::Flat(&self.reduced),
        };
        // On the compute pool, as the forward and backward: from this thread each parameter's
        // update loop would be handed to the pool and waited for.
        let model = on_compute_threads(|| {
            let model = state.sgd_step(model, cfg, grads, grad_scale);
            load(model, None, &synced)
        });
        self.model = Some(model);
        state.buffers = synced;
        compute_s += timer.elapsed().as_secs_f64();
        Ok(outcome(compute_s, allreduce_s, times))
    }
}

/// A digest rides the mean all-reduce as bytes, one per f32: the sum of whole numbers below
/// 256 over fewer than 4,096 ranks is exact in f32, and the mean's rounding, times the world
/// size, stays far below one half, so rounding gives the exact sum back.
const DIGEST_LIMBS: usize = 8;

fn digest_limbs(digest: u64) -> [f32; DIGEST_LIMBS] {
    std::array::from_fn(|i| ((digest >> (8 * i)) & 0xFF) as f32)
}

/// The wrapping sum of the ranks' digests, from the mean of their limbs.
fn digest_sum(mean: &[f32], world_size: usize) -> u64 {
    mean.iter().enumerate().fold(0u64, |acc, (i, &m)| {
        let limb_sum = (m as f64 * world_size as f64).round() as u64;
        acc.wrapping_add(limb_sum.wrapping_shl(8 * i as u32))
    })
}

/// What one rank adds to the step's all-reduce after the gradients, loss and accuracy: its
/// times (in slots of its own, see `stragglers`), the digest and count of its samples, and
/// the flags it raises ([`collective::regroup::raised`]).
struct Rider {
    data_s: f64,
    compute_s: f64,
    node: u32,
    digest: u64,
    samples: usize,
    raised: Raised,
}

impl Rider {
    fn push(&self, reduced: &mut Vec<f32>, rank: usize, world_size: usize) {
        reduced.extend(stragglers::slots(
            rank,
            world_size,
            self.data_s,
            self.compute_s,
            self.node,
        ));
        reduced.extend(digest_limbs(self.digest));
        reduced.push(self.samples as f32);
        let r = self.raised;
        for flag in [r.stop, r.pause, r.leave, r.rank0_leaves] {
            reduced.push(if flag { 1.0 } else { 0.0 });
        }
    }
}

/// Every rank's riders, as the all-reduce (a mean) brought them back.
struct Riders {
    times: Vec<RankTimes>,
    digest: u64,
    samples: usize,
    agreed: Agreed,
}

impl Riders {
    /// Takes the riders off the end of `reduced` (means over `world_size` ranks).
    fn pop(reduced: &mut Vec<f32>, world_size: usize) -> Riders {
        // Means: times the world size, they count the ranks that raised them.
        let count = |v: Option<f32>| (v.unwrap_or(0.0) * world_size as f32).round() as usize;
        let mut flag = || count(reduced.pop()) as u32;
        let (rank0_leaves, leave, pause, stop) = (flag(), flag(), flag(), flag());
        let samples = count(reduced.pop());
        let limbs = reduced.split_off(reduced.len().saturating_sub(DIGEST_LIMBS));
        let digest = digest_sum(&limbs, world_size);
        let slots = reduced.split_off(reduced.len().saturating_sub(stragglers::SLOTS * world_size));
        Riders {
            times: stragglers::unpack(&slots, world_size),
            digest,
            samples,
            agreed: Agreed {
                stop,
                pause,
                leave,
                rank0_leaves,
            },
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the step's all-reduce and scaling (`Step::run`) do to the ranks' limbs: an f32
    /// sum (the ring's order differs, but sums of whole numbers below 2^24 are exact in any
    /// order), then a scale by `1 / world`.
    fn through_the_mean(digests: &[u64]) -> u64 {
        let world = digests.len();
        let mut mean = [0.0f32; DIGEST_LIMBS];
        for d in digests {
            for (m, l) in mean.iter_mut().zip(digest_limbs(*d)) {
                *m += l;
            }
        }
        for m in &mut mean {
            *m *= 1.0 / world as f32;
        }
        digest_sum(&mean, world)
    }

    fn wrapping_sum(digests: &[u64]) -> u64 {
        digests.iter().fold(0u64, |a, d| a.wrapping_add(*d))
    }

    proptest! {
        #[test]
        fn digests_survive_the_mean_all_reduce_exactly(digests in prop::collection::vec(any::<u64>(), 1..65)) {
            prop_assert_eq!(through_the_mean(&digests), wrapping_sum(&digests));
        }
    }

    #[test]
    fn the_largest_limbs_on_the_largest_world_come_back_exactly() {
        for world in [3, 1000, 4095] {
            for d in [u64::MAX, u64::MAX - 1, 0x8080_8080_8080_8080] {
                let digests = vec![d; world];
                assert_eq!(
                    through_the_mean(&digests),
                    wrapping_sum(&digests),
                    "{world} ranks"
                );
            }
        }
    }
}
