//! What the trainer tells its caller as it goes; only the caller prints.

use std::path::PathBuf;

use crate::data::DataProgress;
use crate::eval::Confusion;

/// One thing that happened in a run, for the caller to print or record.
#[derive(Debug, Clone)]
pub enum Event {
    Resumed {
        epoch: usize,
        position: usize,
        global_step: u64,
        saved_world_size: usize,
    },
    /// Mean loss over the last `print_freq` steps (seed format: `[epoch, iter] loss`).
    Loss {
        epoch: usize,
        iter: usize,
        /// Steps of this epoch at this world size.
        steps: usize,
        loss: f32,
        images_per_sec: f64,
        seconds_per_step: f64,
    },
    /// Every step, on every rank (what the metrics file records).
    Step(Box<telemetry::Step>),
    CheckpointSaved {
        global_step: u64,
        epoch: usize,
        position: usize,
    },
    EpochDone {
        epoch: usize,
        seconds: f64,
    },
    ModelSaved {
        path: PathBuf,
    },
    Evaluated(Box<Confusion>),
    /// Every rank: its step count and a fingerprint of its weights, equal on all ranks.
    Finished {
        /// The rank the worker ends at (not the one it started at, when it regrouped).
        rank: usize,
        global_step: u64,
        samples_seen: u64,
        world_size: usize,
        fingerprint: u32,
    },
    Warning(String),
    /// Rank 0 found a node slower than the others (`slow`), or found it no longer slow.
    Straggler {
        slow: bool,
        report: String,
    },
    /// Downloading or extracting the data set (the node's local rank 0 only).
    Data(DataProgress),
}
