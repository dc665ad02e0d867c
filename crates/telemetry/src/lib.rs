//! What a training run records about itself, and the formats other tools read it in: the
//! metrics file (JSON lines, one file per rank), TensorBoard event files, and the Prometheus
//! text format. Knows nothing of burn or of the launcher; the trainer writes, the launcher
//! forwards, `trainctl report` and `trainctl run --metrics-port` read.

pub mod metrics;
pub mod prometheus;
pub mod tfevents;

pub use metrics::{MetricsWriter, Record, RunConfig, Step, read_metrics};

/// Seconds since the Unix epoch, as every record's `time`.
pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
