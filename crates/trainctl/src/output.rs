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
        spec.run_id, spec.nproc_per_node, spec.world_size, spec.master_addr, spec.master_port
    );
}

pub fn agent_starting(spec: &launcher::LaunchSpec, rdzv: &launcher::rendezvous::Rendezvous) {
    let cfg = rdzv.config();
    eprintln!(
        "trainctl run: elastic agent {} for run id {}, {} worker(s) on this node, {}..{} nodes; rendezvous: {}",
        rdzv.node_id(),
        spec.run_id,
        spec.nproc_per_node,
        cfg.limits.min,
        cfg.limits.max,
        rdzv.describe()
    );
}

pub fn launch_event(event: launcher::LaunchEvent) {
    use launcher::LaunchEvent;
    match event {
        LaunchEvent::Joining { node } => {
            tracing::info!(node, "joining the rendezvous");
        }
        LaunchEvent::Joined(a) => eprintln!(
            "trainctl run: round {}: node {} of {}, first rank {}, world size {}, restart count {}, store at {}:{}",
            a.round,
            a.node_rank,
            a.nnodes,
            a.rank_offset,
            a.world_size,
            a.restart_count,
            a.master_addr,
            a.master_port
        ),
        LaunchEvent::Reopened { reason } => {
            eprintln!("trainctl run: new rendezvous round: {reason}; restarting the workers")
        }
        LaunchEvent::JobAlreadyOver => {
            eprintln!("trainctl run: this run id's job has already finished; nothing to do")
        }
        LaunchEvent::StoreUnreachable(e) => warn(&format!(
            "rendezvous store unreachable ({e}); the workers go on, membership changes wait for it"
        )),
        LaunchEvent::StoreBack => eprintln!("trainctl run: rendezvous store reachable again"),
        LaunchEvent::Started(w) => {
            eprintln!("trainctl run: started rank {} (pid {})", w.rank, w.pid)
        }
        LaunchEvent::Restarting {
            failure,
            restart_count,
        } if failure.exit == launcher::ExitKind::Code(collective::EXIT_PEER_LOST) => eprintln!(
            "trainctl run: rank {} (pid {}) lost a peer (exit code {}); restarting all workers (not counted as a failure: restart count stays {restart_count})",
            failure.rank,
            failure.pid,
            collective::EXIT_PEER_LOST
        ),
        LaunchEvent::Restarting {
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
            samples_seen,
            world_size,
            fingerprint,
        } => {
            println!(
                "rank {rank} finished after {global_step} steps; weights fingerprint {fingerprint:08x} (world size {world_size}, {samples_seen} samples trained in all)"
            )
        }
        Event::Warning(msg) => warn(&msg),
    }
}

pub fn checkpoint(path: &std::path::Path, p: &trainer::checkpoint::Progress, json: bool) {
    if json {
        println!("{}", serde_json::to_string(p).unwrap_or_default());
        return;
    }
    println!(
        "{}: verified (checksum, tensor names and shapes)",
        path.display()
    );
    println!(
        "  epoch        : {} done, {} samples into the next",
        p.epoch, p.position
    );
    println!("  global step  : {}", p.global_step);
    println!(
        "  samples seen : {} (data set {} images)",
        p.samples_seen, p.dataset_len
    );
    println!("  world size   : {} when saved", p.world_size);
    println!(
        "  settings     : batch {}, lr {}, momentum {}, weight decay {}, seed {}",
        p.batch_size, p.learning_rate, p.momentum, p.weight_decay, p.seed
    );
}
