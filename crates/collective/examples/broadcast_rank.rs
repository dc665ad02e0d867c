//! One rank of a broadcast benchmark across real hosts (bench/broadcast_netns.sh starts one per
//! network namespace): joins the group from torchrun's environment (RANK, WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT), broadcasts `MB` megabytes from rank 0 `REPEATS` times (after one
//! warm-up), and rank 0 prints the median time until the slowest rank had every byte.
//!
//! Usage: broadcast_rank MB REPEATS

use std::time::Instant;

use collective::{ProcessGroup, World};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let mb: usize = args.get(1).map_or(Ok(20), |a| a.parse())?;
    let repeats: usize = args.get(2).map_or(Ok(5), |a| a.parse())?;
    let world = World::from_env()?;
    let mut group = ProcessGroup::join(&world)?;
    let mut buf = vec![group.rank() as u8; mb << 20];
    let mut times = Vec::new();
    for _ in 0..=repeats {
        group.barrier()?;
        let t = Instant::now();
        group.broadcast_bytes(&mut buf, 0)?;
        let mine = t.elapsed().as_nanos() as u64;
        let slowest = group.all_gather_u64(mine)?.into_iter().max().unwrap_or(0);
        times.push(slowest as f64 / 1e9);
    }
    if buf.iter().any(|b| *b != 0) {
        return Err("a rank did not receive rank 0's bytes".into());
    }
    times.remove(0);
    times.sort_by(f64::total_cmp);
    if group.rank() == 0 {
        println!(
            "{{\"ranks\":{},\"mb\":{mb},\"median_s\":{:.4}}}",
            group.world_size(),
            times[times.len() / 2]
        );
    }
    Ok(())
}
