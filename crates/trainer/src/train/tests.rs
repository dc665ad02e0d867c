//! The training step in-process: two ranks as threads over the real collective on 127.0.0.1.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use collective::{ProcessGroup, World};

use super::TrainConfig;
use super::state::TrainState;
use super::step::{Step, StepInput};
use crate::checkpoint::ModelInfo;
use crate::data::{DatasetName, DownloadOptions, Normalisation, synthetic};
use crate::device::training_device;
use crate::model::{Architecture, Model, Snapshot, StepGradients, load, snapshot};
use crate::sampler::digest;

fn config() -> TrainConfig {
    TrainConfig {
        model: Architecture::SeedCnn,
        data: PathBuf::new(),
        dataset: DatasetName::Cifar10,
        download: DownloadOptions::default(),
        image_size: None,
        augment: None,
        loader_threads: 1,
        prefetch: 1,
        cache_bytes: 0,
        epochs: 1,
        batch_size: 8,
        learning_rate: 0.05,
        momentum: 0.9,
        weight_decay: 5e-4,
        print_freq: 0,
        model_file: PathBuf::new(),
        checkpoint_file: PathBuf::new(),
        checkpoint_every: None,
        seed: 7,
        threads: 1,
        evaluate: false,
        run_dir: PathBuf::new(),
        train_again: false,
        stop: Arc::new(AtomicBool::new(false)),
        stragglers: None,
        precision: kernels::Precision::F32,
    }
}

/// Pixels and labels of generated CIFAR images `indices`.
fn batch(indices: &[usize]) -> (Vec<f32>, Vec<i64>) {
    let images = synthetic::cifar(16, 3);
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    images.fill_batch(indices, &mut pixels, &mut labels);
    (pixels, labels)
}

