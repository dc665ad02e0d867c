//! The metrics file: one JSON object per line, appended by every rank to
//! `RUN_DIR/metrics/rank-N.jsonl`. The schema is documented in docs/METRICS.md; a record is
//! one of the [`Record`] kinds, told apart by its `kind` field.
//!
//! Invariant: each record goes to the file in one `write` of a whole line, so a crash leaves
//! at most one partial line, and a writer that opens a file ending in a partial line ends it
//! first; readers skip lines that do not parse (and count them).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Version of the schema, in every `start` record. Fields may be added without a new version;
/// a reader ignores fields it does not know.
pub const SCHEMA_VERSION: u32 = 1;

/// One line of a metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// A worker started: first in every attempt (fresh, restarted or resumed).
    Start(Start),
    /// One optimiser step, written by every rank.
    Step(Step),
    /// Rank 0 wrote a checkpoint.
    Checkpoint(Checkpoint),
    /// An epoch ended.
    Epoch(EpochDone),
    /// Rank 0's test-set evaluation, summed over all ranks.
    Eval(Eval),
    /// The worker went on in a new group without restarting (a node lost or joined).
    Regroup(Regroup),
    /// Rank 0 found a node slower than the others, or found it no longer slow.
    Straggler(Straggler),
}

impl Record {
    pub fn time(&self) -> f64 {
        match self {
            Record::Start(r) => r.time,
            Record::Step(r) => r.time,
            Record::Checkpoint(r) => r.time,
            Record::Epoch(r) => r.time,
            Record::Eval(r) => r.time,
            Record::Regroup(r) => r.time,
            Record::Straggler(r) => r.time,
        }
    }

    /// The record as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        // Serialising these plain structs cannot fail (no maps with non-string keys).
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Start {
    /// [`SCHEMA_VERSION`] of the file from here on.
    pub v: u32,
    pub time: f64,
    pub rank: u32,
    pub world_size: u32,
    /// The launcher's restart count (TORCHELASTIC_RESTART_COUNT).
    pub restart: u32,
    /// Global step the worker starts from (0, or the checkpoint's).
    pub step: u64,
    /// Rank 0 read a checkpoint.
    pub resumed: bool,
    /// This worker joined a group that was training and took its state from a peer (no
    /// checkpoint read).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_peer: bool,
    /// What the node's health check measured before it joined (`trainctl run
    /// --health-check`), when it ran one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<NodeHealth>,
    pub config: RunConfig,
}

/// A node's health check: its matrix multiply and loopback throughput.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeHealth {
    pub gemm_mflops: u64,
    pub loopback_mbps: u64,
}

/// What the run was asked to do, as the trainer understood it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RunConfig {
    pub run_id: String,
    pub epochs: usize,
    /// Images per step on each worker.
    pub batch_size: usize,
    pub learning_rate: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub seed: u64,
    pub threads: usize,
    pub checkpoint_every: Option<u64>,
    pub data: String,
    pub backend: String,
    pub version: String,
    /// The network (`seed-cnn`, `resnet18`, ...); files from before it was recorded trained the
    /// seed CNN.
    #[serde(default = "seed_cnn")]
    pub model: String,
    /// Side of the square training images in pixels.
    #[serde(default = "cifar_size")]
    pub image_size: usize,
    /// The convolutions' arithmetic, `fp32` or `bf16` (`--precision`); files from before it
    /// was recorded computed in fp32.
    #[serde(default = "fp32")]
    pub precision: String,
}

fn fp32() -> String {
    "fp32".into()
}

fn seed_cnn() -> String {
    contract::choices::Model::SeedCnn.name().into()
}

fn cifar_size() -> usize {
    32
}

impl RunConfig {
    /// The settings as (label, value) rows, as the report and TensorBoard show them.
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        vec![
            ("run id", self.run_id.clone()),
            ("model", self.model.clone()),
            ("image size", format!("{0}×{0}", self.image_size)),
            ("epochs", self.epochs.to_string()),
            ("batch size per worker", self.batch_size.to_string()),
            ("learning rate", self.learning_rate.to_string()),
            ("momentum", self.momentum.to_string()),
            ("weight decay", self.weight_decay.to_string()),
            ("seed", self.seed.to_string()),
            ("threads per worker", self.threads.to_string()),
            (
                "checkpoints",
                self.checkpoint_every.map_or("every epoch".into(), |n| {
                    format!("every {n} steps and epoch")
                }),
            ),
            ("data", self.data.clone()),
            ("backend", self.backend.clone()),
            ("precision", self.precision.clone()),
            ("trainctl", self.version.clone()),
        ]
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub time: f64,
    pub rank: u32,
    pub world_size: u32,
    pub restart: u32,
    /// 1-based epoch.
    pub epoch: usize,
    /// Global step count after this step (never reset by an epoch or a restart).
    pub step: u64,
    /// 1-based step within the epoch, counted at this step's world size.
    pub iter: usize,
    /// Steps this epoch has at this world size (its `iter` runs up to this).
    pub steps_in_epoch: usize,
    /// Mean training loss of this step over all ranks.
    pub loss: f32,
    /// Fraction of this step's training images classified right, mean over the ranks.
    pub accuracy: f32,
    pub lr: f64,
    /// Images in this step over all ranks.
    pub images: usize,
    /// `images / step_s`: the job's throughput.
    pub images_per_sec: f64,
    /// Wall time of the whole step, and its parts: loading the batch, forward + backward +
    /// update, and the collective (gradient all-reduce and buffer broadcast).
    pub step_s: f64,
    pub data_s: f64,
    pub compute_s: f64,
    pub allreduce_s: f64,
    /// This rank's time before the all-reduce (data and compute) over the median rank's at
    /// this step: 1 for a rank as fast as most, 2 for one that takes twice as long. Absent in
    /// older files and from programs that do not measure it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowdown: Option<f64>,
}

