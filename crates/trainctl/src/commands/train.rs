//! `trainctl train`: one data-parallel worker (the seed job's `cifar10.py`, in Rust, and the
//! torchelastic ImageNet example's ResNets on image folders).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, bail};
use contract::choices::{Model, Precision};

use collective::{CollectiveError, World};

use super::args::{Mirror, choice, parse_dataset};
use trainer::TrainError;
use trainer::data::Augment;
use trainer::model::Architecture;
use trainer::train::{Event, TrainConfig};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// The network: seed-cnn, resnet18, resnet34, resnet50 or resnet101 (torchvision's).
    #[arg(long, default_value_t, value_parser = choice::<Model>())]
    pub(crate) model: Model,
    /// The data: CIFAR-10 (either official layout) or an image folder (train/CLASS/*.jpg and
    /// val/CLASS/..., or tiny-imagenet-200's layout). --dataset is downloaded here if it holds
    /// neither.
    #[arg(long, default_value = "./data")]
    pub(crate) data: PathBuf,
    /// What to download into --data when it holds no data set: cifar10 or tiny-imagenet.
    #[arg(long, default_value = contract::CIFAR10.name)]
    pub(crate) dataset: String,
    /// Side of the square training images (default: 32 for CIFAR-10, 64 for image folders,
    /// which are resized on the shorter side and centre-cropped to it).
    #[arg(long)]
    pub(crate) image_size: Option<usize>,
    /// Training augmentation: none, crop (pad an eighth, random crop, flip) or resized-crop
    /// (torchvision's RandomResizedCrop and flip). Default: none for CIFAR-10 (the seed's
    /// transforms), crop for image folders.
    #[arg(long)]
    pub(crate) augment: Option<String>,
    /// Threads decoding and augmenting images, beside the training threads.
    #[arg(long, default_value_t = 2)]
    pub(crate) loader_threads: usize,
    /// Batches prepared ahead of the one being trained on.
    #[arg(long, default_value_t = 4)]
    pub(crate) prefetch: usize,
    /// Decoded training images kept in memory by each worker, in MiB (tiny-imagenet's
    /// training set is about 1,200 MiB at 64×64).
    #[arg(long, default_value_t = 2048)]
    pub(crate) cache_mb: u64,
    /// Passes over the training set (a resumed run trains up to this many in all).
    #[arg(long, default_value = contract::train_defaults::EPOCHS)]
    pub(crate) epochs: usize,
    /// Images per step on each worker.
    #[arg(long, default_value = contract::train_defaults::BATCH_SIZE)]
    pub(crate) batch_size: usize,
    /// SGD's learning rate (a positive number).
    #[arg(
        long,
        alias = "lr",
        default_value = contract::train_defaults::LEARNING_RATE,
        allow_negative_numbers = true
    )]
    pub(crate) learning_rate: f64,
    /// SGD's momentum, from 0 (none) to below 1.
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub(crate) momentum: f64,
    /// SGD's L2 weight decay (0 for none).
    #[arg(long, default_value_t = 1e-4, allow_negative_numbers = true)]
    pub(crate) weight_decay: f64,
    /// Print the mean loss every this many steps.
    #[arg(long, default_value_t = 10)]
    pub(crate) print_freq: usize,
    /// Final model (safetensors, PyTorch names). Default: OUT/RUN_ID/model.safetensors.
    #[arg(long)]
    pub(crate) model_file: Option<PathBuf>,
    /// Checkpoint to resume from and write to. Default: OUT/RUN_ID/checkpoint.ckpt.
    #[arg(long)]
    pub(crate) checkpoint_file: Option<PathBuf>,
    /// Where runs write their files: OUT/RUN_ID/ holds the checkpoint, the model, the metrics
    /// (metrics/rank-N.jsonl) and TensorBoard's events (tensorboard/). RUN_ID is the launcher's
    /// --rdzv-id; a lone `trainctl train` and a one-node `trainctl run` use `local`.
    #[arg(long, default_value = "./runs")]
    pub(crate) out: PathBuf,
    /// Also checkpoint every this many steps (besides every epoch end).
    #[arg(long)]
    pub(crate) checkpoint_every: Option<u64>,
    /// A node is a straggler when its slowest rank takes more than this many times the other
    /// nodes' median time per step (waiting for data and computing, before the all-reduce)...
    #[arg(long, default_value_t = 1.5, allow_negative_numbers = true)]
    pub(crate) straggler_factor: f64,
    /// ...on average over this many steps, its slowest quarter of them left out (0: do not
    /// look for stragglers). `trainctl run --stragglers evict` drops such a node.
    #[arg(long, default_value_t = 5)]
    pub(crate) straggler_window: usize,
    /// The convolutions' arithmetic: fp32, or bf16 (their inputs rounded to bf16 and summed in
    /// fp32, as PyTorch's CPU autocast does; weights, gradients, the optimizer, batch norm,
    /// checkpoints and the model file stay fp32). bf16 needs a CPU with AVX512_BF16.
    #[arg(long, default_value_t, value_parser = choice::<Precision>())]
    pub(crate) precision: Precision,
    /// Seed of the initial weights and of the shuffling.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// CPU threads of this worker (default: cores / workers on this node).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Fail instead of downloading when the data is missing.
    #[arg(long)]
    pub(crate) no_download: bool,
    #[command(flatten)]
    pub(crate) mirror: Mirror,
    /// When the checkpoint holds a finished run, train again from scratch (its checkpoint and
    /// model are replaced) instead of refusing.
    #[arg(long)]
    pub(crate) train_again: bool,
    /// Skip the test-set evaluation at the end.
    #[arg(long)]
    pub(crate) no_eval: bool,
    /// When training ends, rank 0 uploads the model, the checkpoint and the run's report,
    /// metrics and TensorBoard events under this prefix (s3://BUCKET/PREFIX). A failed upload
    /// is retried, then reported; it never fails the run, and the local files stay.
    #[arg(long, value_name = "S3_URI")]
    pub(crate) upload: Option<String>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    check(&args).map_err(super::usage)?;
    let world = World::from_env()?;
    // SIGTERM (the launcher stopping us, an eviction, `job delete`) finishes the step in
    // progress and checkpoints it instead of losing the work since the last checkpoint.
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))
        .context("cannot install the SIGTERM handler")?;
    let run_dir = args.out.join(&world.run_id);
    let dataset = parse_dataset(&args.dataset)?;
    let upload = upload_target(args.upload.as_deref(), world.rank)?;
    // Checked before training, not after an epoch: the run's folder takes its files. (After
    // the checks above, which must leave nothing behind.)
    check_writable(&run_dir, world.rank)?;
    let cfg = TrainConfig {
        model: Architecture::from(args.model),
        data: args.data,
        dataset,
        download: args
            .mirror
            .options(dataset, !args.no_download, Some("drop --no-download"))?,
        image_size: args.image_size,
        augment: args
            .augment
            .as_deref()
            .map(|a| {
                Augment::parse(a)
                    .with_context(|| format!("--augment {a:?}: choose {}", Augment::CHOICES))
            })
            .transpose()?,
        loader_threads: args.loader_threads.max(1),
        prefetch: args.prefetch.max(1),
        cache_bytes: args.cache_mb.saturating_mul(1 << 20),
        epochs: args.epochs,
        batch_size: args.batch_size,
        learning_rate: args.learning_rate,
        momentum: args.momentum,
        weight_decay: args.weight_decay,
        print_freq: args.print_freq,
        model_file: args
            .model_file
            .unwrap_or_else(|| run_dir.join(contract::run_files::MODEL)),
        checkpoint_file: args
            .checkpoint_file
            .unwrap_or_else(|| run_dir.join(contract::run_files::CHECKPOINT)),
        checkpoint_every: args.checkpoint_every,
        seed: args.seed,
        threads: args
            .threads
            .unwrap_or_else(|| trainer::device::default_threads(world.local_world_size as usize)),
        evaluate: !args.no_eval,
        run_dir,
        train_again: args.train_again,
        stop,
        precision: args.precision,
        stragglers: (args.straggler_window > 0).then_some(
            trainer::train::stragglers::StragglerConfig {
                factor: args.straggler_factor,
                window: args.straggler_window,
            },
        ),
    };
    let rank = world.rank;
    let mut progress = crate::output::ProgressDisplay::new(std::io::stderr().is_terminal());
    let result = trainer::train::train(&cfg, &world, &mut |event| {
        match &event {
            Event::Step(s) => progress.step(s),
            Event::Data(p) => progress.data(p.clone()),
            _ => {}
        }
        crate::output::train_event(event)
    });
    progress.finish();
    if result.is_ok()
        && let Some((client, to)) = upload
    {
        upload_run(&client, &cfg, &to);
    }
    exit_code(result, rank)
}

