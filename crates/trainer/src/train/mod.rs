//! Data-parallel training: every rank runs the same model on its shard of each batch,
//! gradients are averaged with the ring all-reduce, and every rank applies the same update.
//!
//! [`train`] reads as its parts: [`Setup`] (the data set, checked against the model), the start
//! (rank 0's fresh or resumed state broadcast to all), the epoch loop of [`step::Step`]s with
//! checkpoints, and the end (model file, evaluation).
//!
//! Invariant: after every step all ranks hold bit-identical parameters and BatchNorm buffers
//! (same start from rank 0's broadcast, same averaged gradients, same arithmetic, buffers
//! re-broadcast from rank 0 as PyTorch DDP does).

mod config;
mod event;
pub mod record;
mod regroup;
mod state;
mod step;
pub mod stragglers;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use collective::regroup::{self as protocol, AfterFailure, AfterStep, Failure};
use collective::{CollectiveError, ProcessGroup, World};

pub use config::{TrainConfig, check_sgd, check_stragglers};
pub use event::Event;

use crate::checkpoint::{ModelInfo, save_model};
use crate::data::loader::{Batch, Loader, LoaderOptions};
use crate::data::{self, Augment, DownloadOptions, Samples, Split, Unreadable};
use crate::device::{set_cpu_threads, training_device};
use crate::error::{Result, TrainError};
use crate::eval::{Confusion, evaluate, inference_model};
use crate::model::{Model, Snapshot, load, snapshot};
use crate::sampler::{self, Shard, digest};
use record::Recorder;
use regroup::{Control, Leave, sync};
use state::TrainState;
use step::{Step, StepInput, StepOutcome};
use stragglers::{Change, Watch};

/// Trains on the world described by `world`, calling `report` on the way.
pub fn train(cfg: &TrainConfig, world: &World, report: &mut dyn FnMut(Event)) -> Result<()> {
    config::validate(cfg)?;
    let _span =
        tracing::info_span!("worker", rank = world.rank, restart = world.restart_count).entered();
    set_cpu_threads(cfg.threads);
    crate::device::set_precision(cfg.precision).map_err(TrainError::Config)?;
    let mut control = Control::open(world, report);
    let mut world = world.clone();
    // When this worker's first group broke up: it waited for another.
    let mut rejoined: Option<(Instant, u32)> = None;
    let Started {
        mut group,
        setup,
        device,
        model,
        template,
        state,
        synced,
    } = loop {
        match start(cfg, &world, control.as_mut(), report) {
            Ok(started) => break started,
            // The group broke up before it trained (a peer lost or silent): with an agent to
            // regroup, this worker waits for its next round instead of failing.
            Err(TrainError::Collective(e)) if control.is_some() => {
                if let Some(control) = control.as_mut() {
                    rejoined.get_or_insert((Instant::now(), world.world_size));
                    world = control.rejoin(&world, e.to_string(), &cfg.stop)?;
                }
            }
            Err(e) => return Err(e),
        }
    };
    let world = &world;
    let (rank, world_size) = (group.rank(), group.world_size());
    if let (Some((since, world_size_before)), Some(control)) = (rejoined, control.as_mut()) {
        control.regrouped(collective::control::Regrouped {
            world_size_before,
            world_size: world_size as u32,
            rank: rank as u32,
            step: state.progress.global_step,
            steps_dropped: 0,
            bytes: synced.bytes,
            seconds: since.elapsed().as_secs_f64(),
            received: synced.received,
        });
    }

    let mut recorder = Recorder::open(&cfg.run_dir, world, report);
    recorder.start(
        telemetry::metrics::Start {
            v: telemetry::metrics::SCHEMA_VERSION,
            time: telemetry::unix_time(),
            rank: rank as u32,
            world_size: world_size as u32,
            restart: world.restart_count,
            step: state.progress.global_step,
            resumed: synced.resumed,
            from_peer: synced.received,
            health: world.node_health.map(|(gemm_mflops, loopback_mbps)| {
                telemetry::metrics::NodeHealth {
                    gemm_mflops,
                    loopback_mbps,
                }
            }),
            config: config::run_config(cfg, world, setup.image_size),
        },
        world_size,
        report,
    );

    let mut run = Run {
        cfg,
        world: world.clone(),
        setup: &setup,
        step: Step::new(model, &device, setup.image_size),
        state,
        template,
        recorder,
        unreadable: Unreadable::default(),
        rank,
        world_size,
        live: true,
        epoch_mark: None,
        watch: Watch::new(cfg.stragglers.unwrap_or_default()),
    };
    while run.state.progress.epoch < cfg.epochs {
        match (
            run.epoch(&mut group, control.as_mut(), report)?,
            control.as_mut(),
        ) {
            (None, _) => {}
            (Some(Leave::Going), _) => return Err(run.left()),
            (Some(why), Some(control)) => group = run.regroup(group, why, control, report)?,
            (Some(_), None) => {
                unreachable!("only a worker with a control channel leaves its group")
            }
        }
    }
    run.finish(&mut group, report)?;
    if let Some(control) = control.as_mut() {
        control.finished();
    }
    Ok(())
}

