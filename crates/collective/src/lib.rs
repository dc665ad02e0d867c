//! The collective: how trainctl's workers find each other and average their gradients.
//!
//! A TCP store hosted by rank 0 (torch's TCPStore in spirit), a ring of TCP links between
//! ranks, and ring all-reduce, broadcast and barrier over `f32` buffers. Every connection opens
//! with a handshake carrying the run id and the job token; a dead or silent peer becomes an
//! error within the configured timeout. This crate knows nothing of burn or of the launcher.
//!
//! Invariant: buffers travel as little-endian `f32` (every platform trainctl targets).

pub mod bench;
mod group;
pub mod store;
pub mod wire;
pub mod world;

pub use group::ProcessGroup;
pub use world::World;

use std::time::Duration;

/// Exit code of a worker whose peer vanished (its connection closed): the failure is somebody
/// else's, so the elastic agent restarts without counting it against `--max-restarts`
/// (EX_TEMPFAIL: "try again").
pub const EXIT_PEER_LOST: i32 = 75;

/// Exit code of a worker that was asked to stop (SIGTERM: an eviction, a spot interruption, a
/// deleted job) and saved a checkpoint at the step it finished first: not a failure, and nothing
/// to redo, so the elastic agent does not count it. It is 128 + SIGTERM, the code a process
/// stopped by SIGTERM conventionally ends with, which Kubeflow's `ExitCode` restart policy
/// retries; a worker *killed* by the signal reports the signal instead, and is counted.
pub const EXIT_PREEMPTED: i32 = 128 + 15;

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "cannot listen on {addr}: {source} (is another job using this port? pass --master-port 0 or --standalone to pick a free one)"
    )]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot connect to {addr} within {after:?}: {last_error} (is rank 0 running, and is MASTER_ADDR reachable from here?)"
    )]
    Connect {
        addr: String,
        after: Duration,
        last_error: String,
    },
    #[error("connection refused by the peer: {0}")]
    Refused(String),
    #[error(
        "{what} did not answer within {after:?}: the peer hung or the network is down (set TRAINCTL_COLLECTIVE_TIMEOUT to wait longer)"
    )]
    Timeout { what: String, after: Duration },
    #[error("lost {0}: the peer process exited or its host went away")]
    PeerLost(String),
    #[error("collective out of step: {0}")]
    Desync(String),
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
