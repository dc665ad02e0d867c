//! One epoch of a [`Run`]: the loop of steps around the protocol's decisions
//! ([`collective::regroup`]): the flags a rank raises, the step, its record, and what follows
//! it (continue, checkpoint, stop, leave, regroup), or a failed collective's consequence.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use collective::regroup::{self as protocol, AfterFailure, AfterStep, Failure};
use collective::{CollectiveError, ProcessGroup};

use super::membership::{Control, Leave};
use super::step::{StepInput, StepOutcome};
use super::{EpochMark, Event, Run, stragglers};
use crate::data::Unreadable;
use crate::data::loader::{Batch, Loader, LoaderOptions};
use crate::error::{Result, TrainError};
use crate::sampler::{self, Shard, digest};

/// Where a step stands: its epoch (from 1), global step, step within the epoch (from 1) of
/// how many, and the images it took over all ranks.
struct Place {
    epoch: usize,
    global_step: u64,
    iter: usize,
    steps_in_epoch: usize,
    images: usize,
}

/// Rank 0's running loss line: the mean loss and speed over the steps since the last line,
/// every `--print-freq` steps.
struct LossWindow {
    loss: f64,
    steps: usize,
    images: usize,
    since: Instant,
}

impl LossWindow {
    fn new() -> LossWindow {
        LossWindow {
            loss: 0.0,
            steps: 0,
            images: 0,
            since: Instant::now(),
        }
    }

    /// Adds a step's loss; says the line when `print_freq` steps of the epoch are done.
    fn add(&mut self, place: &Place, loss: f32, print_freq: usize, report: &mut dyn FnMut(Event)) {
        self.loss += loss as f64;
        self.steps += 1;
        self.images += place.images;
        if print_freq == 0 || !place.iter.is_multiple_of(print_freq) {
            return;
        }
        let seconds = self.since.elapsed().as_secs_f64();
        report(Event::Loss {
            epoch: place.epoch,
            iter: place.iter,
            steps: place.steps_in_epoch,
            loss: (self.loss / self.steps as f64) as f32,
            images_per_sec: self.images as f64 / seconds,
            seconds_per_step: seconds / self.steps as f64,
        });
        *self = LossWindow::new();
    }
}

