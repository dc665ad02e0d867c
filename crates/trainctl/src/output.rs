//! Everything trainctl prints for the user goes through here.

use trainer::train::Event;

pub fn error(e: &anyhow::Error) {
    eprintln!("error: {e:#}");
}

pub fn warn(msg: &str) {
    eprintln!("warning: {msg}");
}

pub fn launching(spec: &launcher::LaunchSpec) {
    eprintln!(
        "trainctl run: run id {}, {} worker(s) on this node, world size {}, store at {}:{}",
        spec.run_id,
        spec.nproc_per_node,
        spec.nnodes * spec.nproc_per_node,
        spec.master_addr,
        spec.master_port
    );
}

pub fn launch_event(event: launcher::LaunchEvent) {
    match event {
        launcher::LaunchEvent::Started(w) => {
            eprintln!("trainctl run: started rank {} (pid {})", w.rank, w.pid)
        }
        launcher::LaunchEvent::Restarting {
            failure,
            restart_count,
        } => eprintln!(
            "trainctl run: rank {} (pid {}) failed with {}; restarting all workers (restart {restart_count})",
            failure.rank, failure.pid, failure.exit
        ),
    }
}

/// Prints a training event the way the seed jobs print theirs.
pub fn train_event(rank: u32, event: trainer::train::Event) {
    match event {
        Event::Resumed {
            epoch,
            position,
            global_step,
            saved_world_size,
        } => println!(
            "resuming from checkpoint: epoch {}, {position} samples into it, step {global_step} (saved at world size {saved_world_size})",
            epoch + 1
        ),
        Event::Loss {
            epoch,
            iter,
            loss,
            images_per_sec,
        } => {
            println!("[{epoch}, {iter:5}] loss: {loss:.3}");
            tracing::info!(images_per_sec, "throughput");
        }
        Event::CheckpointSaved {
            global_step,
            epoch,
            position,
        } => {
            println!(
                "checkpoint saved at step {global_step} (epoch {}, {position} samples in)",
                epoch + 1
            )
        }
        Event::EpochDone { epoch, seconds } => println!("epoch {epoch} done in {seconds:.1} s"),
        Event::ModelSaved { path } => println!("model saved to {}", path.display()),
        Event::Evaluated(confusion) => print!("{}", confusion.report()),
        Event::Finished {
            global_step,
            fingerprint,
        } => {
            println!(
                "rank {rank} finished after {global_step} steps; weights fingerprint {fingerprint:08x}"
            )
        }
        Event::Warning(msg) => warn(&msg),
    }
}
