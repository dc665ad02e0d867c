//! A key-value store over TCP, torch's TCPStore in spirit: rank 0 hosts it at
//! MASTER_ADDR:MASTER_PORT and peers use it to find each other. The elastic agent hosts one
//! too (the c10d rendezvous), which also uses compare-and-set and liveness keys: a liveness key
//! lives until its time-to-live passes without a heartbeat, or until the connection that set it
//! closes (a killed agent is gone at once, a cut link after the TTL).

mod client;
mod protocol;
mod server;
#[cfg(test)]
mod tests;

pub use client::{StoreClient, connect_with_retry};
pub use protocol::{Request, Response, fingerprint};
pub use server::StoreServer;

pub(crate) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}
