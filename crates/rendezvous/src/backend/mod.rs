//! Where the rendezvous record lives: compare-and-set on one record, and liveness per node.

mod c10d;
mod etcd;

pub use c10d::C10d;
pub use etcd::Etcd;

use std::collections::BTreeSet;
use std::time::Duration;

use crate::RendezvousError;
use crate::state::{Node, State};

/// What was read: the record and the token that a compare-and-set must present.
pub struct Read {
    pub state: Option<State>,
    pub token: Option<Vec<u8>>,
}

/// A rendezvous store. Each value is one connection; `reconnect` opens another (the heartbeat
/// thread has its own, so a slow call never delays a heartbeat).
pub trait Backend: Send {
    /// `c10d store at host:port`, for messages.
    fn describe(&self) -> String;
    fn read(&mut self) -> Result<Read, RendezvousError>;
    /// Writes `next` if the record is still the one `token` was read with (`None`: absent).
    /// `Ok(false)`: someone wrote first; read again.
    fn write(&mut self, token: Option<&[u8]>, next: &State) -> Result<bool, RendezvousError>;
    /// Says `node` is alive for `ttl` more.
    fn heartbeat(&mut self, node: &str, ttl: Duration) -> Result<(), RendezvousError>;
    /// The nodes alive now.
    fn alive(&mut self) -> Result<BTreeSet<String>, RendezvousError>;
    /// `node` leaves: no longer alive.
    fn forget(&mut self, node: &str) -> Result<(), RendezvousError>;
    fn reconnect(&self) -> Result<Box<dyn Backend>, RendezvousError>;

    /// Whether nodes join by announcing themselves ([`Backend::announce`]) for the round's
    /// writer to merge, instead of each adding itself to the record.
    fn announces(&self) -> bool {
        false
    }
    /// Says `node` wants to join `round`: a key of its own (no race with the others), gone
    /// with the node. Idempotent; replaces its announcement for an earlier round.
    fn announce(&mut self, _round: u64, _node: &Node) -> Result<(), RendezvousError> {
        Ok(())
    }
    /// The live announcements for `round`, first announced first.
    fn announced(&mut self, _round: u64) -> Result<Vec<Node>, RendezvousError> {
        Ok(Vec::new())
    }
    /// Waits up to `timeout` for the record or the live nodes to change since the last read
    /// (a backend that cannot tell just waits).
    fn wait_change(&mut self, timeout: Duration) {
        std::thread::sleep(timeout);
    }
}

/// Decodes a record, refusing anything that is not one of ours.
pub(crate) fn decode(key: &str, bytes: &[u8]) -> Result<State, RendezvousError> {
    serde_json::from_slice(bytes).map_err(|e| RendezvousError::BadRecord {
        key: key.to_string(),
        problem: e.to_string(),
    })
}

pub(crate) fn encode(state: &State) -> Vec<u8> {
    // A record of plain strings and numbers always serialises.
    serde_json::to_vec(state).unwrap_or_default()
}
