//! Measurements behind `trainctl bench`: one training step of the seed CNN or a ResNet, split
//! into its parts, and the ring all-reduce against a plain loopback TCP copy.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor, TensorData};
use collective::{ProcessGroup, World};

use crate::cifar::synthetic;
use crate::device::{set_cpu_threads, training_device};
use crate::model::{Architecture, Model, buffers, gradients, load, snapshot, to_vec};

/// Classes of a timed network: CIFAR-10's for the seed, tiny-imagenet's 200 for a ResNet.
pub fn bench_classes(arch: Architecture) -> usize {
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

/// Times `steps` training steps (after one warm-up) of `model` on `image_size`² images with
/// `threads` CPU threads: the same work as a step of `trainctl train` minus the all-reduce.
///
/// # Panics
/// The seed CNN at any size but 32 (its classifier is sized for 32×32 inputs).
pub fn training_step(
    model: Architecture,
    image_size: usize,
    threads: usize,
    batch_size: usize,
    steps: usize,
) -> StepTimes {
    set_cpu_threads(threads);
    let device = training_device();
    let (pixels, labels) = if image_size == 32 {
        let data = synthetic::generate(batch_size, 3);
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
        steps,
    );
    times.model = model.name();
    times.threads = threads;
    times
}

fn time_steps(
    mut model: Model,
    (pixels, labels, image_size): (&[f32], &[i64], usize),
    batch_size: usize,
    steps: usize,
) -> StepTimes {
    let device = training_device();
    let mut params = snapshot(&model).params;
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut grads_flat = Vec::new();
    let mut parts: [Vec<f64>; 5] = Default::default();
    for i in 0..steps + 1 {
        let t0 = Instant::now();
        let x = Tensor::<4>::from_data(
            TensorData::new(pixels.to_vec(), [batch_size, 3, image_size, image_size]),
            &device,
        );
        let y =
            Tensor::<1, Int>::from_data(TensorData::new(labels.to_vec(), [batch_size]), &device);
        let loss = loss_fn.forward(model.forward(x), y);
        let loss_value = to_vec(loss.clone())[0];
        let t1 = Instant::now();
        let grads = loss.backward();
        let t2 = Instant::now();
        gradients(&model, &grads, &mut grads_flat);
        let t3 = Instant::now();
        for (p, g) in params.iter_mut().zip(&grads_flat) {
            *p -= 1e-3 * g;
        }
        let bufs = buffers(&model);
        model = load(model, Some(&params), &bufs);
        let t4 = Instant::now();
        assert!(loss_value.is_finite());
        if i > 0 {
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
        batch_size,
        steps,
        step_s: step,
        forward_s: forward,
        backward_s: backward,
        gradients_out_s: out,
        update_s: update,
        images_per_s: batch_size as f64 / step,
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct AllReduceTimes {
    pub ranks: usize,
    pub floats: usize,
    pub repeats: usize,
    pub median_s: f64,
    /// NCCL's bus bandwidth: 2(n-1)/n · bytes / time, comparable across world sizes.
    pub bus_gbytes_per_s: f64,
}

/// Times the ring all-reduce of `floats` values across `ranks` threads on 127.0.0.1.
pub fn all_reduce(
    ranks: usize,
    floats: usize,
    repeats: usize,
) -> Result<AllReduceTimes, collective::CollectiveError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let handles: Vec<_> = (0..ranks)
        .map(|rank| {
            std::thread::spawn(move || -> Result<Vec<f64>, collective::CollectiveError> {
                let world = World {
                    rank: rank as u32,
                    world_size: ranks as u32,
                    local_rank: rank as u32,
                    local_world_size: ranks as u32,
                    master_port: port,
                    run_id: "bench".into(),
                    ..World::single()
                };
                let mut group = ProcessGroup::join(&world)?;
                let mut buf = vec![1.0f32; floats];
                let mut times = Vec::new();
                for _ in 0..repeats + 1 {
                    group.barrier()?;
                    let t = Instant::now();
                    group.all_reduce_sum(&mut buf)?;
                    times.push(t.elapsed().as_secs_f64());
                }
                Ok(times[1..].to_vec())
            })
        })
        .collect();
    let mut rank0 = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let times = h
            .join()
            .map_err(|_| collective::CollectiveError::PeerLost("a bench rank panicked".into()))??;
        if i == 0 {
            rank0 = times;
        }
    }
    let median_s = median(rank0);
    let bytes = (floats * 4) as f64;
    Ok(AllReduceTimes {
        ranks,
        floats,
        repeats,
        median_s,
        bus_gbytes_per_s: 2.0 * (ranks as f64 - 1.0) / ranks as f64 * bytes / median_s / 1e9,
    })
}

/// GB/s of a plain copy of `bytes` through one loopback TCP connection: the ceiling the ring
/// works under on this machine.
pub fn loopback_copy(bytes: usize, repeats: usize) -> std::io::Result<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..repeats + 1 {
            s.read_exact(&mut buf)?;
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let buf = vec![7u8; bytes];
    let mut times = Vec::new();
    let mut ack = [0u8; 1];
    for _ in 0..repeats + 1 {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut ack)?;
        times.push(t.elapsed());
    }
    reader
        .join()
        .map_err(|_| std::io::Error::other("reader panicked"))??;
    let t = median(times[1..].iter().map(Duration::as_secs_f64).collect());
    Ok(bytes as f64 / t / 1e9)
}

/// Forward and backward (both gradients) time of one algorithm on one layer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AlgorithmTimes {
    pub forward_s: f64,
    pub backward_s: f64,
    /// GFLOP/s of the direct convolution's arithmetic (2·MACs, the backward twice the forward):
    /// comparable across algorithms, so Winograd can exceed the machine's peak.
    pub gflops_per_s: f64,
}

