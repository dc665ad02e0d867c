//! A run's metrics, folded into what the report shows: rank 0's steps split into attempts,
//! the restarts and world-size changes between them, per-rank timings, the evaluation.

use std::path::Path;

use telemetry::metrics::{Eval, Record, Start, read_run};
use telemetry::{RunConfig, Step};

use crate::ReportError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkerKind {
    /// The workers were started again (a failure, or a resumed run).
    Restart,
    /// The job continued at another world size.
    WorldSize,
}

/// Something that happened between two attempts, at a global step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Marker {
    pub step: u64,
    pub kind: MarkerKind,
    pub label: String,
}

/// Mean seconds per step of one rank, split as the metrics record them.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    pub rank: u32,
    pub steps: usize,
    pub step_s: f64,
    pub data_s: f64,
    pub compute_s: f64,
    pub allreduce_s: f64,
}

#[derive(Debug, Clone)]
pub struct RunData {
    pub run_dir: String,
    /// The configuration of the latest attempt.
    pub config: Option<RunConfig>,
    /// Rank 0's attempts in order, each its steps in order.
    pub attempts: Vec<Attempt>,
    pub markers: Vec<Marker>,
    pub timings: Vec<Timing>,
    pub eval: Option<Eval>,
    pub checkpoints: usize,
    pub epochs_done: usize,
    /// Seconds from the first record to the last (rank 0).
    pub wall_s: f64,
    pub skipped: usize,
}

#[derive(Debug, Clone)]
pub struct Attempt {
    pub start: Option<Start>,
    pub steps: Vec<Step>,
}

impl RunData {
    pub fn read(run_dir: &Path) -> Result<Self, ReportError> {
        let ranks = match read_run(run_dir) {
            Err(e) if e.source.kind() == std::io::ErrorKind::NotFound => {
                return Err(ReportError::NoRecords(run_dir.to_path_buf()));
            }
            r => r?,
        };
        let skipped = ranks.iter().map(|(_, m)| m.skipped).sum();
        let timings = ranks
            .iter()
            .filter_map(|(rank, m)| timing(*rank, &m.records))
            .collect();
        let Some((_, rank0)) = ranks.into_iter().find(|(rank, _)| *rank == 0) else {
            return Err(ReportError::NoRecords(run_dir.to_path_buf()));
        };
        if rank0.records.is_empty() {
            return Err(ReportError::NoRecords(run_dir.to_path_buf()));
        }
        let mut data = RunData::from_records(&rank0.records, timings);
        data.run_dir = run_dir.display().to_string();
        data.skipped = skipped;
        Ok(data)
    }

    /// Folds rank 0's records (in file order) into attempts, markers and totals.
    pub fn from_records(records: &[Record], timings: Vec<Timing>) -> Self {
        let mut attempts: Vec<Attempt> = Vec::new();
        let mut markers = Vec::new();
        let (mut eval, mut config, mut checkpoints, mut epochs_done) = (None, None, 0, 0);
        for r in records {
            match r {
                Record::Start(s) => {
                    if let Some(prev) = attempts.iter().rev().find_map(|a| a.start.as_ref()) {
                        if s.restart > prev.restart {
                            markers.push(Marker {
                                step: s.step,
                                kind: MarkerKind::Restart,
                                label: format!("restart {}", s.restart),
                            });
                        } else if s.world_size == prev.world_size {
                            markers.push(Marker {
                                step: s.step,
                                kind: MarkerKind::Restart,
                                label: "resumed".into(),
                            });
                        }
                        if s.world_size != prev.world_size {
                            markers.push(Marker {
                                step: s.step,
                                kind: MarkerKind::WorldSize,
                                label: format!("world size {} → {}", prev.world_size, s.world_size),
                            });
                        }
                    }
                    config = Some(s.config.clone());
                    attempts.push(Attempt {
                        start: Some(s.clone()),
                        steps: Vec::new(),
                    });
                }
                Record::Step(s) => {
                    if attempts.is_empty() {
                        attempts.push(Attempt {
                            start: None,
                            steps: Vec::new(),
                        });
                    }
                    if let Some(a) = attempts.last_mut() {
                        a.steps.push(s.clone());
                    }
                }
                Record::Checkpoint(_) => checkpoints += 1,
                Record::Epoch(e) => epochs_done = epochs_done.max(e.epoch),
                Record::Eval(e) => eval = Some(e.clone()),
                Record::Regroup(g) if g.world_size != g.world_size_before => {
                    markers.push(Marker {
                        step: g.step,
                        kind: MarkerKind::WorldSize,
                        label: format!(
                            "regrouped: world size {} → {}",
                            g.world_size_before, g.world_size
                        ),
                    });
                }
                Record::Regroup(_) => {}
            }
        }
        let times = records.iter().map(Record::time);
        let first = times.clone().fold(f64::INFINITY, f64::min);
        let last = times.fold(f64::NEG_INFINITY, f64::max);
        RunData {
            run_dir: String::new(),
            config,
            attempts,
            markers,
            timings,
            eval,
            checkpoints,
            epochs_done,
            wall_s: if last >= first { last - first } else { 0.0 },
            skipped: 0,
        }
    }

