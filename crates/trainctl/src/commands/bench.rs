//! `trainctl bench`: training-step and all-reduce figures for docs/PERFORMANCE.md.
//!
//! The CPU thread pool can be sized once per process, so each thread count runs in a child
//! `trainctl bench --step-only`.

use std::process::Command;

use anyhow::{Context, bail};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Thread counts to time a training step with.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2])]
    threads: Vec<usize>,
    /// Images per timed training step (and per batch of the loader benchmark).
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// The network whose step is timed: seed-cnn, resnet18, resnet34, resnet50 or resnet101.
    #[arg(long, default_value_t, value_parser = super::args::choice::<contract::choices::Model>())]
    model: contract::choices::Model,
    /// Image side in pixels (the seed CNN: 32 only; the ResNets: 32 or more).
    #[arg(long, default_value_t = 32)]
    image_size: usize,
    /// Timed steps per thread count; the figure is their median.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps before them: a process's memory grows through its first few steps, and
    /// the pages it touches first cost it time once (bench/pytorch_step.py --warmup runs as
    /// many for PyTorch).
    #[arg(long, default_value_t = trainer::bench::WARMUP_STEPS)]
    warmup: usize,
    /// World sizes for the all-reduce.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4])]
    ranks: Vec<usize>,
    /// Megabytes a joiner's state stream broadcasts (timed at each --ranks world size after
    /// the all-reduce); 0 skips it. resnet18's weights and momentum are about 90.
    #[arg(long, default_value_t = 0)]
    state_mb: usize,
    /// Timed all-reduces (and loopback copies) per world size; the figure is their median.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
    /// Time each layer instead: for the seed CNN each convolution alone by each algorithm
    /// (forward, backward, GFLOP/s) at 1 thread; for a ResNet each operation and shape inside
    /// its training steps, at each --threads count, a convolution's GFLOP/s counted both as the
    /// direct algorithm's arithmetic and as the arithmetic its own algorithm executes (to set
    /// against the peak of --gemm), then the passes inside each kernel (a Winograd layer's
    /// transforms, products and weight transforms; a direct layer's weight layout, products and
    /// gradients; an im2col layer's weight layout, patches, products and gradients), ms a step
    /// each.
    #[arg(long)]
    layers: bool,
    /// Time the data loader alone instead, on the training images of this data set (CIFAR-10
    /// or an image folder): images/s decoding every image, then from the cache, at each
    /// --threads count of decoding threads.
    #[arg(long, value_name = "DIR")]
    loader: Option<std::path::PathBuf>,
    /// Batches the loader benchmark prepares.
    #[arg(long, default_value_t = 100)]
    batches: usize,
    /// Augmentation of the loader benchmark: none, crop or resized-crop.
    #[arg(long, default_value = "crop")]
    augment: String,
    /// The convolutions' arithmetic of the timed step and of --layers: fp32, or bf16 (inputs
    /// rounded to bf16, sums in fp32, as PyTorch's CPU autocast; needs AVX512_BF16). --gemm
    /// times both.
    #[arg(long, default_value_t, value_parser = super::args::choice::<kernels::Precision>())]
    precision: kernels::Precision,
    /// Time the GEMM alone instead, on the shapes of resnet18's and resnet50's convolutions at
    /// --batch-size 32 and 64×64 images, one thread, fp32 and bf16 (where the CPU has it), with
    /// this machine's measured multiply-add peak per core.
    #[arg(long)]
    gemm: bool,
    /// Internal: time the step in this process with this many threads.
    #[arg(long, hide = true)]
    step_only: Option<usize>,
}

/// Counts that must be at least 1: a benchmark of nothing has no figure to print.
fn check(args: &Args) -> anyhow::Result<()> {
    let counts = [
        ("--batch-size", args.batch_size),
        ("--steps", args.steps),
        ("--repeats", args.repeats),
        ("--image-size", args.image_size),
    ];
    for (flag, value) in counts {
        if value == 0 {
            bail!("{flag} 0: must be at least 1");
        }
    }
    if let Some(zero) = args.threads.iter().chain(&args.ranks).find(|&&n| n == 0) {
        bail!("--threads and --ranks take counts of at least 1, got {zero}");
    }
    Ok(())
}

/// What one `trainctl bench` times, read from its flags in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `--gemm`: the GEMM alone against the core's peak.
    Gemm,
    /// `--loader DIR`: the data loader alone.
    Loader,
    /// `--layers` with the seed CNN: each convolution alone by each algorithm, one thread.
    SeedCnnLayers,
    /// `--step-only T` (a child of [`Mode::Steps`]): one thread count's step in this process,
    /// or its layer profile with `--layers`.
    StepHere(usize),
    /// The default: each `--threads` count's step in a child (a process sizes its thread
    /// pool once), then the all-reduce and the loopback copy; with `--layers` (a ResNet),
    /// each child's layer profile and then each convolution alone.
    Steps,
}