/// One step on each rank of a world of `batches.len()` threads (rank `r` on the images
/// `batches[r]`), every rank starting from `start`; returns each rank's parameters and buffers
/// after the step, and the step's samples digest as that rank got it.
fn step_on(start: &Snapshot, batches: Vec<Vec<usize>>) -> Vec<(Vec<f32>, Vec<f32>, u64)> {
    let ranks = batches.len();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let total: usize = batches.iter().map(Vec::len).sum();
    let threads: Vec<_> = batches
        .into_iter()
        .enumerate()
        .map(|(rank, indices)| {
            let start = start.clone();
            std::thread::spawn(move || {
                let world = World::loopback(rank as u32, ranks as u32, port, "step-test");
                let mut group = ProcessGroup::join(&world).unwrap();
                let cfg = config();
                let device = training_device();
                let model = load(
                    Model::new(Architecture::SeedCnn, 10, &device),
                    Some(&start.params),
                    &start.buffers,
                );
                let info = ModelInfo {
                    architecture: "cnn".into(),
                    classes: (0..10).map(|c| c.to_string()).collect(),
                    image_size: 32,
                    normalisation: Normalisation::Cifar,
                };
                let mut state = TrainState::fresh(&cfg, &start, ranks, 16, info);
                let mut step = Step::new(model, &device, 32);
                let (pixels, labels) = batch(&indices);
                let input = StepInput {
                    pixels,
                    labels: &labels,
                    digest: digest(&indices),
                    samples: indices.len(),
                    data_s: 0.25 * (rank + 1) as f64,
                    node: 10 + rank as u32,
                };
                let outcome = step
                    .run(input, Default::default(), &mut group, &mut state, &cfg)
                    .unwrap();
                assert!(outcome.loss.is_finite() && outcome.agreed.stop == 0);
                assert_eq!(outcome.samples, total, "the ranks' samples, summed");
                // Every rank's times and node ride the all-reduce back to every rank.
                assert_eq!(outcome.times.len(), ranks);
                for (r, t) in outcome.times.iter().enumerate() {
                    assert_eq!(t.node, 10 + r as u32, "{:?}", outcome.times);
                    assert!((t.data_s - 0.25 * (r + 1) as f64).abs() < 1e-6, "{t:?}");
                    assert!(t.compute_s > 0.0, "{t:?}");
                }
                step.store(&mut state);
                (state.params().to_vec(), state.buffers, outcome.digest)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn start() -> Snapshot {
    snapshot(&Model::new(Architecture::SeedCnn, 10, &training_device()))
}

/// Two ranks given the same images average two equal gradients: the step is exactly the
/// one-rank step (and so is every buffer), which pins the all-reduce, the averaging, SGD and
/// the buffer broadcast to the arithmetic of a single process.
#[test]
fn two_ranks_on_the_same_batch_take_exactly_the_one_rank_step() {
    let start = start();
    let all: Vec<usize> = (0..8).collect();
    let one = step_on(&start, vec![all.clone()]);
    let two = step_on(&start, vec![all.clone(), all]);
    assert_ne!(one[0].0, start.params, "the step changed the weights");
    assert!(
        one[0].0 == two[0].0 && one[0].1 == two[0].1,
        "rank 0 = one rank"
    );
    assert!(
        one[0].0 == two[1].0 && one[0].1 == two[1].1,
        "rank 1 = one rank"
    );
}

/// Two ranks on different halves end the step with bit-identical parameters and buffers, and
/// not the weights either half alone would give.
#[test]
fn two_ranks_on_different_shards_end_the_step_identical() {
    let start = start();
    let (first, second): (Vec<usize>, Vec<usize>) = ((0..8).collect(), (8..16).collect());
    let two = step_on(&start, vec![first.clone(), second]);
    assert!(two[0].0 == two[1].0, "parameters differ between ranks");
    assert!(two[0].1 == two[1].1, "buffers differ between ranks");
    let both = digest(&(0..16).collect::<Vec<_>>());
    assert!(
        two[0].2 == both && two[1].2 == both,
        "every rank has the digest of both halves"
    );
    let alone = step_on(&start, vec![first]);
    assert_ne!(two[0].0, alone[0].0, "the other rank's gradients count");
}

/// What one rank holds before a group's start: live at a step with weights filled with a
/// value, or nothing live (a joiner, or a stream cut off).
#[derive(Clone, Copy)]
struct Held {
    live: bool,
    step: u64,
    fill: f32,
}

/// Runs [`super::membership::sync`] on a world of `held.len()` threads; returns each rank's
/// (global step, first parameter, first momentum value, received, bytes, live after).
fn sync_on(held: Vec<Held>) -> Vec<(u64, f32, f32, bool, u64, bool)> {
    let ranks = held.len();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let start = start();
    let threads: Vec<_> = held
        .into_iter()
        .enumerate()
        .map(|(rank, h)| {
            let start = start.clone();
            std::thread::spawn(move || {
                let world = World::loopback(rank as u32, ranks as u32, port, "sync-test");
                let mut group = ProcessGroup::join(&world).unwrap();
                let cfg = config();
                let mut state = TrainState::fresh(&cfg, &start, ranks, 16, ModelInfo::seed_cifar());
                state.progress.global_step = h.step;
                state.params_mut().fill(h.fill);
                state.momentum.fill(h.fill / 2.0);
                let mut live = h.live;
                let synced =
                    super::membership::sync(&cfg, &mut group, &mut state, &mut live, &mut |_| {})
                        .unwrap();
                (
                    state.progress.global_step,
                    state.params()[0],
                    state.momentum[0],
                    synced.received,
                    synced.bytes,
                    live,
                )
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// A new group takes the state of the lowest rank furthest on: a survivor one step behind and
/// a joiner receive it whole (weights, momentum, step); the source receives nothing.
#[test]
fn a_new_group_takes_the_state_of_the_rank_furthest_on() {
    let got = sync_on(vec![
        Held {
            live: true,
            step: 4,
            fill: 1.0,
        },
        Held {
            live: true,
            step: 5,
            fill: 2.0,
        },
        Held {
            live: false,
            step: 0,
            fill: 3.0,
        },
        Held {
            live: true,
            step: 5,
            fill: 2.0,
        },
    ]);
    for (rank, &(step, param, momentum, received, bytes, live)) in got.iter().enumerate() {
        assert_eq!(
            (step, param, momentum, live),
            (5, 2.0, 1.0, true),
            "rank {rank}"
        );
        assert_eq!(received, rank == 0 || rank == 2, "rank {rank}");
        assert!(bytes > 0, "rank {rank}: the state was streamed");
    }
}

/// Survivors that all hold the same step stream nothing; a job's start (no rank live) is rank
/// 0's state and not a state from a peer.
#[test]
fn equal_survivors_stream_nothing_and_a_start_is_rank_0s_state() {
    let equal = sync_on(vec![
        Held {
            live: true,
            step: 9,
            fill: 1.0,
        },
        Held {
            live: true,
            step: 9,
            fill: 1.0,
        },
    ]);
    assert!(
        equal.iter().all(|r| *r == (9, 1.0, 0.5, false, 0, true)),
        "{equal:?}"
    );
    let fresh = sync_on(vec![
        Held {
            live: false,
            step: 0,
            fill: 1.0,
        },
        Held {
            live: false,
            step: 0,
            fill: 3.0,
        },
    ]);
    for r in &fresh {
        assert_eq!((r.1, r.3, r.4, r.5), (1.0, false, 0, true), "{fresh:?}");
    }
}

/// The source lost half-way through the stream (after the header, before the weights): the
/// receiver's sync fails and its state is no longer live, so it is never offered to a later
/// group as a step it holds.
#[test]
fn a_stream_cut_off_half_way_leaves_no_live_state() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let start = start();
    let source = std::thread::spawn(move || {
        let mut group = ProcessGroup::join(&World::loopback(0, 2, port, "cut")).unwrap();
        group.all_gather_u64(8).unwrap();
        let mut header = [0u8; super::state::HEADER_BYTES];
        group.broadcast_bytes(&mut header, 0).unwrap();
        // Gone before the parameters.
    });
    let mut group = ProcessGroup::join(&World::loopback(1, 2, port, "cut")).unwrap();
    let cfg = config();
    let mut state = TrainState::fresh(&cfg, &start, 2, 16, ModelInfo::seed_cifar());
    state.progress.global_step = 3;
    let mut live = true;
    let synced = super::membership::sync(&cfg, &mut group, &mut state, &mut live, &mut |_| {});
    source.join().unwrap();
    assert!(synced.is_err(), "the stream was cut off");
    assert!(!live, "what it left is not a live state");
}

/// After an update the model holds the newest parameters: the state's flat ones are refused
/// (never saved or sent old) until they are taken back, and then they are the model's.
#[test]
fn the_flat_parameters_are_refused_after_an_update_until_taken_back() {
    let cfg = config();
    let device = training_device();
    let start = start();
    let model = load(
        Model::new(Architecture::SeedCnn, 10, &device),
        Some(&start.params),
        &start.buffers,
    );
    let mut state = TrainState::fresh(&cfg, &start, 1, 16, ModelInfo::seed_cifar());
    let grads = vec![1.0; state.param_count()];
    let model = state.sgd_step(model, &cfg, StepGradients::Flat(&grads), 1.0);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| state.params().len()));
    assert!(refused.is_err(), "old parameters were handed out");
    state.take_params(&model);
    assert_eq!(
        state.params(),
        snapshot(&model).params,
        "the model's parameters"
    );
    assert_ne!(state.params(), start.params, "the update moved them");
}
