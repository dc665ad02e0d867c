//! `trainctl train`: one data-parallel worker (the seed job's `cifar10.py`, in Rust).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;

use collective::{CollectiveError, World};
use trainer::TrainError;
use trainer::cifar::DownloadOptions;
use trainer::train::{Event, TrainConfig};

#[derive(clap::Args)]
pub struct Args {
    /// CIFAR-10 directory (either official layout); downloaded there if missing.
    #[arg(long, default_value = "./data")]
    data: PathBuf,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Images per step on each worker.
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    #[arg(long, alias = "lr", default_value_t = 1e-3)]
    learning_rate: f64,
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    #[arg(long, default_value_t = 1e-4)]
    weight_decay: f64,
    /// Print the mean loss every this many steps.
    #[arg(long, default_value_t = 10)]
    print_freq: usize,
    /// Final model (safetensors, PyTorch names). Default: OUT/RUN_ID/model.safetensors.
    #[arg(long)]
    model_file: Option<PathBuf>,
    /// Checkpoint to resume from and write to. Default: OUT/RUN_ID/checkpoint.ckpt.
    #[arg(long)]
    checkpoint_file: Option<PathBuf>,
    /// Where runs write their files: OUT/RUN_ID/ holds the checkpoint, the model, the metrics
    /// (metrics/rank-N.jsonl) and TensorBoard's events (tensorboard/).
    #[arg(long, default_value = "./runs")]
    out: PathBuf,
    /// Also checkpoint every this many steps (besides every epoch end).
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Seed of the initial weights and of the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// CPU threads of this worker (default: cores / workers on this node).
    #[arg(long)]
    threads: Option<usize>,
    /// Fail instead of downloading when the data is missing.
    #[arg(long)]
    no_download: bool,
    #[arg(long, default_value = trainer::cifar::OFFICIAL_URL)]
    download_url: String,
    /// Expected MD5 of the downloaded archive.
    #[arg(long, default_value = trainer::cifar::OFFICIAL_MD5)]
    download_md5: String,
    /// Skip the test-set evaluation at the end.
    #[arg(long)]
    no_eval: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let world = World::from_env()?;
    // SIGTERM (the launcher stopping us, an eviction, `job delete`) finishes the step in
    // progress and checkpoints it instead of losing the work since the last checkpoint.
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))
        .context("cannot install the SIGTERM handler")?;
    let run_dir = args.out.join(&world.run_id);
    let cfg = TrainConfig {
        data: args.data,
        download: DownloadOptions {
            enabled: !args.no_download,
            url: args.download_url,
            md5: args.download_md5,
        },
        epochs: args.epochs,
        batch_size: args.batch_size,
        learning_rate: args.learning_rate,
        momentum: args.momentum,
        weight_decay: args.weight_decay,
        print_freq: args.print_freq,
        model_file: args
            .model_file
            .unwrap_or_else(|| run_dir.join("model.safetensors")),
        checkpoint_file: args
            .checkpoint_file
            .unwrap_or_else(|| run_dir.join("checkpoint.ckpt")),
        checkpoint_every: args.checkpoint_every,
        seed: args.seed,
        threads: args
            .threads
            .unwrap_or_else(|| trainer::device::default_threads(world.local_world_size as usize)),
        evaluate: !args.no_eval,
        run_dir,
        stop,
    };
    let rank = world.rank;
    let mut progress = crate::output::Progress::new(std::io::stderr().is_terminal());
    let result = trainer::train::train(&cfg, &world, &mut |event| {
        match &event {
            Event::Step(s) => progress.step(s),
            Event::Data(p) => progress.data(*p),
            _ => {}
        }
        crate::output::train_event(rank, event)
    });
    progress.finish();
    match result {
        Ok(()) => Ok(0),
        // A vanished peer is that peer's failure: say so with the exit code, so an elastic
        // agent restarts without counting it against --max-restarts.
        Err(e @ TrainError::Collective(CollectiveError::PeerLost(_))) => {
            crate::output::error(&anyhow::Error::new(e));
            Ok(collective::EXIT_PEER_LOST)
        }
        Err(e @ TrainError::Preempted { .. }) => {
            if rank == 0 {
                crate::output::warn(&e.to_string());
            }
            Ok(collective::EXIT_PREEMPTED)
        }
        Err(e) => Err(e.into()),
    }
}