/// One 3×3 convolution of the seed CNN at its place in the network (input
/// `[batch, c_in, size, size]`), by each of trainctl's algorithms.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerTimes {
    pub layer: String,
    pub input: [usize; 4],
    pub c_out: usize,
    /// What the training step uses for this shape.
    pub chosen: &'static str,
    pub im2col: AlgorithmTimes,
    pub winograd: AlgorithmTimes,
    /// Largest difference between Winograd's and im2col's forward output and gradients,
    /// relative to the largest magnitude of each.
    pub winograd_error: f64,
}

/// The seed CNN's convolutions: (name, c_in, c_out, spatial size).
pub const CONV_LAYERS: [(&str, usize, usize, usize); 6] = [
    ("network.0", 3, 32, 32),
    ("network.2", 32, 64, 32),
    ("network.6", 64, 128, 16),
    ("network.8", 128, 128, 16),
    ("network.12", 128, 256, 8),
    ("network.14", 256, 256, 8),
];

/// Times each convolution's kernels alone (median of `repeats` after one warm-up), forward with
/// bias and ReLU, backward with both gradients, on random data.
pub fn conv_layers(threads: usize, batch_size: usize, repeats: usize) -> Vec<LayerTimes> {
    use kernels::conv::{self, ConvShape, PackedWeight, Prepared};
    use kernels::winograd::WinogradWeight;
    set_cpu_threads(threads);
    let random = |len: usize, seed: u64| -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    CONV_LAYERS
        .iter()
        .map(|&(name, c_in, c_out, size)| {
            let shape = ConvShape::same_3x3(batch_size, c_in, c_out, size);
            let x = random(shape.input_len(), 1);
            let w: Vec<f32> = random(shape.weight_len(), 2)
                .iter()
                .map(|v| v / (c_in as f32 * 9.0).sqrt())
                .collect();
            let bias = random(c_out, 3);
            let dy = random(shape.output_len(), 4);
            let flops = 2.0 * (batch_size * size * size * c_out * c_in * 9) as f64;
            let time = |prepared: &Prepared| {
                let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
                for i in 0..repeats + 1 {
                    let t0 = Instant::now();
                    let y = conv::forward(&shape, &x, prepared, Some(&bias), true);
                    let t1 = Instant::now();
                    let g = conv::backward(&shape, &x, prepared, Some(&y), &dy, true);
                    let t2 = Instant::now();
                    assert!(g.weight.iter().all(|v| v.is_finite()));
                    if i > 0 {
                        fwd.push((t1 - t0).as_secs_f64());
                        bwd.push((t2 - t1).as_secs_f64());
                    }
                }
                let (forward_s, backward_s) = (median(fwd), median(bwd));
                AlgorithmTimes {
                    forward_s,
                    backward_s,
                    gflops_per_s: 3.0 * flops / (forward_s + backward_s) / 1e9,
                }
            };
            let im2col = Prepared::Im2col(PackedWeight::from_torch(&shape, &w));
            let winograd = Prepared::Winograd(WinogradWeight::from_torch(&shape, &w));
            // The error without the ReLU: through it, an output of ±1e-7 either side of zero
            // passes the whole upstream gradient or none of it, in either algorithm.
            let plain = |prepared: &Prepared| {
                let y = conv::forward(&shape, &x, prepared, Some(&bias), false);
                let g = conv::backward(&shape, &x, prepared, None, &dy, true);
                (y, g)
            };
            let ((y1, g1), (y2, g2)) = (plain(&im2col), plain(&winograd));
            let relative = |a: &[f32], b: &[f32]| {
                let scale = b.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
                a.iter()
                    .zip(b)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0f32, f32::max)
                    / scale
            };
            let winograd_error = [
                relative(&y2, &y1),
                relative(
                    g2.input.as_deref().unwrap_or(&[]),
                    g1.input.as_deref().unwrap_or(&[]),
                ),
                relative(&g2.weight, &g1.weight),
                relative(&g2.bias, &g1.bias),
            ]
            .into_iter()
            .fold(0.0f32, f32::max) as f64;
            let (im2col, winograd) = (time(&im2col), time(&winograd));
            LayerTimes {
                layer: name.to_string(),
                input: [batch_size, c_in, size, size],
                c_out,
                chosen: match Prepared::new(&shape, &w) {
                    Prepared::Im2col(_) => "im2col",
                    Prepared::Winograd(_) => "winograd",
                },
                im2col,
                winograd,
                winograd_error,
            }
        })
        .collect()
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
