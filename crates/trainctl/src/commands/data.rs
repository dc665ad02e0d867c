//! `trainctl data`: get a data set onto disk.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;

use trainer::data;
use trainer::data::synthetic;

#[derive(clap::Subcommand)]
pub(crate) enum Command {
    /// Download the official archive of --dataset, check its size and MD5 and extract it,
    /// unless a data set is already there.
    Fetch {
        /// The folder the data set is extracted into (created if missing); a data set
        /// already there is kept.
        #[arg(long, default_value = "./data")]
        data: PathBuf,
        /// cifar10 (the binary archive) or tiny-imagenet (tiny-imagenet-200.zip).
        #[arg(long, default_value = contract::CIFAR10.name)]
        dataset: String,
        #[command(flatten)]
        mirror: super::args::Mirror,
    },
    /// Copy every object under an S3 prefix (or the one object a URI names) into DIR, several
    /// at a time; files already there with the object's size and checksum are skipped, so an
    /// interrupted copy resumes. Credentials, region and endpoint from AWS_* (AWS_ENDPOINT_URL
    /// for S3-compatible stores).
    Stage {
        /// s3://BUCKET/PREFIX
        from: String,
        /// The destination folder (created if missing).
        dir: PathBuf,
        /// Files copied at once.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Leave an official archive (cifar-10-binary.tar.gz, tiny-imagenet-200.zip) that the
        /// copy brought as it is, instead of checking and extracting it.
        #[arg(long)]
        no_extract: bool,
    },
    /// In the cluster: a Job that fetches the data set onto the shared claim (a no-op when
    /// the data is there), or stages it from S3 (--from s3://BUCKET/PREFIX), waits for it and
    /// prints its logs.
    Job {
        #[command(flatten)]
        project: super::project::ProjectArgs<super::project::uses::DataJob>,
        /// Print the Job instead of creating it.
        #[arg(long)]
        dry_run: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, default_value_t = 3600.0)]
        timeout: f64,
        /// Write a generated set of this many training images instead of downloading
        /// (to try a cluster out).
        #[arg(long, value_name = "IMAGES")]
        synthetic: Option<u32>,
    },
    /// Write a small generated data set with learnable classes (for trying things out): in
    /// CIFAR-10's binary layout, or as an image folder of JPEGs.
    Synth {
        /// The folder the data set is written into (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Training images (all classes together).
        #[arg(long, default_value_t = 1000)]
        train: usize,
        /// Test (validation) images.
        #[arg(long, default_value_t = 200)]
        test: usize,
        /// Write CIFAR-10's python (pickle) layout instead.
        #[arg(long)]
        python: bool,
        /// Write an image folder (train/CLASS/*.jpg, val/CLASS/*.jpg) instead.
        #[arg(long, conflicts_with = "python")]
        folder: bool,
        /// Write tiny-imagenet-200's layout instead.
        #[arg(long, conflicts_with_all = ["python", "folder"])]
        tiny: bool,
        /// Classes of an image folder.
        #[arg(long, default_value_t = 10)]
        classes: usize,
        /// Side of an image folder's images.
        #[arg(long, default_value_t = 64)]
        image_size: u32,
    },
}

pub(crate) fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {
        Command::Fetch {
            data,
            dataset,
            mirror,
        } => {
            let dataset = super::args::parse_dataset(&dataset)?;
            let opts = mirror.options(dataset, true, None)?;
            let mut progress = crate::output::ProgressDisplay::new(std::io::stderr().is_terminal());
            let layout = data::ensure(&data, dataset, &opts, &mut |p| progress.data(p))?;
            progress.finish();
            println!("{} ready", data::describe(&layout));
        }
        Command::Stage {
            from,
            dir,
            concurrency,
            no_extract,
        } => stage(&from, &dir, concurrency, no_extract)?,
        Command::Job {
            project,
            dry_run,
            timeout,
            synthetic,
        } => return super::kube::data_job(project, dry_run, timeout, synthetic),
        Command::Synth {
            out,
            train,
            test,
            python: _,
            folder,
            tiny,
            classes,
            image_size,
        } if folder || tiny => {
            if classes == 0 || image_size < 2 {
                anyhow::bail!(
                    "--classes {classes} --image-size {image_size}: need at least one class and 2 pixels"
                );
            }
            let spec = data::synthetic::FolderSpec {
                classes,
                train_per_class: train.div_ceil(classes),
                val_per_class: test.div_ceil(classes),
                size: image_size,
                tiny_layout: tiny,
                seed: 1,
            };
            data::synthetic::write_folder(&out, &spec)?;
            println!(
                "wrote {} training and {} validation images of {classes} classes to {}",
                spec.train_per_class * classes,
                spec.val_per_class * classes,
                out.display()
            );
        }
        Command::Synth {
            out,
            train,
            test,
            python,
            ..
        } => {
            let (tr, te) = (synthetic::cifar(train, 1), synthetic::cifar(test, 2));
            if python {
                synthetic::write_python(&out, &tr, &te)?;
            } else {
                synthetic::write_binary(&out, &tr, &te)?;
            }
            println!(
                "wrote {train} training and {test} test images to {}",
                out.display()
            );
        }
    }
    Ok(0)
}

/// `data stage`: an S3 prefix copied to `dir`, and a data set's official archive among what
/// came extracted once here rather than by every worker that finds it.
fn stage(
    from: &str,
    dir: &std::path::Path,
    concurrency: usize,
    no_extract: bool,
) -> anyhow::Result<()> {
    let from = super::s3::parse_uri("data stage", from)?;
    let client = objects::Client::from_env(objects::Settings {
        concurrency: concurrency.max(1),
        ..Default::default()
    })?;
    let summary = super::s3::stage(&client, &from, dir)?;
    crate::output::staged(&from, dir, &summary, false);
    // The data set's official archive, as the seed tutorials keep it in S3: extracted
    // once here rather than by every worker that finds it.
    let archive = data::DatasetName::ALL
        .into_iter()
        .find(|d| dir.join(d.archive_file()).is_file());
    if let (Some(dataset), None, false) = (archive, data::Layout::locate(dir), no_extract) {
        // Its archive is there: nothing to download.
        let opts = data::DownloadOptions {
            enabled: false,
            ..dataset.official()
        };
        let mut progress = crate::output::ProgressDisplay::new(std::io::stderr().is_terminal());
        let layout = data::ensure(dir, dataset, &opts, &mut |p| progress.data(p)).context(
            "the staged archive was not extracted (pass --no-extract to keep it as it is)",
        )?;
        progress.finish();
        println!("{} ready", data::describe(&layout));
    }
    Ok(())
}