/// A worker's group, its data and its state, the same as every other rank's.
struct Started {
    group: ProcessGroup,
    setup: Setup,
    device: burn::tensor::Device,
    model: Model,
    template: Snapshot,
    state: TrainState,
    synced: regroup::Synced,
}

/// Joins the group `world` describes, reads the data, and takes the group's state: rank 0's
/// (fresh or resumed) or, when this worker joins a group that is training, that of the rank
/// furthest on.
fn start(
    cfg: &TrainConfig,
    world: &World,
    control: Option<&mut Control>,
    report: &mut dyn FnMut(Event),
) -> Result<Started> {
    let mut group = ProcessGroup::join(world)?;
    if let Some(control) = control {
        control.watch(&group);
    }
    let setup = Setup::prepare(cfg, world, &mut group, report)?;
    let device = training_device();
    device.seed(cfg.seed);
    let model = Model::new(cfg.model, setup.info.classes.len(), &device);
    let template = snapshot(&model);
    let mut state = TrainState::fresh(
        cfg,
        &template,
        group.world_size(),
        setup.train.len(),
        setup.info.clone(),
    );
    let synced = sync(cfg, &mut group, &mut state, &mut false, report)?;
    let model = load(model, Some(state.params()), &state.buffers);
    Ok(Started {
        group,
        setup,
        device,
        model,
        template,
        state,
        synced,
    })
}

/// The data a run trains (and evaluates) on, read and checked before the model is built.
struct Setup {
    train: Arc<Samples>,
    /// Read at the start when evaluating, so that a missing validation set stops the run now.
    eval: Option<Arc<Samples>>,
    image_size: usize,
    augment: Augment,
    info: ModelInfo,
}

impl Setup {
    fn prepare(
        cfg: &TrainConfig,
        world: &World,
        group: &mut ProcessGroup,
        report: &mut dyn FnMut(Event),
    ) -> Result<Setup> {
        // One download per node, by local rank 0; the node's other workers wait for it on the
        // filesystem (`data::Handoff`), not at the barrier, whose collective timeout a slow
        // download outlasts. Then the barrier (the one a regrouping worker passes too), after
        // which local rank 0 removes its status.
        let handoff = data::Handoff::new(&cfg.data, world);
        let ensured = if world.local_rank == 0 {
            handoff.lead(|| {
                data::ensure(&cfg.data, cfg.dataset, &cfg.download, &mut |p| {
                    report(Event::Data(p))
                })
                .map(|_| ())
            })
        } else {
            handoff.wait(&cfg.stop, &mut |p| report(Event::Data(p)))?
        };
        let passed = group.barrier();
        drop(handoff);
        ensured?;
        passed?;
        // (A worker that regroups passes the same barrier in its new group: `regroup`.)
        let layout = data::ensure(
            &cfg.data,
            cfg.dataset,
            &DownloadOptions {
                enabled: false,
                turn_on: None,
                ..cfg.download.clone()
            },
            &mut |_| {},
        )?;
        if let (Some(size), data::Layout::Cifar(_)) = (cfg.image_size, &layout)
            && size != 32
        {
            return Err(TrainError::Config(format!(
                "--image-size {size}: CIFAR-10's images are 32×32; drop --image-size or pass 32"
            )));
        }
        let image_size = cfg
            .image_size
            .unwrap_or_else(|| layout.default_image_size());
        cfg.model
            .check_image_size(image_size)
            .map_err(TrainError::Config)?;
        let augment = cfg.augment.unwrap_or_else(|| layout.default_augment());
        let train = Arc::new(layout.open(Split::Train, image_size, cfg.cache_bytes)?);
        if train.is_empty() {
            return Err(TrainError::BadData {
                path: layout.dir().to_path_buf(),
                problem: "the training set is empty".into(),
            });
        }
        let eval = cfg
            .evaluate
            // Evaluated once, at the end: its images are not worth keeping in memory.
            .then(|| layout.open(Split::Eval, image_size, 0))
            .transpose()
            .map_err(|e| match e {
                TrainError::BadData { path, problem } => TrainError::BadData {
                    path,
                    problem: format!(
                        "{problem} (the test set; pass --no-eval to train without it)"
                    ),
                },
                e => e,
            })?
            .map(Arc::new);
        let info = ModelInfo {
            architecture: cfg.model.name().into(),
            classes: train.classes.clone(),
            image_size,
            normalisation: train.normalisation,
        };
        Ok(Setup {
            train,
            eval,
            image_size,
            augment,
            info,
        })
    }
}

