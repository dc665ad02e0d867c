//! `trainctl eval`: the seed's test job.

use std::path::PathBuf;

use trainer::cifar::{DownloadOptions, Split, ensure_dataset};

#[derive(clap::Args)]
pub struct Args {
    /// Model file (safetensors with the seed's PyTorch names).
    #[arg(long)]
    model: PathBuf,
    /// CIFAR-10 directory (either official layout).
    #[arg(long, default_value = "./data")]
    data: PathBuf,
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Download the data set if it is missing.
    #[arg(long)]
    download: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let model = trainer::eval::load_model_file(&args.model)?;
    let opts = DownloadOptions {
        enabled: args.download,
        ..DownloadOptions::default()
    };
    let test = ensure_dataset(&args.data, &opts, true)?.load(Split::Test)?;
    let all: Vec<usize> = (0..test.len()).collect();
    let confusion = trainer::eval::evaluate(&model, &test, &all, args.batch_size);
    crate::output::train_event(0, trainer::train::Event::Evaluated(Box::new(confusion)));
    Ok(0)
}