impl Mode {
    fn of(args: &Args, model: trainer::model::Architecture) -> Mode {
        if args.gemm {
            Mode::Gemm
        } else if args.loader.is_some() {
            Mode::Loader
        } else if let Some(threads) = args.step_only {
            Mode::StepHere(threads)
        } else if args.layers && model == trainer::model::Architecture::SeedCnn {
            Mode::SeedCnnLayers
        } else {
            Mode::Steps
        }
    }
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    check(&args).map_err(super::usage)?;
    trainer::device::set_precision(args.precision).map_err(|e| super::usage(anyhow::anyhow!(e)))?;
    let model = trainer::model::Architecture::from(args.model);
    let mode = Mode::of(&args, model);
    if !matches!(mode, Mode::Gemm | Mode::Loader)
        && let Err(problem) = model.check_image_size(args.image_size)
    {
        bail!("--image-size {}: {problem}", args.image_size);
    }
    match mode {
        Mode::Gemm => print_lines(kernels::bench::gemm_report(args.steps))?,
        Mode::Loader => loader(&args)?,
        Mode::SeedCnnLayers => {
            let layers = kernels::bench::seed_cnn_layers(args.batch_size);
            print_lines(kernels::bench::conv_layers(
                1,
                &layers,
                args.steps,
                args.precision,
            ))?;
        }
        Mode::StepHere(threads) => step_here(&args, model, threads)?,
        Mode::Steps => {
            let layers = steps_in_children(&args, model)?;
            if args.layers {
                // Each convolution of the step alone, by each algorithm: what the choice
                // rests on.
                print_lines(kernels::bench::conv_layers(
                    1,
                    &layers,
                    args.steps,
                    args.precision,
                ))?;
            } else {
                collective(&args)?;
            }
        }
    }
    Ok(0)
}

/// Each item as a line of JSON.
fn print_lines<T: serde::Serialize>(items: impl IntoIterator<Item = T>) -> anyhow::Result<()> {
    for item in items {
        println!("{}", serde_json::to_string(&item)?);
    }
    Ok(())
}

/// The data loader alone, at each `--threads` count of decoding threads.
fn loader(args: &Args) -> anyhow::Result<()> {
    let Some(dir) = &args.loader else {
        return Ok(());
    };
    let Some(augment) = trainer::data::Augment::parse(&args.augment) else {
        bail!(
            "--augment {:?}: choose {}",
            args.augment,
            trainer::data::Augment::CHOICES
        );
    };
    for threads in &args.threads {
        let t = trainer::bench::loader(
            dir,
            args.image_size,
            augment,
            *threads,
            args.batch_size,
            args.batches,
        )?;
        print_lines([t])?;
    }
    Ok(())
}

/// One thread count's training step in this process: its time, or with `--layers` its
/// operations' and passes' times.
fn step_here(
    args: &Args,
    model: trainer::model::Architecture,
    threads: usize,
) -> anyhow::Result<()> {
    let (size, batch, steps, warmup) = (args.image_size, args.batch_size, args.steps, args.warmup);
    if args.layers {
        let (step, rows, phases) =
            trainer::bench::layer_profile(model, size, threads, batch, steps, warmup);
        print_lines([step])?;
        print_lines(rows)?;
        print_lines(phases)
    } else {
        let t = trainer::bench::training_step(model, size, threads, batch, steps, warmup);
        print_lines([t])
    }
}

/// Each `--threads` count's step in a child `trainctl bench --step-only T`, its lines passed
/// on; with `--layers`, the convolutions the first child's profile names.
fn steps_in_children(
    args: &Args,
    model: trainer::model::Architecture,
) -> anyhow::Result<Vec<(String, kernels::conv::ConvShape)>> {
    let exe = std::env::current_exe().context("cannot find the trainctl executable")?;
    let mut layers = Vec::new();
    for threads in &args.threads {
        let out = Command::new(&exe)
            .args([
                "bench",
                "--step-only",
                &threads.to_string(),
                "--batch-size",
                &args.batch_size.to_string(),
                "--steps",
                &args.steps.to_string(),
                "--warmup",
                &args.warmup.to_string(),
                "--model",
                model.name(),
                "--image-size",
                &args.image_size.to_string(),
                "--precision",
                args.precision.name(),
            ])
            .args(args.layers.then_some("--layers"))
            .output()?;
        if !out.status.success() {
            bail!(
                "step benchmark with {threads} threads failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        print!("{stdout}");
        if args.layers && layers.is_empty() {
            layers = conv_shapes(&stdout);
        }
    }
    Ok(layers)
}

/// The seed CNN's gradients all-reduced at each `--ranks` world size, a joiner's state stream
/// (`--state-mb`), and a loopback copy of the same bytes.
fn collective(args: &Args) -> anyhow::Result<()> {
    let floats = trainer::model::snapshot(&trainer::model::SeedCnn::new(
        10,
        &trainer::device::inference_device(),
    ))
    .params
    .len();
    for ranks in &args.ranks {
        print_lines([collective::bench::all_reduce(*ranks, floats, args.repeats)?])?;
    }
    if args.state_mb > 0 {
        for ranks in &args.ranks {
            let t = collective::bench::broadcast(*ranks, args.state_mb << 20, args.repeats)?;
            print_lines([t])?;
        }
    }
    let copy = collective::bench::loopback_copy(floats * 4, args.repeats)?;
    print_lines([
        serde_json::json!({ "loopback_tcp_copy_bytes": floats * 4, "gbytes_per_s": copy }),
    ])
}

/// The convolutions in a layer profile's lines (`trainer::bench::OpRow`), named by the profile.
fn conv_shapes(profile: &str) -> Vec<(String, kernels::conv::ConvShape)> {
    profile
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|row| {
            let shape = serde_json::from_value(row.get("conv")?.clone()).ok()?;
            Some((row.get("op")?.as_str()?.to_string(), shape))
        })
        .collect()
}