/// A run under way: what the epoch loop carries from step to step.
struct Run<'a> {
    cfg: &'a TrainConfig,
    /// The group's environment (the latest round's, after a regroup).
    world: World,
    setup: &'a Setup,
    step: Step,
    state: TrainState,
    /// The model's tensor names and shapes, for checkpoints.
    template: Snapshot,
    recorder: Recorder,
    unreadable: Unreadable,
    rank: usize,
    world_size: usize,
    /// `state` is a step this worker completed (or took whole from a peer), not what a stream
    /// cut off half-way left.
    live: bool,
    /// Where the epoch in progress began, kept across regroups so that its step counter and
    /// its time run on through them.
    epoch_mark: Option<EpochMark>,
    /// The nodes' step times, compared for a straggler.
    watch: Watch,
}

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

/// The start of an epoch: its number, when, and the global step before its first step.
#[derive(Debug, Clone, Copy)]
struct EpochMark {
    epoch: usize,
    started: Instant,
    global_step: u64,
}

impl Run<'_> {
    /// The rest of the current epoch (from the position all ranks agree on), then its
    /// checkpoint. Returns [`TrainError::Preempted`] once a stop was asked for and saved, and
    /// why the worker must leave its group when it must (only with a `control` channel: a peer
    /// lost, or the next round handed by the agent), holding the last step it completed. What
    /// follows each step is [`protocol::after_step`]'s; a failed collective,
    /// [`protocol::after_failure`]'s.
    fn epoch(
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
        let mut last_checkpoint_step = self.state.progress.global_step;
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
            // The epoch's end checkpoints anyway.
            let due = step + 1 < shard.steps()
                && cfg
                    .checkpoint_every
                    .is_some_and(|n| n > 0 && place.global_step - last_checkpoint_step >= n);
            let me_leaving = control.as_ref().is_some_and(|c| c.leaving());
            match protocol::after_step(outcome.agreed, me_leaving, due) {
                AfterStep::Continue => {}
                AfterStep::Checkpoint => {
                    self.checkpoint(report)?;
                    last_checkpoint_step = place.global_step;
                }
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
        let failure = match e {
            CollectiveError::PeerLost(_) => Failure::PeerLost,
            CollectiveError::Timeout { .. } => Failure::TimedOut,
            _ => Failure::Other,
        };
        match protocol::after_failure(failure, agent, self.rank as u32) {
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

    /// A straggler found or gone at `step`: rank 0 says so and records it; the straggler's own
    /// node (its local rank 0) tells its agent, which may evict it.
    fn straggler(
        &mut self,
        change: Change,
        step: u64,
        control: Option<&mut Control>,
        report: &mut dyn FnMut(Event),
    ) {
        let window = self.cfg.stragglers.unwrap_or_default().window;
        let (record, text) = match &change {
            Change::Started(s) => (
                telemetry::metrics::Straggler {
                    time: telemetry::unix_time(),
                    rank: self.rank as u32,
                    step,
                    slow: true,
                    node: s.node,
                    ranks: s.ranks.clone(),
                    slowdown: s.slowdown,
                    cause: s.cause.to_string(),
                    data_s: s.data_s,
                    compute_s: s.compute_s,
                    others_data_s: s.others_data_s,
                    others_compute_s: s.others_compute_s,
                },
                format!(
                    "node {} (ranks {}) is a straggler: {:.1}× the other nodes' time per step \
                     over the last {window} steps, from {} ({:.3} s of compute and {:.3} s \
                     waiting for data a step, against {:.3} s and {:.3} s)",
                    s.node,
                    ranks_text(&s.ranks),
                    s.slowdown,
                    s.cause,
                    s.compute_s,
                    s.data_s,
                    s.others_compute_s,
                    s.others_data_s,
                ),
            ),
            Change::Ended { node, slowdown } => (
                telemetry::metrics::Straggler {
                    time: telemetry::unix_time(),
                    rank: self.rank as u32,
                    step,
                    slow: false,
                    node: *node,
                    ranks: Vec::new(),
                    slowdown: slowdown.unwrap_or(0.0),
                    cause: String::new(),
                    data_s: 0.0,
                    compute_s: 0.0,
                    others_data_s: 0.0,
                    others_compute_s: 0.0,
                },
                match slowdown {
                    Some(x) => format!(
                        "node {node} is no longer a straggler ({x:.1}× the other nodes' time per step)"
                    ),
                    None => format!(
                        "node {node} is no longer a straggler: the group changed (it may have left)"
                    ),
                },
            ),
        };
        let node = record.node;
        let slow = record.slow;
        if self.rank == 0 {
            self.recorder.straggler(record, report);
            report(Event::Straggler {
                slow,
                report: text.clone(),
            });
        }
        if node == self.world.group_rank
            && self.world.local_rank == 0
            && let Some(control) = control
        {
            control.straggler(slow, text);
        }
    }

    /// A peer was lost mid-step: every rank holds the state of the last step it completed
    /// (`Step::run` changes nothing before its collectives succeed), so rank 0 saves it, and
    /// the restart that follows goes back to this step rather than to the last scheduled
    /// checkpoint (up to an epoch earlier). A failure to save is reported; the restart then
    /// resumes from the previous checkpoint as it would have.
    fn save_before_restart(&mut self, report: &mut dyn FnMut(Event)) {
        if self.rank != 0 {
            return;
        }
        if let Err(e) = self.checkpoint(report) {
            report(Event::Warning(format!(
                "a peer was lost and the checkpoint of step {} could not be saved: {e}; the restart resumes from the one before",
                self.state.progress.global_step
            )));
        }
    }

    fn checkpoint(&mut self, report: &mut dyn FnMut(Event)) -> Result<()> {
        self.step.store(&mut self.state);
        self.state.checkpoint(
            self.cfg,
            &self.template,
            self.rank,
            &mut self.recorder,
            report,
        )
    }

    /// After the last epoch: the model file (rank 0), the evaluation when asked for (each rank
    /// its share of the validation set, the counts summed), and the fingerprint every rank
    /// reports.
    fn finish(mut self, group: &mut ProcessGroup, report: &mut dyn FnMut(Event)) -> Result<()> {
        let (cfg, rank, world_size) = (self.cfg, self.rank, self.world_size);
        self.step.store(&mut self.state);
        let state = &self.state;
        if self.unreadable.count() > 0 {
            report(Event::Warning(format!(
                "rank {rank}: {} unreadable images were skipped (each named above)",
                self.unreadable.count()
            )));
        }
        if rank == 0 {
            save_model(
                &cfg.model_file,
                &state.snapshot(&self.template),
                state.progress.global_step,
                &state.info,
            )?;
            report(Event::ModelSaved {
                path: cfg.model_file.clone(),
            });
        }
        if let Some(test) = &self.setup.eval {
            let mine: Vec<usize> = (rank..test.len()).step_by(world_size).collect();
            let model = inference_model(
                cfg.model,
                state.info.classes.len(),
                state.params(),
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
                self.recorder
                    .eval(state.progress.global_step, &confusion, report);
                report(Event::Evaluated(Box::new(confusion)));
            }
        }
        group.barrier()?;
        report(Event::Finished {
            rank,
            global_step: state.progress.global_step,
            samples_seen: state.progress.samples_seen,
            world_size,
            fingerprint: state.fingerprint(),
        });
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

/// `4-5`, `3`, or `0, 2, 7`: a node's ranks.
fn ranks_text(ranks: &[u32]) -> String {
    match ranks {
        [] => "none".into(),
        [one] => one.to_string(),
        [first, .., last] if (*last - *first) as usize + 1 == ranks.len() => {
            format!("{first}-{last}")
        }
        _ => ranks
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    }
}
