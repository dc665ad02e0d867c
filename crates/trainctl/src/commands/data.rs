//! `trainctl data`: get a data set onto disk.

use std::io::IsTerminal;
use std::path::PathBuf;

use trainer::cifar::synthetic;
use trainer::data;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Download the official archive of --dataset, check its size and MD5 and extract it,
    /// unless a data set is already there.
    Fetch {
        #[arg(long, default_value = "./data")]
        data: PathBuf,
        /// cifar10 (the binary archive) or tiny-imagenet (tiny-imagenet-200.zip).
        #[arg(long, default_value = "cifar10")]
        dataset: String,
        /// Download from here instead of the official address.
        #[arg(long)]
        download_url: Option<String>,
        /// Expected MD5 (default: the official archive's).
        #[arg(long)]
        download_md5: Option<String>,
    },
    /// In the cluster: a Job that fetches CIFAR-10 onto the shared claim (a no-op when the
    /// data is there), waits for it and prints its logs.
    Job {
        #[command(flatten)]
        project: super::project::ProjectArgs,
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
    /// Write a small synthetic data set in CIFAR-10's binary layout (for trying things out).
    Synth {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1000)]
        train: usize,
        #[arg(long, default_value_t = 200)]
        test: usize,
        /// Write the python (pickle) layout instead.
        #[arg(long)]
        python: bool,
    },
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {
        Command::Fetch {
            data,
            dataset,
            download_url,
            download_md5,
        } => {
            let dataset = super::train::parse_dataset(&dataset)?;
            let opts = super::train::download_options(dataset, true, download_url, download_md5);
            let mut progress = crate::output::Progress::new(std::io::stderr().is_terminal());
            let layout = data::ensure(&data, dataset, &opts, &mut |p| progress.data(p))?;
            progress.finish();
            println!("{} ready", data::describe(&layout));
        }
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
            python,
        } => {
            let (tr, te) = (synthetic::generate(train, 1), synthetic::generate(test, 2));
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