/// Where rank 0 uploads the run (`--upload`), checked before training, not hours later: the
/// URI, and that there are credentials. The other ranks check the URI alone.
fn upload_target(
    upload: Option<&str>,
    rank: u32,
) -> anyhow::Result<Option<(objects::Client, objects::S3Uri)>> {
    match (upload, rank) {
        (Some(text), 0) => {
            let to = super::s3::parse_uri("--upload", text)?;
            let client = super::s3::client()?;
            client.preflight(&to)?;
            Ok(Some((client, to)))
        }
        (Some(text), _) => {
            super::s3::parse_uri("--upload", text)?;
            Ok(None)
        }
        (None, _) => Ok(None),
    }
}

/// The worker's exit code for how training ended.
fn exit_code(result: Result<(), TrainError>, rank: u32) -> anyhow::Result<i32> {
    match result {
        Ok(()) => Ok(0),
        // A vanished peer is that peer's failure: say so with the exit code, so an elastic
        // agent restarts without counting it against --max-restarts.
        Err(e @ TrainError::Collective(CollectiveError::PeerLost(_))) => {
            crate::output::error(&anyhow::Error::new(e));
            Ok(contract::exit::PEER_LOST)
        }
        // Its node leaves the job: the agent says so for the node, once.
        Err(TrainError::Left { .. }) => Ok(contract::exit::PREEMPTED),
        Err(e @ TrainError::Preempted { .. }) => {
            if rank == 0 {
                crate::output::warn(&format!("{e}: {}", crate::output::resume_hint()));
            }
            Ok(contract::exit::PREEMPTED)
        }
        Err(e) => Err(e.into()),
    }
}