    pub fn steps(&self) -> impl Iterator<Item = &Step> {
        self.attempts.iter().flat_map(|a| a.steps.iter())
    }

    pub fn last_step(&self) -> Option<&Step> {
        self.attempts.iter().rev().find_map(|a| a.steps.last())
    }

    pub fn restarts(&self) -> usize {
        self.markers
            .iter()
            .filter(|m| m.kind == MarkerKind::Restart)
            .count()
    }

    pub fn world_sizes(&self) -> Vec<u32> {
        let mut sizes: Vec<u32> = Vec::new();
        for s in self.attempts.iter().filter_map(|a| a.start.as_ref()) {
            if sizes.last() != Some(&s.world_size) {
                sizes.push(s.world_size);
            }
        }
        sizes
    }
}

fn timing(rank: u32, records: &[Record]) -> Option<Timing> {
    let steps: Vec<&Step> = records
        .iter()
        .filter_map(|r| match r {
            Record::Step(s) => Some(s),
            _ => None,
        })
        .collect();
    if steps.is_empty() {
        return None;
    }
    let mean = |f: fn(&Step) -> f64| steps.iter().map(|s| f(s)).sum::<f64>() / steps.len() as f64;
    Some(Timing {
        rank,
        steps: steps.len(),
        step_s: mean(|s| s.step_s),
        data_s: mean(|s| s.data_s),
        compute_s: mean(|s| s.compute_s),
        allreduce_s: mean(|s| s.allreduce_s),
    })
}

#[cfg(test)]
mod tests {
    use telemetry::metrics::SCHEMA_VERSION;

    use super::*;

    fn start(restart: u32, world_size: u32, step: u64) -> Record {
        Record::Start(Start {
            v: SCHEMA_VERSION,
            time: step as f64,
            rank: 0,
            world_size,
            restart,
            step,
            resumed: step > 0,
            from_peer: false,
            config: RunConfig::default(),
        })
    }

    fn step(n: u64, world_size: u32) -> Record {
        Record::Step(Step {
            time: n as f64,
            rank: 0,
            world_size,
            restart: 0,
            epoch: 1,
            step: n,
            iter: n as usize,
            steps_in_epoch: 10,
            loss: 2.0,
            accuracy: 0.1,
            lr: 1e-3,
            images: 64,
            images_per_sec: 100.0,
            step_s: 0.64,
            data_s: 0.01,
            compute_s: 0.5,
            allreduce_s: 0.13,
        })
    }

    #[test]
    fn restarts_and_world_size_changes_become_markers() {
        let records = vec![
            start(0, 2, 0),
            step(1, 2),
            step(2, 2),
            step(3, 2),
            // A failure: back to the checkpoint at step 2, same world.
            start(1, 2, 2),
            step(3, 2),
            // A node lost: the next round runs with one worker.
            start(1, 1, 3),
            step(4, 1),
            // The same run started again by hand, from its checkpoint.
            start(0, 1, 4),
        ];
        let data = RunData::from_records(&records, vec![]);
        assert_eq!(
            data.attempts
                .iter()
                .map(|a| a.steps.len())
                .collect::<Vec<_>>(),
            [3, 1, 1, 0]
        );
        let marks: Vec<(u64, MarkerKind, &str)> = data
            .markers
            .iter()
            .map(|m| (m.step, m.kind, m.label.as_str()))
            .collect();
        assert_eq!(
            marks,
            [
                (2, MarkerKind::Restart, "restart 1"),
                (3, MarkerKind::WorldSize, "world size 2 → 1"),
                (4, MarkerKind::Restart, "resumed"),
            ]
        );
        assert_eq!(data.world_sizes(), [2, 1]);
        assert_eq!(data.restarts(), 2);
        assert_eq!(data.last_step().map(|s| s.step), Some(4));
    }
}
