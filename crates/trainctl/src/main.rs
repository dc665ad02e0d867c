//! `trainctl`: elastic data-parallel training, from a laptop to a cluster.
//!
//! Exit codes: 0 success; 1 the job failed (a worker, the data, a checkpoint...); 2 bad
//! command line; 130 interrupted (Ctrl-C or SIGTERM).

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (an index of its `mi_option_e`, which the Rust binding
/// does not name).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed memory stays with the process instead of going back to the kernel 10 ms later
/// (mimalloc's default): a training step frees and allocates the same large activations every
/// step, and memory handed back comes back as fresh pages the kernel must zero (up to a
/// quarter of a ResNet step's time; docs/PERFORMANCE.md). The footprint is the step's peak,
/// which the process reaches every step anyway.
fn keep_freed_memory() {
    // SAFETY: sets an option; mimalloc allows it at any time, from any thread.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

#[cfg(test)]
mod argv_tests;
mod commands;
mod output;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "trainctl",
    version,
    about = "Elastic data-parallel training: launcher, trainer and evaluation in one binary"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Launch workers on this node, as torchrun does (same flags, same worker environment).
    Run(commands::run::Args),
    /// Train the seed CNN on CIFAR-10, or a ResNet on an image folder (one worker; launch
    /// several with `trainctl run`).
    Train(commands::train::Args),
    /// Accuracy of a saved model on CIFAR-10's test set or an image folder's val/: top-1, top-5,
    /// per class.
    Eval(commands::eval::Args),
    /// Charts (loss, throughput, step time, per-class accuracy, confusion matrix) and one
    /// self-contained HTML page from a run's metrics.
    Report(commands::report::Args),
    /// Verify a checkpoint and show where its training stands.
    Checkpoint(commands::checkpoint::Args),
    /// Classify PNG or JPEG images with a saved model.
    Predict(commands::predict::Args),
    /// Data sets: fetch CIFAR-10 or tiny-imagenet, or write a small synthetic set.
    #[command(subcommand)]
    Data(commands::data::Command),
    /// Measure a training step and the all-reduce on this machine.
    Bench(commands::bench::Args),
    /// The project settings (trainctl.toml, TRAINCTL_*, flags).
    #[command(subcommand)]
    Config(commands::kube::ConfigCommand),
    /// EKS cluster: eksctl config for a preset, create, delete, add-ons.
    #[command(subcommand)]
    Cluster(commands::kube::ClusterCommand),
    /// Shared storage: StorageClass, PersistentVolume and ReadWriteMany claim (EFS or FSx).
    Storage(commands::kube::StorageArgs),
    /// Training jobs on Kubernetes: render, launch, status, wait, logs, top, delete.
    #[command(subcommand)]
    Job(commands::kube::JobCommand),
    /// The test job: evaluate the saved model in the cluster.
    #[command(subcommand)]
    Test(commands::kube::TestCommand),
    /// Check DNS, the rendezvous port, pod-to-pod reachability, the claim, GPUs and EFA, from
    /// inside the cluster.
    Doctor(commands::kube::DoctorArgs),
    /// TensorBoard in the cluster over the claim's runs (a Deployment and a Service).
    Tensorboard(commands::kube::TensorboardArgs),
    /// Copy this binary into DIR (the init container of pods whose image lacks trainctl).
    Install(commands::install::Args),
}

fn main() {
    keep_freed_memory();
    // kube's HTTP layer logs every 5xx answer at ERROR (a kubelet that does not answer a log
    // request) and hyper its connection errors; the Kubernetes commands report those
    // themselves, with what to do, so they show only when RUST_LOG asks.
    const DEFAULT_FILTER: &str =
        "warn,kube=off,kube_client=off,tower_http=off,hyper=off,hyper_util=off";
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: a pod's log, a file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(asked) => logs.with_env_filter(asked).init(),
        Err(_) => logs
            .with_env_filter(tracing_subscriber::EnvFilter::new(DEFAULT_FILTER))
            .event_format(output::diagnostics::Plain)
            .init(),
    }
    let cli = Cli::parse();
    if matches!(cli.command, Command::Run(_))
        && let Err(e) = launcher::record_stop_signals()
    {
        // Before anything else: a SIGTERM that comes while the agent starts (a pod deleted as
        // it comes up) must not be lost, and as a container's PID 1 it is unless handled.
        output::warn(&format!("{e}"));
    }
    if !matches!(cli.command, Command::Run(_)) {
        // `trainctl eval ... | head` ends quietly, as Unix tools do, instead of panicking on
        // EPIPE. The launcher keeps ignoring SIGPIPE: it must outlive a closed stdout long
        // enough to stop its workers.
        // SAFETY: called before any thread is spawned.
        unsafe {
            let _ = nix::sys::signal::signal(
                nix::sys::signal::Signal::SIGPIPE,
                nix::sys::signal::SigHandler::SigDfl,
            );
        }
    }
    let result = match cli.command {
        Command::Run(args) => commands::run::run(args),
        Command::Train(args) => commands::train::run(args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Predict(args) => commands::predict::run(args),
        Command::Checkpoint(args) => commands::checkpoint::run(args),
        Command::Report(args) => commands::report::run(args),
        Command::Data(cmd) => commands::data::run(cmd),
        Command::Bench(args) => commands::bench::run(args),
        Command::Config(cmd) => commands::kube::config(cmd),
        Command::Cluster(cmd) => commands::kube::cluster(cmd),
        Command::Storage(args) => commands::kube::storage(args),
        Command::Job(cmd) => commands::kube::job(cmd),
        Command::Test(cmd) => commands::kube::test(cmd),
        Command::Doctor(args) => commands::kube::doctor(args),
        Command::Tensorboard(args) => commands::kube::tensorboard(args),
        Command::Install(args) => commands::install::run(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            output::error(&e);
            std::process::exit(commands::exit_code(&e));
        }
    }
}