/// A node found slower than the others for a window of steps (`slow`), or no longer so.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Straggler {
    pub time: f64,
    pub rank: u32,
    /// Global step at which it was seen.
    pub step: u64,
    pub slow: bool,
    /// The node (its group rank) and its ranks.
    pub node: u32,
    pub ranks: Vec<u32>,
    /// Its time before the all-reduce over the other nodes' median (the window's medians).
    pub slowdown: f64,
    /// `compute` or `data loading`; empty when it ended.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cause: String,
    /// Its median data and compute seconds per step, and the other nodes'.
    #[serde(default)]
    pub data_s: f64,
    #[serde(default)]
    pub compute_s: f64,
    #[serde(default)]
    pub others_data_s: f64,
    #[serde(default)]
    pub others_compute_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub time: f64,
    pub rank: u32,
    pub step: u64,
    /// Epochs done when saved.
    pub epoch: usize,
    /// Samples into the next epoch.
    pub position: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochDone {
    pub time: f64,
    pub rank: u32,
    pub epoch: usize,
    pub step: u64,
    pub seconds: f64,
    /// The epoch's samples, as trained by all ranks, as one number (16 hex digits; the
    /// trainer's `sampler::digest`): equal in two runs that trained the same samples the same
    /// number of times, whatever restarts came between. Absent in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_digest: Option<String>,
}

/// A regroup in place, as one worker saw it: it left its group after global step `step`
/// (a peer lost, or a pause for a node joining) and goes on in the next round's group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Regroup {
    pub time: f64,
    /// The worker's rank in the new group (it may differ from the old one).
    pub rank: u32,
    pub world_size_before: u32,
    pub world_size: u32,
    /// The global step the new group goes on from.
    pub step: u64,
    /// Steps this worker had completed that the new group does not keep.
    pub steps_dropped: u64,
    /// Bytes of state streamed from a peer to the ranks that lacked it (0: all had it).
    pub bytes: u64,
    /// Whether this worker received the state (it joined, or was one step behind).
    pub received: bool,
    /// From leaving the old group to the new group's state being in place.
    pub seconds: f64,
    /// Why the group changed: `peer lost: ...` or `paused`.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Eval {
    pub time: f64,
    pub rank: u32,
    pub step: u64,
    pub images: u64,
    /// Percent.
    pub accuracy: f64,
    pub classes: Vec<String>,
    /// Percent per true class, `null` for a class with no test images.
    pub class_accuracy: Vec<Option<f64>>,
    /// `confusion[true][predicted]` counts.
    pub confusion: Vec<Vec<u64>>,
    /// Percent of images whose class is among the five most probable; recorded for more
    /// than five classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top5_accuracy: Option<f64>,
}

/// The metrics file of `rank` in a run directory.
pub fn rank_file(run_dir: &Path, rank: u32) -> PathBuf {
    run_dir.join("metrics").join(format!("rank-{rank}.jsonl"))
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct MetricsError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Appends records to one metrics file.
pub struct MetricsWriter {
    file: std::fs::File,
    path: PathBuf,
}

impl MetricsWriter {
    /// Opens `path` for appending, creating it and its folder; a partial last line left by a
    /// crash is ended first, so the next record starts on a line of its own.
    pub fn open(path: &Path) -> Result<Self, MetricsError> {
        let at = |source| MetricsError {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(at)?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)
            .map_err(at)?;
        if ends_mid_line(&mut file).map_err(at)? {
            file.write_all(b"\n").map_err(at)?;
        }
        Ok(MetricsWriter {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Appends `record` as one line, in one write.
    pub fn write(&mut self, record: &Record) -> Result<(), MetricsError> {
        self.write_line(&record.to_line())
    }

    /// Appends a line made by [`Record::to_line`] (for a caller that sends it elsewhere too).
    pub fn write_line(&mut self, line: &[u8]) -> Result<(), MetricsError> {
        self.file.write_all(line).map_err(|source| MetricsError {
            path: self.path.clone(),
            source,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn ends_mid_line(file: &mut std::fs::File) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(false);
    }
    file.seek(SeekFrom::Start(len - 1))?;
    let mut last = [0u8];
    file.read_exact(&mut last)?;
    Ok(last[0] != b'\n')
}

/// A metrics file as read back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    pub records: Vec<Record>,
    /// Lines that did not parse: partial lines left by a crash, or records of a kind this
    /// version does not know.
    pub skipped: usize,
}

/// Parses the lines of a metrics file, skipping (and counting) those that do not parse.
pub(crate) fn parse_metrics(bytes: &[u8]) -> Metrics {
    let mut out = Metrics::default();
    for line in bytes.split(|&b| b == b'\n') {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Record>(line) {
            Ok(r) => out.records.push(r),
            Err(_) => out.skipped += 1,
        }
    }
    out
}

pub fn read_metrics(path: &Path) -> Result<Metrics, MetricsError> {
    std::fs::read(path)
        .map(|bytes| parse_metrics(&bytes))
        .map_err(|source| MetricsError {
            path: path.to_path_buf(),
            source,
        })
}

/// Every rank's metrics file in a run directory, by rank.
pub fn read_run(run_dir: &Path) -> Result<Vec<(u32, Metrics)>, MetricsError> {
    let dir = run_dir.join("metrics");
    let entries = std::fs::read_dir(&dir).map_err(|source| MetricsError {
        path: dir.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rank) = name
            .to_str()
            .and_then(|n| n.strip_prefix("rank-"))
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        out.push((rank, read_metrics(&entry.path())?));
    }
    out.sort_by_key(|(rank, _)| *rank);
    Ok(out)
}

#[cfg(test)]
mod tests;