impl Run<'_> {
    /// The rest of the current epoch (from the position all ranks agree on), then its
    /// checkpoint. Returns [`TrainError::Preempted`] once a stop was asked for and saved, and
    /// why the worker must leave its group when it must (only with a `control` channel: a peer
    /// lost, or the next round handed by the agent), holding the last step it completed. What
    /// follows each step is [`protocol::after_step`]'s; a failed collective,
    /// [`protocol::after_failure`]'s.
    pub(super) fn epoch(
        &mut self,
        group: &mut ProcessGroup,
        mut control: Option<&mut Control>,
        report: &mut dyn FnMut(Event),
    ) -> Result<Option<Leave>> {
        let (cfg, rank) = (self.cfg, self.rank);
        let epoch = self.state.progress.epoch;
        let _epoch_span = tracing::info_span!("epoch", epoch = epoch + 1).entered();
        let mark = self.epoch_mark();
        let shard = Shard::new(
            self.setup.train.len(),
            cfg.seed,
            epoch,
            self.state.progress.position,
            self.world_size,
            rank,
            cfg.batch_size,
        );
        // Steps of this epoch already taken before the shard started (for the seed's counter),
        // at whatever world sizes they were taken.
        let steps_before = self
            .state
            .progress
            .global_step
            .saturating_sub(mark.global_step) as usize;
        let mut loader = self.loader(&shard, epoch)?;
        let mut losses = LossWindow::new();
        for step in 0..shard.steps() {
            let step_start = Instant::now();
            let batch = next_batch(&mut loader, &mut self.unreadable, report)?;
            let data_s = step_start.elapsed().as_secs_f64();
            let raised = self.raised(control.as_deref_mut());
            // The proof counts what was trained: no padding, no unreadable image.
            let trained = sampler::delivered(shard.unpadded_batch(step), &batch.indices);
            let input = StepInput {
                pixels: batch.pixels,
                labels: &batch.labels,
                digest: digest(&trained),
                samples: trained.len(),
                data_s,
                node: self.world.group_rank,
            };
            let outcome = match self.step.run(input, raised, group, &mut self.state, cfg) {
                Ok(outcome) => outcome,
                Err(TrainError::Collective(e)) => {
                    return self.collective_failed(e, control.is_some(), report);
                }
                Err(e) => return Err(e),
            };
            let place = self.advance(&shard, step, steps_before, &outcome)?;
            self.record_step(&place, &outcome, step_start, data_s, report);
            if cfg.stragglers.is_some_and(|s| s.window > 0)
                && let Some(change) = self.watch.step(outcome.times)
            {
                self.straggler(change, place.global_step, control.as_deref_mut(), report);
            }
            if rank == 0 {
                losses.add(&place, outcome.loss, cfg.print_freq, report);
            }
            let due = protocol::checkpoint_due(
                place.global_step,
                cfg.checkpoint_every.unwrap_or(0),
                step + 1 == shard.steps(),
            );
            let me_leaving = control.as_ref().is_some_and(|c| c.leaving());
            match protocol::after_step(outcome.agreed, me_leaving, due) {
                AfterStep::Continue => {}
                AfterStep::Checkpoint => self.checkpoint(report)?,
                AfterStep::Stop { saver } => {
                    if rank as u32 == saver {
                        self.checkpoint(report)?;
                    }
                    // Nobody leaves before the checkpoint is on disk.
                    group.barrier()?;
                    return Err(TrainError::Preempted {
                        global_step: place.global_step,
                        epoch: place.epoch,
                    });
                }
                AfterStep::Leave => return Ok(Some(Leave::Going)),
                AfterStep::Regroup { saver } => {
                    return Ok(Some(Leave::Paused {
                        saver: saver as usize,
                    }));
                }
            }
        }
        self.end_epoch(epoch, mark, report)?;
        Ok(None)
    }

    /// The flags this rank raises at the next step ([`protocol::raised`]), from a stop asked
    /// for and the agent's messages read now.
    fn raised(&self, control: Option<&mut Control>) -> protocol::Raised {
        let stop = self.cfg.stop.load(Ordering::Relaxed);
        let (assigned, leaving) = match control {
            // `leaving` as of the messages `pause_requested` just read.
            Some(c) => (c.pause_requested(), c.leaving()),
            None => (false, false),
        };
        protocol::raised(stop, assigned, leaving, self.rank as u32)
    }

    /// Where the epoch in progress began: kept across regroups; a new epoch, or one resumed
    /// mid-way (from a checkpoint, or a peer's state when joining), whose steps so far are
    /// counted at today's world size.
    fn epoch_mark(&mut self) -> EpochMark {
        let progress = &self.state.progress;
        match self.epoch_mark {
            Some(mark) if mark.epoch == progress.epoch => mark,
            _ => *self.epoch_mark.insert(EpochMark {
                epoch: progress.epoch,
                started: Instant::now(),
                global_step: progress.global_step.saturating_sub(
                    progress
                        .position
                        .div_ceil(self.cfg.batch_size * self.world_size) as u64,
                ),
            }),
        }
    }

    /// The data loader for the rest of `shard`'s epoch.
    fn loader(&self, shard: &Shard, epoch: usize) -> Result<Loader> {
        let plan = (0..shard.steps())
            .map(|s| shard.batch(s).to_vec())
            .collect();
        Loader::start(
            Arc::clone(&self.setup.train),
            plan,
            LoaderOptions {
                threads: self.cfg.loader_threads,
                prefetch: self.cfg.prefetch,
                augment: self.setup.augment,
                seed: self.cfg.seed,
                epoch,
            },
        )
        .map_err(|e| TrainError::Config(format!("cannot start the data loader: {e}")))
    }

    /// A collective of the step failed (`e`): with an agent the step is dropped and the worker
    /// goes on in the next round's group; without, it fails (rank 0 first saving the last step
    /// every rank completed when a peer was lost).
    fn collective_failed(
        &mut self,
        e: CollectiveError,
        agent: bool,
        report: &mut dyn FnMut(Event),
    ) -> Result<Option<Leave>> {
        match protocol::after_failure(Failure::of(&e), agent, self.rank as u32) {
            AfterFailure::Regroup => Ok(Some(Leave::Lost(e.to_string()))),
            AfterFailure::Fail { save } => {
                if save {
                    self.save_before_restart(report);
                }
                Err(TrainError::Collective(e))
            }
        }
    }

    /// The step every rank agreed (`outcome`, step `step` of `shard`, after `steps_before` of
    /// the epoch's) applied to the progress: where it stands, or the non-finite loss's error.
    fn advance(
        &mut self,
        shard: &Shard,
        step: usize,
        steps_before: usize,
        outcome: &StepOutcome,
    ) -> Result<Place> {
        let progress = &mut self.state.progress;
        let place = Place {
            epoch: progress.epoch + 1,
            global_step: progress.global_step + 1,
            iter: steps_before + step + 1,
            steps_in_epoch: steps_before + shard.steps(),
            images: shard.position_after(step + 1) - shard.position_after(step),
        };
        if !outcome.loss.is_finite() {
            return Err(TrainError::NonFiniteLoss {
                value: outcome.loss,
                epoch: place.epoch,
                step: place.iter,
                global_step: place.global_step,
            });
        }
        progress.global_step = place.global_step;
        progress.position = shard.position_after(step + 1);
        progress.samples_seen += outcome.samples as u64;
        progress.epoch_digest = progress.epoch_digest.wrapping_add(outcome.digest);
        Ok(place)
    }

    /// The step's record: in the metrics file and to the caller.
    fn record_step(
        &mut self,
        place: &Place,
        outcome: &StepOutcome,
        started: Instant,
        data_s: f64,
        report: &mut dyn FnMut(Event),
    ) {
        let step_s = started.elapsed().as_secs_f64();
        let record = telemetry::Step {
            time: telemetry::unix_time(),
            rank: self.rank as u32,
            world_size: self.world_size as u32,
            restart: self.world.restart_count,
            epoch: place.epoch,
            step: place.global_step,
            iter: place.iter,
            steps_in_epoch: place.steps_in_epoch,
            loss: outcome.loss,
            accuracy: outcome.accuracy,
            lr: self.cfg.learning_rate,
            images: place.images,
            images_per_sec: place.images as f64 / step_s,
            step_s,
            data_s,
            compute_s: outcome.compute_s,
            allreduce_s: outcome.allreduce_s,
            slowdown: stragglers::relative_speeds(&outcome.times)
                .get(self.rank)
                .copied(),
        };
        self.recorder.step(&record, report);
        report(Event::Step(Box::new(record)));
    }

    /// The epoch's end: its checkpoint (at the next epoch's start), its record with the
    /// samples' digest, and rank 0's line.
    fn end_epoch(
        &mut self,
        epoch: usize,
        mark: EpochMark,
        report: &mut dyn FnMut(Event),
    ) -> Result<()> {
        let epoch_digest = std::mem::take(&mut self.state.progress.epoch_digest);
        self.state.progress.epoch += 1;
        self.state.progress.position = 0;
        self.checkpoint(report)?;
        let seconds = mark.started.elapsed().as_secs_f64();
        self.recorder.epoch(
            epoch + 1,
            self.state.progress.global_step,
            seconds,
            epoch_digest,
            report,
        );
        if self.rank == 0 {
            report(Event::EpochDone {
                epoch: epoch + 1,
                seconds,
            });
        }
        Ok(())
    }
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
