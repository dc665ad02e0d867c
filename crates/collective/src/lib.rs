//! The collective: how trainctl's workers find each other and average their gradients.
//!
//! A TCP store hosted by rank 0 (torch's TCPStore in spirit), a ring of TCP links between
//! ranks, and ring all-reduce, broadcast and barrier over `f32` buffers. Every connection opens
//! with a handshake carrying the run id and the job token; a dead or silent peer becomes an
//! error within the configured timeout. This crate knows nothing of burn or of the launcher.
//!
//! Invariant: buffers travel as little-endian `f32` (every platform trainctl targets).

pub mod bench;
pub mod control;
mod group;
pub mod regroup;
pub mod store;
pub mod wire;
pub mod world;

pub use group::{Interrupter, ProcessGroup};
pub use world::World;

use std::time::Duration;

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
