//! `trainctl report`: a finished (or running) run's metrics as PNG charts and one
//! self-contained HTML page. Reads only the metrics files (`RUN_DIR/metrics/rank-N.jsonl`), so
//! it works on a run copied off a cluster's volume, and never links burn.

mod charts;
mod html;
mod run;

pub use charts::{Chart, Series, confusion_png};
pub use run::{Marker, MarkerKind, RunData, Timing};

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Metrics(#[from] telemetry::metrics::MetricsError),
    #[error(
        "{0}: no metrics records for rank 0 (metrics/rank-0.jsonl is missing or empty); is this a run directory (OUT/RUN_ID) of trainctl train?"
    )]
    NoRecords(PathBuf),
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot draw {chart}: {problem}")]
    Draw { chart: String, problem: String },
}

/// What `write_report` produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Written {
    pub html: PathBuf,
    /// This, as JSON.
    pub json: PathBuf,
    pub charts: Vec<Chart>,
    /// Metrics lines that did not parse (partial lines left by a crash).
    pub skipped_lines: usize,
}

/// Reads the run in `run_dir` and writes its charts and `report.html` into `out_dir`, plus
/// `report.json`, which lists the charts and their series (for scripts and tests).
pub fn write_report(run_dir: &Path, out_dir: &Path) -> Result<Written, ReportError> {
    let data = RunData::read(run_dir)?;
    std::fs::create_dir_all(out_dir).map_err(|source| ReportError::Write {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let charts = charts::draw_all(&data, out_dir)?;
    let html = out_dir.join("report.html");
    write_file(&html, html::page(&data, &charts, out_dir)?.as_bytes())?;
    let written = Written {
        html,
        json: out_dir.join("report.json"),
        charts,
        skipped_lines: data.skipped,
    };
    write_file(
        &written.json,
        &serde_json::to_vec_pretty(&written).unwrap_or_default(),
    )?;
    Ok(written)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}