/// Rank 0's uploads at the end of a successful run: the report is drawn first so that it goes
/// up too. Failures are warnings: the run has succeeded and every file is still on disk.
fn upload_run(client: &objects::Client, cfg: &TrainConfig, to: &objects::S3Uri) {
    let report_dir = cfg.run_dir.join("report");
    if let Err(e) = report::write_report(&cfg.run_dir, &report_dir) {
        crate::output::warn(&format!("no report to upload: {e:#}"));
    }
    let files = super::s3::run_files(&cfg.run_dir, &cfg.model_file, &cfg.checkpoint_file);
    let not_uploaded = super::s3::upload_all(client, &files, to);
    for (path, uri, err) in &not_uploaded.failed {
        crate::output::upload_failed(path, uri, err);
    }
    if !not_uploaded.not_tried.is_empty() {
        crate::output::uploads_not_tried(&not_uploaded.not_tried, to);
    }
}

/// The checks of `args` that need nothing but the command line: run by the worker before it
/// starts, and by `trainctl run` before it starts any worker (so a typo fails once, exit 2).
pub(crate) fn check(args: &Args) -> anyhow::Result<()> {
    parse_dataset(&args.dataset)?;
    if let Some(a) = &args.augment {
        Augment::parse(a)
            .with_context(|| format!("--augment {a:?}: choose {}", Augment::CHOICES))?;
    }
    for (flag, value) in [
        ("--epochs", args.epochs),
        ("--loader-threads", args.loader_threads),
        ("--prefetch", args.prefetch),
    ] {
        if value == 0 {
            bail!("{flag} 0: must be at least 1");
        }
    }
    if args.threads == Some(0) {
        bail!("--threads 0: must be at least 1 (leave it out for cores / workers on this node)");
    }
    if args.image_size == Some(0) {
        bail!("--image-size 0: must be at least 1 (leave it out for the data set's default)");
    }
    trainer::train::check_sgd(
        args.batch_size,
        args.learning_rate,
        args.momentum,
        args.weight_decay,
    )?;
    trainer::train::check_stragglers(args.straggler_factor, args.straggler_window)?;
    trainer::device::check_precision(args.precision, kernels::available(args.precision))
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// Whether `dir` (the run's folder: checkpoint, model, metrics) can be written, by making it
/// and a file in it (removed at once); rank `rank`'s own probe file, so ranks do not race.
fn check_writable(dir: &std::path::Path, rank: u32) -> anyhow::Result<()> {
    let probe = dir.join(format!(
        ".trainctl-write-test-{rank}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&probe, b""))
        .and_then(|()| std::fs::remove_file(&probe))
        .with_context(|| {
            format!(
                "cannot write the run's files (checkpoint, model, metrics) to {}: pass a writable folder with --out",
                dir.display()
            )
        })
}

/// `trainctl train ARGS...` as `trainctl run` was given it: parsed and checked as the worker
/// will, before any worker starts. Clap's own refusal is printed as clap prints it.
pub(crate) fn check_argv(argv: &[std::ffi::OsString]) -> anyhow::Result<()> {
    #[derive(clap::Parser)]
    #[command(name = "trainctl train", no_binary_name = true)]
    struct Train {
        #[command(flatten)]
        args: Args,
    }
    let parsed = <Train as clap::Parser>::try_parse_from(argv.iter().skip(1)).map_err(|e| {
        let text = e.render().to_string();
        anyhow::anyhow!("{}", text.trim_start_matches("error: ").trim_end())
    })?;
    check(&parsed.args)
}
