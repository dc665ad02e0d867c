//! `trainctl report`: charts and an HTML page from a run's metrics.

use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct Args {
    /// The run directory (OUT/RUN_ID of `trainctl train`, e.g. ./runs/local), with its
    /// metrics/ folder.
    run_dir: PathBuf,
    /// Where to write the charts and report.html (default: RUN_DIR/report).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    let out = args.out.unwrap_or_else(|| args.run_dir.join("report"));
    let written = report::write_report(&args.run_dir, &out)?;
    crate::output::report_written(&written, &out);
    Ok(0)
}
