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
mod epoch;
mod event;
mod membership;
pub mod record;
mod state;
mod step;
pub mod stragglers;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use collective::regroup as protocol;
use collective::{ProcessGroup, World};

pub use config::{TrainConfig, check_sgd, check_stragglers};
pub use event::Event;

use crate::checkpoint::{ModelInfo, save_model};
use crate::data::{self, Augment, DownloadOptions, Samples, Split, Unreadable};
use crate::device::{set_cpu_threads, training_device};
use crate::error::{Result, TrainError};
use crate::eval::{Confusion, evaluate, inference_model};
use crate::model::{Model, Snapshot, load, snapshot};
use membership::{Control, Leave, sync};
use record::Recorder;
use state::TrainState;
use step::Step;
use stragglers::{Change, StragglerWatch};

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
    let prepared = if world.warm {
        let prepared = warm_start(cfg, &mut world, control.as_mut(), report)?;
        // Its report says it had no world before (a warm join, not a regroup).
        rejoined = Some((Instant::now(), 0));
        Some(prepared)
    } else {
        None
    };
    let Started {
        mut group,
        setup,
        device,
        model,
        template,
        state,
        synced,
    } = first_group(
        cfg,
        &mut world,
        prepared,
        control.as_mut(),
        &mut rejoined,
        report,
    )?;
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
            assignments: 0, // the channel says its own count
        });
    }

    let mut recorder = Recorder::open(&cfg.run_dir, world, report);
    let start = start_record(
        cfg,
        world,
        &setup,
        (rank, world_size),
        state.progress.global_step,
        &synced,
    );
    recorder.start(start, world_size, report);

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
        watch: StragglerWatch::new(cfg.stragglers.unwrap_or_default()),
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

/// A warm start (its node joins a job under way): this worker reads its data before its node
/// has a place, says it is ready, and waits for its first round (`world` then); the others
/// pause only for its group's start.
fn warm_start(
    cfg: &TrainConfig,
    world: &mut World,
    control: Option<&mut Control>,
    report: &mut dyn FnMut(Event),
) -> Result<Setup> {
    let Some(control) = control else {
        return Err(TrainError::Config(
            "started warm, but the agent's control channel cannot be used: this worker \
             cannot be handed its place in the job"
                .into(),
        ));
    };
    let prepared = Setup::prepare(cfg, world, None, report)?;
    control.ready()?;
    *world = control.first_round(world, &cfg.stop)?;
    Ok(prepared)
}

/// Starts this worker's first group in `world`, and while it breaks up before it trains (a
/// peer lost or silent) with an agent to regroup, waits for the next round instead of failing
/// (`rejoined`: since when, from which world size, for the report of that regroup).
fn first_group(
    cfg: &TrainConfig,
    world: &mut World,
    prepared: Option<Setup>,
    mut control: Option<&mut Control>,
    rejoined: &mut Option<(Instant, u32)>,
    report: &mut dyn FnMut(Event),
) -> Result<Started> {
    loop {
        match start(cfg, world, prepared.clone(), control.as_deref_mut(), report) {
            Ok(started) => return Ok(started),
            Err(TrainError::Collective(e))
                if protocol::after_start_failure(protocol::Failure::of(&e), control.is_some())
                    == protocol::AfterStartFailure::Regroup =>
            {
                if let Some(control) = control.as_deref_mut() {
                    rejoined.get_or_insert((Instant::now(), world.world_size));
                    *world = control.rejoin(world, e.to_string(), &cfg.stop)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The run's start record: where this worker starts (`step`, resumed or from a peer as
/// `synced` says), its node's health figures and the run's configuration.
fn start_record(
    cfg: &TrainConfig,
    world: &World,
    setup: &Setup,
    (rank, world_size): (usize, usize),
    step: u64,
    synced: &membership::Synced,
) -> telemetry::metrics::Start {
    telemetry::metrics::Start {
        v: telemetry::metrics::SCHEMA_VERSION,
        time: telemetry::unix_time(),
        rank: rank as u32,
        world_size: world_size as u32,
        restart: world.restart_count,
        step,
        resumed: synced.resumed,
        from_peer: synced.received,
        health: world.node_health.map(|(gemm_mflops, loopback_mbps)| {
            telemetry::metrics::NodeHealth {
                gemm_mflops,
                loopback_mbps,
            }
        }),
        config: config::run_config(cfg, world, setup.image_size),
    }
}

/// A worker's group, its data and its state, the same as every other rank's.
struct Started {
    group: ProcessGroup,
    setup: Setup,
    device: burn::tensor::Device,
    model: Model,
    template: Snapshot,
    state: TrainState,
    synced: membership::Synced,
}

/// Joins the group `world` describes, reads the data (unless a warm start `prepared` it), and
/// takes the group's state: rank 0's (fresh or resumed) or, when this worker joins a group
/// that is training, that of the rank furthest on.
fn start(
    cfg: &TrainConfig,
    world: &World,
    prepared: Option<Setup>,
    control: Option<&mut Control>,
    report: &mut dyn FnMut(Event),
) -> Result<Started> {
    let mut group = ProcessGroup::join(world)?;
    if let Some(control) = control {
        control.watch(&group);
    }
    let setup = match prepared {
        // The data barrier every start passes (the others' regroup passes it too).
        Some(setup) => {
            group.barrier()?;
            setup
        }
        None => Setup::prepare(cfg, world, Some(&mut group), report)?,
    };
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
#[derive(Clone)]
struct Setup {
    train: Arc<Samples>,
    /// Read at the start when evaluating, so that a missing validation set stops the run now.
    eval: Option<Arc<Samples>>,
    image_size: usize,
    augment: Augment,
    info: ModelInfo,
}

impl Setup {
    /// The data, downloaded by local rank 0 if need be; then, with a `group`, its barrier
    /// (a warm start passes it once it has a group: [`start`]).
    fn prepare(
        cfg: &TrainConfig,
        world: &World,
        group: Option<&mut ProcessGroup>,
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
        let passed = group.map_or(Ok(()), |g| g.barrier());
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
    watch: StragglerWatch,
}

/// The start of an epoch: its number, when, and the global step before its first step.
#[derive(Debug, Clone, Copy)]
struct EpochMark {
    epoch: usize,
    started: Instant,
    global_step: u64,
}

impl Run<'_> {
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
