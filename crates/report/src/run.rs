//! A run's metrics, folded into what the report shows: rank 0's steps split into attempts,
//! the restarts and world-size changes between them, per-rank timings, the evaluation.

use std::path::Path;

use telemetry::metrics::{Eval, Record, Start, read_run};
use telemetry::{RunConfig, Step};

use crate::ReportError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkerKind {
    /// The launcher started the workers again (a failure, or a node lost or added with
    /// `--regroup restart` or a user's program), from the last checkpoint.
    Restart,
    /// The run was started again by hand and resumed from its checkpoint: not a failure, and
    /// the time it stood still is not counted.
    Resumed,
    /// The job continued at another world size after a restart.
    WorldSize,
    /// The workers regrouped in place (no restart): a node lost, added or gone.
    Regroup,
    /// A node was found slower than the others, or no longer.
    Straggler,
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
    /// Each rank's time before the all-reduce (data and compute) at each of its steps: where
    /// a straggler shows.
    pub rank_busy: Vec<(u32, Vec<(u64, f64)>)>,
    pub eval: Option<Eval>,
    pub checkpoints: usize,
    pub epochs_done: usize,
    /// Seconds from the first record to the last (rank 0), less the time the run stood still
    /// before being started again by hand.
    pub wall_s: f64,
    /// Seconds left out of `wall_s`: between an attempt's last record and a start by hand.
    pub idle_s: f64,
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
        let rank_busy = ranks
            .iter()
            .map(|(rank, m)| {
                let steps = m
                    .records
                    .iter()
                    .filter_map(|r| match r {
                        Record::Step(s) => Some((s.step, s.data_s + s.compute_s)),
                        _ => None,
                    })
                    .collect();
                (*rank, steps)
            })
            .collect();
        let Some((_, rank0)) = ranks.into_iter().find(|(rank, _)| *rank == 0) else {
            return Err(ReportError::NoRecords(run_dir.to_path_buf()));
        };
        if rank0.records.is_empty() {
            return Err(ReportError::NoRecords(run_dir.to_path_buf()));
        }
        let mut data = RunData::from_records(&rank0.records, timings);
        data.rank_busy = rank_busy;
        data.run_dir = run_dir.display().to_string();
        data.skipped = skipped;
        Ok(data)
    }

    /// Folds rank 0's records (in file order) into attempts, markers and totals.
    pub(crate) fn from_records(records: &[Record], timings: Vec<Timing>) -> Self {
        let mut attempts: Vec<Attempt> = Vec::new();
        let mut markers = Vec::new();
        let (mut eval, mut config, mut checkpoints, mut epochs_done) = (None, None, 0, 0);
        let (mut idle_s, mut previous_time) = (0.0, None::<f64>);
        for r in records {
            match r {
                Record::Start(s) => {
                    if let Some(prev) = attempts.iter().rev().find_map(|a| a.start.as_ref()) {
                        let finished = epochs_done > 0 && epochs_done >= s.config.epochs;
                        let since = previous_time.map_or(0.0, |t| (s.time - t).max(0.0));
                        idle_s += mark_start(prev, s, finished, since, &mut markers);
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
                Record::Straggler(g) => markers.push(Marker {
                    step: g.step,
                    kind: MarkerKind::Straggler,
                    label: if g.slow {
                        format!("node {} {:.1}× slower ({})", g.node, g.slowdown, g.cause)
                    } else {
                        format!("node {} no longer slow", g.node)
                    },
                }),
                Record::Regroup(g) => {
                    markers.push(Marker {
                        step: g.step,
                        kind: MarkerKind::Regroup,
                        label: if g.world_size != g.world_size_before {
                            format!("regrouped {} → {}", g.world_size_before, g.world_size)
                        } else {
                            "regrouped".into()
                        },
                    });
                }
            }
            previous_time = Some(r.time());
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
            rank_busy: Vec::new(),
            eval,
            checkpoints,
            epochs_done,
            wall_s: if last >= first {
                (last - first - idle_s).max(0.0)
            } else {
                0.0
            },
            idle_s,
            skipped: 0,
        }
    }

    pub fn steps(&self) -> impl Iterator<Item = &Step> {
        self.attempts.iter().flat_map(|a| a.steps.iter())
    }

    pub fn last_step(&self) -> Option<&Step> {
        self.attempts.iter().rev().find_map(|a| a.steps.last())
    }

    /// Restarts by the launcher (not runs resumed by hand, not regroups).
    pub fn restarts(&self) -> usize {
        self.count(MarkerKind::Restart)
    }

    pub fn count(&self, kind: MarkerKind) -> usize {
        self.markers.iter().filter(|m| m.kind == kind).count()
    }

    /// The world sizes the steps ran at, in order (restarts and regroups alike).
    pub(crate) fn world_sizes(&self) -> Vec<u32> {
        let mut sizes: Vec<u32> = Vec::new();
        // In time order: each attempt's start, then its steps.
        let ordered = self.attempts.iter().flat_map(|a| {
            a.start
                .iter()
                .map(|s| s.world_size)
                .chain(a.steps.iter().map(|s| s.world_size))
        });
        for size in ordered {
            if sizes.last() != Some(&size) {
                sizes.push(size);
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

/// The markers of an attempt `s` that started after `prev`: a restart, a resume (started again
/// by hand), a world-size change. Returns the seconds since the `previous` record that are
/// nobody's (a resume by hand: the run was not running).
fn mark_start(
    prev: &Start,
    s: &Start,
    finished: bool,
    since_previous: f64,
    markers: &mut Vec<Marker>,
) -> f64 {
    let mut idle_s = 0.0;
    if s.restart > prev.restart {
        markers.push(Marker {
            step: s.step,
            kind: MarkerKind::Restart,
            label: format!("restart {}", s.restart),
        });
    } else if s.world_size == prev.world_size {
        // Started again by hand (a membership change restarts at another world size, marked
        // below): the time in between is nobody's.
        idle_s = since_previous;
        // A finished run started again only evaluates (or is refused): nothing to mark.
        if !finished {
            markers.push(Marker {
                step: s.step,
                kind: MarkerKind::Resumed,
                label: "resumed".into(),
            });
        }
    }
    if s.world_size != prev.world_size {
        markers.push(Marker {
            step: s.step,
            kind: MarkerKind::WorldSize,
            label: format!("world size {} → {}", prev.world_size, s.world_size),
        });
    }
    idle_s
}

#[cfg(test)]
mod tests {
    use telemetry::metrics::SCHEMA_VERSION;

    use super::*;

    fn start(restart: u32, world_size: u32, step: u64) -> Record {
        Record::Start(start_at(restart, world_size, step))
    }

    fn start_at(restart: u32, world_size: u32, step: u64) -> Start {
        Start {
            v: SCHEMA_VERSION,
            time: step as f64,
            rank: 0,
            world_size,
            restart,
            step,
            resumed: step > 0,
            from_peer: false,
            health: None,
            config: RunConfig::default(),
        }
    }

    fn step(n: u64, world_size: u32) -> Record {
        step_at(n as f64, n, world_size)
    }

    fn step_at(time: f64, n: u64, world_size: u32) -> Record {
        Record::Step(Step {
            time,
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
            slowdown: None,
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
            // The same run started again by hand, from its checkpoint, 100 s later.
            Record::Start(Start {
                time: 104.0,
                ..start_at(0, 1, 4)
            }),
            step_at(105.0, 5, 1),
            // A node added, in place.
            Record::Regroup(telemetry::metrics::Regroup {
                time: 106.0,
                rank: 0,
                world_size_before: 1,
                world_size: 2,
                step: 5,
                steps_dropped: 0,
                bytes: 0,
                received: false,
                seconds: 0.1,
                reason: "paused".into(),
            }),
            step_at(107.0, 6, 2),
        ];
        let data = RunData::from_records(&records, vec![]);
        assert_eq!(
            data.attempts
                .iter()
                .map(|a| a.steps.len())
                .collect::<Vec<_>>(),
            [3, 1, 1, 2]
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
                (4, MarkerKind::Resumed, "resumed"),
                (5, MarkerKind::Regroup, "regrouped 1 → 2"),
            ]
        );
        assert_eq!(data.world_sizes(), [2, 1, 2]);
        assert_eq!(data.restarts(), 1, "resumed by hand is not a restart");
        assert_eq!(data.last_step().map(|s| s.step), Some(6));
        // The 100 s between the last record and the start by hand are not run time.
        assert_eq!((data.idle_s, data.wall_s), (100.0, 7.0));
    }

    /// A finished run started again (it evaluates, or is refused) is no restart, and the
    /// time in between is not run time.
    #[test]
    fn a_finished_run_started_again_is_not_marked() {
        let config = RunConfig {
            epochs: 1,
            ..RunConfig::default()
        };
        let started = |time: f64, step: u64| {
            Record::Start(Start {
                time,
                config: config.clone(),
                ..start_at(0, 1, step)
            })
        };
        let epoch = Record::Epoch(telemetry::metrics::EpochDone {
            time: 2.0,
            rank: 0,
            epoch: 1,
            step: 2,
            seconds: 2.0,
            samples_digest: None,
        });
        let records = vec![
            started(0.0, 0),
            step_at(1.0, 1, 1),
            step_at(2.0, 2, 1),
            epoch,
            started(50.0, 2),
        ];
        let data = RunData::from_records(&records, vec![]);
        assert!(data.markers.is_empty(), "{:?}", data.markers);
        assert_eq!((data.idle_s, data.wall_s), (48.0, 2.0));
    }
}
