//! Rendezvous: how the agents of an elastic job find each other, agree on who is in each round,
//! notice a node that died, and admit a node that arrives.
//!
//! `state` is the pure state machine; `backend` the stores it lives in (`c10d`: a store hosted
//! by the agent at the endpoint, nothing else to run; `etcd`: etcd's v3 API); `handler::
//! Rendezvous` drives the machine against a backend, with a heartbeat thread keeping this node
//! alive. Knows nothing of workers or burn: the launcher's agent uses it.

pub mod backend;
mod conf;
mod handler;
pub mod state;

pub use conf::{ConfError, Config, parse_conf};
pub use handler::{
    Joined, Leaving, Rendezvous, Restart, StillJoining, Watch, Withdrawn, still_joining_every,
};
pub use state::{Assignment, Closed, FailureKind, Health, Limits};

use std::time::Duration;

/// Where the rendezvous lives, by backend ([`contract::rdzv::Backend`]'s elastic ones, with
/// their address): `trainctl run`'s plan makes it from `--rdzv-backend` and `--rdzv-endpoint`.
/// The job's token and whether this agent hosts a c10d store are [`Config`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendKind {
    /// trainctl's store, hosted by the agent whose host is the endpoint.
    C10d { host: String, port: u16 },
    /// etcd's v3 API (JSON gateway) at `url` (`http://host:port`).
    Etcd { url: String },
}

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rendezvous store at {endpoint}: {problem}")]
    Store { endpoint: String, problem: String },
    #[error(
        "the rendezvous record at {key} is not a trainctl record ({problem}); use another --rdzv-id, or delete the key"
    )]
    BadRecord { key: String, problem: String },
    #[error(
        "rendezvous of run {run_id:?} did not complete within {waited:?}: {joined} of at least {min} node(s) joined (round {round}); start the other nodes with the same --rdzv-endpoint and --rdzv-id, or raise join_timeout in --rdzv-conf"
    )]
    JoinTimeout {
        run_id: String,
        waited: Duration,
        joined: usize,
        min: u32,
        round: u64,
    },
    /// Something answers at the endpoint but not as a trainctl store or etcd: waiting will not
    /// help.
    #[error(
        "something answers at {endpoint} but it is not a trainctl rendezvous store or etcd (its answer: {problem}): another program holds that port; check --rdzv-endpoint (c10d's store listens on 29400 by default, etcd on 2379)"
    )]
    NotAStore { endpoint: String, problem: String },
    /// A stop signal came while this node waited for the store: it never joined.
    #[error("asked to stop before the rendezvous store answered: this node never joined the job")]
    Stopped,
    #[error(transparent)]
    Collective(#[from] collective::CollectiveError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
