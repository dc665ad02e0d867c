//! `trainctl checkpoint`: verify a checkpoint and show where its training stands.

use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct Args {
    /// The checkpoint (e.g. runs/RUN_ID/checkpoint.ckpt).
    path: PathBuf,
    /// Print the progress as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    let progress = trainer::checkpoint::inspect_checkpoint(&args.path)?;
    crate::output::checkpoint(&args.path, &progress, args.json);
    Ok(0)
}
