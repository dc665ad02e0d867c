//! `trainctl predict`: classify images.

use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Model file (safetensors: trainctl's, the seed's PyTorch names, or a torchvision ResNet),
    /// or s3://BUCKET/KEY of one.
    #[arg(long)]
    model: PathBuf,
    /// PNG or JPEG images of any size (resized on the shorter side to the model's image size
    /// and centre-cropped).
    #[arg(required = true)]
    images: Vec<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<i32> {
    let model = super::s3::model_file(&args.model)?;
    let loaded = trainer::eval::load_model_file(&model.path)?;
    let paths: Vec<&std::path::Path> = args.images.iter().map(|p| p.as_path()).collect();
    for (path, prediction) in args
        .images
        .iter()
        .zip(trainer::eval::predict(&loaded, &paths)?)
    {
        let top: Vec<String> = prediction
            .top
            .iter()
            .take(3)
            .map(|(c, p)| format!("{c} {:.1} %", p * 100.0))
            .collect();
        println!(
            "{}: {} ({})",
            path.display(),
            prediction.top[0].0,
            top.join(", ")
        );
    }
    Ok(0)
}
