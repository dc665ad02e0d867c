//! `trainctl eval`: the seed's test job, for any model trainctl trains.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};

use trainer::data::{self, Split};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Model file (safetensors: trainctl's, the seed's PyTorch names, or a torchvision ResNet),
    /// or s3://BUCKET/KEY of one.
    #[arg(long)]
    model: PathBuf,
    /// CIFAR-10 (its test batch is used) or an image folder (its val/ images).
    #[arg(long, default_value = "./data")]
    data: PathBuf,
    /// Test images evaluated per batch (memory, not the result, depends on it).
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Download --dataset if --data holds no data set.
    #[arg(long)]
    download: bool,
    /// What --download fetches: cifar10 or tiny-imagenet.
    #[arg(long, default_value = contract::CIFAR10.name)]
    dataset: String,
    #[command(flatten)]
    mirror: super::args::Mirror,
    /// Threads decoding images.
    #[arg(long, default_value_t = 2)]
    loader_threads: usize,
    /// Also write the confusion matrix (rows: true class, columns: predicted) to FILE: a heat
    /// map if it ends in .png, the metrics file's `eval` record if .json, else CSV.
    #[arg(long, value_name = "FILE")]
    confusion_matrix: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    let model = super::s3::model_file(&args.model)?;
    let loaded = trainer::eval::load_model_file(&model.path)?;
    let dataset = super::args::parse_dataset(&args.dataset)?;
    let opts = args
        .mirror
        .options(dataset, args.download, Some("pass --download"))?;
    let mut progress = crate::output::ProgressDisplay::new(std::io::stderr().is_terminal());
    let layout = data::ensure(&args.data, dataset, &opts, &mut |p| progress.data(p))?;
    progress.finish();
    let info = &loaded.info;
    if let data::Layout::Cifar(_) = layout
        && info.image_size != 32
    {
        bail!(
            "{} takes {size}×{size} images and {} holds CIFAR-10's 32×32: evaluate it on the data set it was trained on (pass its folder with --data)",
            args.model.display(),
            args.data.display(),
            size = info.image_size,
        );
    }
    // Each image is read once: nothing to cache.
    let mut test = layout.open(Split::Eval, info.image_size, 0)?;
    if test.classes.len() != info.classes.len() {
        bail!(
            "{} has {} classes and the model {} predicts {}: evaluate it on the data set it was trained on",
            data::describe(&layout),
            test.classes.len(),
            args.model.display(),
            info.classes.len()
        );
    }
    if test.classes != info.classes {
        crate::output::warn(&format!(
            "the data's class names differ from the model's; reporting the model's ({}, ...)",
            info.classes
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
        test.classes = info.classes.clone();
    }
    // The images as the model was trained on them.
    test.normalisation = info.normalisation;
    let test = Arc::new(test);
    let all: Vec<usize> = (0..test.len()).collect();
    let mut unreadable = Vec::new();
    let mut evaluating = crate::output::Tenths::new("evaluating", "images");
    let confusion = trainer::eval::evaluate(
        &loaded.model,
        &test,
        &all,
        args.batch_size,
        args.loader_threads.max(1),
        &mut |path, problem| {
            crate::output::warn(&format!("{}: {problem}; left out", path.display()));
            unreadable.push(path.to_path_buf());
        },
        &mut |done, total| evaluating.update(done, total),
    )?;
    if let Some(path) = &args.confusion_matrix {
        write_confusion(path, &confusion)?;
    }
    crate::output::train_event(trainer::train::Event::Evaluated(Box::new(confusion)));
    if !unreadable.is_empty() {
        crate::output::warn(&format!(
            "{} unreadable images were left out of the evaluation",
            unreadable.len()
        ));
    }
    if let Some(path) = &args.confusion_matrix {
        crate::output::wrote(path);
    }
    Ok(0)
}

fn write_confusion(path: &Path, confusion: &trainer::eval::Confusion) -> anyhow::Result<()> {
    let record = trainer::train::record::eval_record(0, 0, confusion);
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("png") {
        return Ok(report::confusion_png(&record, path)?);
    }
    let text = if ext.eq_ignore_ascii_case("json") {
        serde_json::to_string_pretty(&record)? + "\n"
    } else {
        let quote = |name: &str| {
            if name.contains([',', '"']) {
                format!("\"{}\"", name.replace('"', "\"\""))
            } else {
                name.to_string()
            }
        };
        let header: Vec<String> = record.classes.iter().map(|c| quote(c)).collect();
        let mut csv = format!("true\\predicted,{}\n", header.join(","));
        for (class, row) in record.classes.iter().zip(&record.confusion) {
            let cells: Vec<String> = row.iter().map(u64::to_string).collect();
            csv.push_str(&format!("{},{}\n", quote(class), cells.join(",")));
        }
        csv
    };
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
