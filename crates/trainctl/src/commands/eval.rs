//! `trainctl eval`: the seed's test job.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::Context;

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
    /// Also write the confusion matrix (rows: true class, columns: predicted) to FILE: a heat
    /// map if it ends in .png, the metrics file's `eval` record if .json, else CSV.
    #[arg(long, value_name = "FILE")]
    confusion_matrix: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let model = trainer::eval::load_model_file(&args.model)?;
    let opts = DownloadOptions {
        enabled: args.download,
        ..DownloadOptions::default()
    };
    let mut progress = crate::output::Progress::new(std::io::stderr().is_terminal());
    let test = ensure_dataset(&args.data, &opts, &mut |p| progress.data(p))?.load(Split::Test)?;
    progress.finish();
    let all: Vec<usize> = (0..test.len()).collect();
    let confusion = trainer::eval::evaluate(&model, &test, &all, args.batch_size);
    if let Some(path) = &args.confusion_matrix {
        write_confusion(path, &confusion)?;
    }
    crate::output::train_event(0, trainer::train::Event::Evaluated(Box::new(confusion)));
    if let Some(path) = &args.confusion_matrix {
        crate::output::wrote(path);
    }
    Ok(0)
}

fn write_confusion(path: &Path, confusion: &trainer::eval::Confusion) -> anyhow::Result<()> {
    let record = trainer::record::eval_record(0, 0, confusion);
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("png") {
        return Ok(report::confusion_png(&record, path)?);
    }
    let text = if ext.eq_ignore_ascii_case("json") {
        serde_json::to_string_pretty(&record)? + "\n"
    } else {
        let mut csv = format!("true\\predicted,{}\n", record.classes.join(","));
        for (class, row) in record.classes.iter().zip(&record.confusion) {
            let cells: Vec<String> = row.iter().map(u64::to_string).collect();
            csv.push_str(&format!("{class},{}\n", cells.join(",")));
        }
        csv
    };
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
