//! Finding a slow node across the ranks: every step, each rank's time before the all-reduce
//! (waiting for its batch, then computing) rides the step's all-reduce in slots of its own, so
//! every rank holds every rank's times at no extra collective (as the samples' digest does).
//! [`StragglerWatch`] compares the nodes over a window of steps: a node whose slowest rank takes, on
//! average over the window (its slowest quarter of steps left out), more than `factor` times the other
//! nodes' median, and at least `MIN_EXCESS_S` longer, at a window of steps in a row, is a
//! straggler; it stops being one after a window of steps in a row below the factor. A group's
//! first window of steps is no evidence (its warm-up: allocations, caches, the first batches,
//! the other workers still starting on a loaded machine). Every rank sees the same times, so
//! every rank reaches the same verdict at the same step.
//!
//! A whole job that slows down has no straggler: each node is compared with the others.

use std::collections::VecDeque;

/// Slots each rank fills in the all-reduced vector: data, compute, its node.
pub(super) const SLOTS: usize = 3;

/// A straggler must be at least this much slower per step, whatever the factor: steps of a
/// few milliseconds vary by more than their ratio means.
const MIN_EXCESS_S: f64 = 0.005;

/// The settings of the watch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StragglerConfig {
    /// A node slower than the others' median by more than this factor...
    pub factor: f64,
    /// ...over a window of this many steps is a straggler.
    pub window: usize,
}

impl Default for StragglerConfig {
    fn default() -> Self {
        StragglerConfig {
            factor: 1.5,
            window: 5,
        }
    }
}

/// This rank's contribution: zeros but for its own slots, which the mean all-reduce times the
/// world size gives back exactly enough (each slot has one non-zero term).
pub(super) fn slots(
    rank: usize,
    world_size: usize,
    data_s: f64,
    compute_s: f64,
    node: u32,
) -> Vec<f32> {
    let mut v = vec![0.0f32; SLOTS * world_size];
    if let Some(s) = v.get_mut(SLOTS * rank..SLOTS * rank + SLOTS) {
        s.copy_from_slice(&[data_s as f32, compute_s as f32, node as f32]);
    }
    v
}

/// One rank's times at one step, from the all-reduced slots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RankTimes {
    pub node: u32,
    pub data_s: f64,
    pub compute_s: f64,
}

impl RankTimes {
    pub(crate) fn busy_s(&self) -> f64 {
        self.data_s + self.compute_s
    }
}

/// Every rank's times from the mean of the slots.
pub(super) fn unpack(mean: &[f32], world_size: usize) -> Vec<RankTimes> {
    let w = world_size as f64;
    mean.chunks_exact(SLOTS)
        .map(|s| RankTimes {
            data_s: (s[0] as f64 * w).max(0.0),
            compute_s: (s[1] as f64 * w).max(0.0),
            node: (s[2] as f64 * w).round().max(0.0) as u32,
        })
        .collect()
}

/// What slows a straggler down most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Its ranks wait longer for their batches (disk, decoding, a starved loader).
    Data,
    /// Its ranks compute longer (a throttled or shared CPU, a slower GPU).
    Compute,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cause::Data => "data loading",
            Cause::Compute => "compute",
        })
    }
}

/// A node found slow, with the window's figures (medians per step).
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    pub node: u32,
    pub ranks: Vec<u32>,
    /// Its time before the all-reduce over the others' median (the window's figures).
    pub slowdown: f64,
    pub cause: Cause,
    pub data_s: f64,
    pub compute_s: f64,
    /// The other nodes' medians.
    pub others_data_s: f64,
    pub others_compute_s: f64,
}

/// A change the watch saw at a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Started(Straggler),
    /// The node is no slower than the factor any more (`slowdown`), or the group changed
    /// (`None`: it may have left).
    Ended {
        node: u32,
        slowdown: Option<f64>,
    },
}

/// The window of steps and who is a straggler now.
#[derive(Debug, Default)]
pub(crate) struct StragglerWatch {
    cfg: StragglerConfig,
    steps: VecDeque<Vec<RankTimes>>,
    current: Option<Straggler>,
    /// Steps in a row the current straggler has been below the factor.
    below: usize,
    /// Steps of the group still to ignore (its warm-up).
    warmup: usize,
    /// The node the window found slow at the last steps, and at how many in a row.
    candidate: Option<(u32, usize)>,
    /// The group's size, to tell a new group.
    group_size: Option<usize>,
}

impl StragglerWatch {
    pub(crate) fn new(cfg: StragglerConfig) -> StragglerWatch {
        StragglerWatch {
            cfg,
            ..StragglerWatch::default()
        }
    }

    /// Takes one step's times; says when a straggler starts or ends.
    pub(crate) fn step(&mut self, times: Vec<RankTimes>) -> Option<Change> {
        let window = self.cfg.window.max(1);
        // Another group (the first, or a node left or joined): its ranks and nodes are
        // others, and its first steps are its warm-up.
        if self.group_size != Some(times.len()) {
            self.group_size = Some(times.len());
            self.steps.clear();
            self.candidate = None;
            self.warmup = window;
            if let Some(gone) = self.current.take() {
                return Some(Change::Ended {
                    node: gone.node,
                    slowdown: None,
                });
            }
        }
        if self.warmup > 0 {
            self.warmup -= 1;
            return None;
        }
        self.steps.push_back(times);
        while self.steps.len() > window {
            self.steps.pop_front();
        }
        if self.steps.len() < window {
            return None;
        }
        let Some(current) = &self.current else {
            // Named once the window has found it slow at a window of steps in a row: a
            // moment of noise is no straggler.
            let Some(found) = self.slowest() else {
                self.candidate = None;
                return None;
            };
            let seen = match self.candidate {
                Some((node, seen)) if node == found.node => seen + 1,
                _ => 1,
            };
            self.candidate = Some((found.node, seen));
            if seen < window {
                return None;
            }
            self.candidate = None;
            self.current = Some(found.clone());
            self.below = 0;
            return Some(Change::Started(found));
        };
        let node = current.node;
        let slowdown = self.node_slowdown(node);
        if slowdown.is_some_and(|x| x >= self.cfg.factor) {
            self.below = 0;
            return None;
        }
        self.below += 1;
        if self.below < window {
            return None;
        }
        self.current = None;
        Some(Change::Ended { node, slowdown })
    }

    /// The node slowest over the window, if it is slower than the factor.
    fn slowest(&self) -> Option<Straggler> {
        let figures = self.node_figures();
        if figures.len() < 2 {
            return None;
        }
        let mut best: Option<Straggler> = None;
        for (node, ranks, data, compute) in &figures {
            let others: Vec<&(u32, Vec<u32>, f64, f64)> =
                figures.iter().filter(|m| m.0 != *node).collect();
            let others_data = median(others.iter().map(|m| m.2).collect());
            let others_compute = median(others.iter().map(|m| m.3).collect());
            let (busy, others_busy) = (data + compute, others_data + others_compute);
            if busy < others_busy * self.cfg.factor || busy - others_busy < MIN_EXCESS_S {
                continue;
            }
            let slowdown = busy / others_busy.max(1e-9);
            if best.as_ref().is_some_and(|b| b.slowdown >= slowdown) {
                continue;
            }
            best = Some(Straggler {
                node: *node,
                ranks: ranks.clone(),
                slowdown,
                cause: if data - others_data > compute - others_compute {
                    Cause::Data
                } else {
                    Cause::Compute
                },
                data_s: *data,
                compute_s: *compute,
                others_data_s: others_data,
                others_compute_s: others_compute,
            });
        }
        best
    }

    /// Each node's ranks and its data and compute time per step over the window: a node's
    /// time at a step is its slowest rank's (the all-reduce waits for that one), averaged over
    /// the window's steps but its slowest quarter (at least one: a pause now and then is no
    /// straggler; a node slowed most steps, or every other step as a CPU quota does, is).
    fn node_figures(&self) -> Vec<(u32, Vec<u32>, f64, f64)> {
        let Some(last) = self.steps.back() else {
            return Vec::new();
        };
        let mut nodes: Vec<u32> = last.iter().map(|t| t.node).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
            .into_iter()
            .map(|node| {
                let ranks: Vec<u32> = (0..last.len() as u32)
                    .filter(|&r| last[r as usize].node == node)
                    .collect();
                let mut per_step: Vec<RankTimes> = self
                    .steps
                    .iter()
                    .filter_map(|step| {
                        step.iter()
                            .filter(|t| t.node == node)
                            .max_by(|a, b| a.busy_s().total_cmp(&b.busy_s()))
                            .copied()
                    })
                    .collect();
                if per_step.len() >= 3 {
                    per_step.sort_by(|a, b| a.busy_s().total_cmp(&b.busy_s()));
                    per_step.truncate(per_step.len() - (per_step.len() / 4).max(1));
                }
                let n = per_step.len().max(1) as f64;
                let data = per_step.iter().map(|t| t.data_s).sum::<f64>() / n;
                let compute = per_step.iter().map(|t| t.compute_s).sum::<f64>() / n;
                (node, ranks, data, compute)
            })
            .collect()
    }

    /// `node`'s time over the others' median, by the window's figures.
    fn node_slowdown(&self, node: u32) -> Option<f64> {
        let figures = self.node_figures();
        let mine = figures.iter().find(|m| m.0 == node)?;
        let others: Vec<f64> = figures
            .iter()
            .filter(|m| m.0 != node)
            .map(|m| m.2 + m.3)
            .collect();
        if others.is_empty() {
            return None;
        }
        Some((mine.2 + mine.3) / median(others).max(1e-9))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Each rank's time before the all-reduce over the median rank's, for the metrics.
pub(crate) fn relative_speeds(times: &[RankTimes]) -> Vec<f64> {
    let m = median(times.iter().map(RankTimes::busy_s).collect()).max(1e-9);
    times.iter().map(|t| t.busy_s() / m).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared scenarios (`vectors/stragglers.json` at the repository's root), which the
    /// Python package's watch is checked against too (python/tests/test_vectors.py).
    #[test]
    fn verdicts_follow_the_shared_scenarios() {
        #[derive(serde::Deserialize)]
        struct Started {
            node: u32,
            ranks: Vec<u32>,
            slowdown: f64,
            cause: String,
            data_s: f64,
            compute_s: f64,
            others_data_s: f64,
            others_compute_s: f64,
        }
        #[derive(serde::Deserialize)]
        struct Expected {
            at: usize,
            started: Option<Started>,
            ended: Option<u32>,
            slowdown: Option<f64>,
        }
        #[derive(serde::Deserialize)]
        struct Scenario {
            case: String,
            factor: f64,
            window: usize,
            steps: Vec<Vec<(u32, f64, f64)>>,
            changes: Vec<Expected>,
        }
        #[derive(serde::Deserialize)]
        struct Vectors {
            scenarios: Vec<Scenario>,
        }
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../vectors/stragglers.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let v: Vectors = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!v.scenarios.is_empty());
        for sc in v.scenarios {
            let mut watch = StragglerWatch::new(StragglerConfig {
                factor: sc.factor,
                window: sc.window,
            });
            let mut changes = Vec::new();
            for (at, ranks) in sc.steps.iter().enumerate() {
                let times = ranks
                    .iter()
                    .map(|&(node, data_s, compute_s)| RankTimes {
                        node,
                        data_s,
                        compute_s,
                    })
                    .collect();
                if let Some(change) = watch.step(times) {
                    changes.push((at, change));
                }
            }
            let case = &sc.case;
            assert_eq!(changes.len(), sc.changes.len(), "{case}: {changes:?}");
            for ((at, got), want) in changes.iter().zip(&sc.changes) {
                assert_eq!(*at, want.at, "{case}: {got:?}");
                match (got, &want.started, want.ended) {
                    (Change::Started(s), Some(w), None) => {
                        assert_eq!((s.node, &s.ranks), (w.node, &w.ranks), "{case}");
                        assert_eq!(s.cause.to_string(), w.cause, "{case}");
                        for (a, b) in [
                            (s.slowdown, w.slowdown),
                            (s.data_s, w.data_s),
                            (s.compute_s, w.compute_s),
                            (s.others_data_s, w.others_data_s),
                            (s.others_compute_s, w.others_compute_s),
                        ] {
                            assert!(close(a, b), "{case}: {a} against {b}");
                        }
                    }
                    (Change::Ended { node, slowdown }, None, Some(w)) => {
                        assert_eq!(*node, w, "{case}");
                        match (slowdown, want.slowdown) {
                            (Some(a), Some(b)) => assert!(close(*a, b), "{case}: {a} against {b}"),
                            (a, b) => assert_eq!(a.is_some(), b.is_some(), "{case}"),
                        }
                    }
                    _ => panic!("{case}: at step {at}, {got:?}"),
                }
            }
        }
    }

    /// `nodes` nodes of `per_node` ranks, each taking `busy(node)` seconds of compute.
    fn step(nodes: u32, per_node: u32, busy: impl Fn(u32) -> f64) -> Vec<RankTimes> {
        (0..nodes * per_node)
            .map(|r| {
                let node = r / per_node;
                RankTimes {
                    node,
                    data_s: 0.01,
                    compute_s: busy(node),
                }
            })
            .collect()
    }

    #[test]
    fn the_slots_come_back_through_the_mean_all_reduce() {
        let world = 6;
        let mut sum = vec![0.0f32; SLOTS * world];
        for r in 0..world {
            for (s, v) in sum
                .iter_mut()
                .zip(slots(r, world, 0.01 * r as f64, 0.2, r as u32 / 2))
            {
                *s += v;
            }
        }
        let mean: Vec<f32> = sum.iter().map(|s| s / world as f32).collect();
        let times = unpack(&mean, world);
        for (r, t) in times.iter().enumerate() {
            assert_eq!(t.node, r as u32 / 2);
            assert!((t.data_s - 0.01 * r as f64).abs() < 1e-6, "{t:?}");
            assert!((t.compute_s - 0.2).abs() < 1e-6, "{t:?}");
        }
    }

    #[test]
    fn a_slow_node_is_named_after_a_window_once_and_its_end_once() {
        let mut w = StragglerWatch::new(StragglerConfig::default());
        for _ in 0..10 {
            assert_eq!(w.step(step(4, 2, |_| 0.1)), None, "nobody is slow");
        }
        let mut started = Vec::new();
        for i in 0..12 {
            if let Some(c) = w.step(step(4, 2, |n| if n == 2 { 0.3 } else { 0.1 })) {
                started.push((i, c));
            }
        }
        assert_eq!(started.len(), 1, "{started:?}");
        let (at, Change::Started(s)) = &started[0] else {
            panic!("{started:?}");
        };
        assert!(*at < 10, "named within two windows: step {at}");
        assert_eq!(
            (s.node, s.ranks.clone(), s.cause),
            (2, vec![4, 5], Cause::Compute)
        );
        // Named once the window has said so for a window of steps: it holds only slow steps.
        assert!(
            s.slowdown > 1.5 && s.slowdown <= 0.31 / 0.11 + 1e-9,
            "{s:?}"
        );
        let mut ended = Vec::new();
        for i in 0..12 {
            if let Some(c) = w.step(step(4, 2, |_| 0.1)) {
                ended.push((i, c));
            }
        }
        assert!(
            matches!(ended.as_slice(), [(_, Change::Ended { node: 2, .. })]),
            "{ended:?}"
        );
    }

    #[test]
    fn a_whole_job_slowing_down_has_no_straggler() {
        let mut w = StragglerWatch::new(StragglerConfig::default());
        for i in 0..30 {
            let busy = if i < 10 { 0.1 } else { 0.4 };
            assert_eq!(w.step(step(3, 1, |_| busy)), None);
        }
    }

    #[test]
    fn a_node_slow_for_a_step_now_and_then_is_not_one() {
        let mut w = StragglerWatch::new(StragglerConfig::default());
        for i in 0..40 {
            let slow = i % 8 == 0;
            assert_eq!(
                w.step(step(3, 1, |n| if n == 1 && slow { 0.5 } else { 0.1 })),
                None
            );
        }
    }

    /// A CPU quota: the node is fast while its quota lasts, then stopped for the rest of the
    /// period, so some of its steps are very slow and some are not.
    #[test]
    fn a_node_slow_every_other_step_is_one() {
        let mut w = StragglerWatch::new(StragglerConfig::default());
        let mut started = None;
        for i in 0..24 {
            let c = w.step(step(
                3,
                1,
                |n| if n == 0 && i % 2 == 1 { 0.5 } else { 0.01 },
            ));
            if let Some(Change::Started(s)) = c {
                started = Some((i, s.node));
            }
        }
        // Its warm-up, a window to fill, a window of steps to confirm.
        assert!(matches!(started, Some((i, 0)) if i < 16), "{started:?}");
    }

    #[test]
    fn tiny_steps_need_a_real_excess_and_data_waits_are_told_apart() {
        let mut w = StragglerWatch::new(StragglerConfig::default());
        for _ in 0..10 {
            // Twice as slow, but by a millisecond: noise.
            assert_eq!(w.step(step(2, 1, |n| 0.001 * (n + 1) as f64)), None);
        }
        let mut w = StragglerWatch::new(StragglerConfig::default());
        let mut change = None;
        for _ in 0..16 {
            let times: Vec<RankTimes> = (0..2)
                .map(|n| RankTimes {
                    node: n,
                    data_s: if n == 0 { 0.3 } else { 0.01 },
                    compute_s: 0.1,
                })
                .collect();
            change = change.or(w.step(times));
        }
        let Some(Change::Started(s)) = change else {
            panic!("{change:?}");
        };
        assert_eq!((s.node, s.cause), (0, Cause::Data));
    }

    /// Issue 60, item 7: a group's start-up is no evidence. A node slow for its first steps
    /// (its worker still starting on a loaded machine) and fine after is never named; a node
    /// slow from the start and staying slow is, once past the warm-up and a window of steps
    /// in a row; a few steps of noise later on are not.
    #[test]
    fn start_up_noise_is_no_straggler_but_a_node_slow_from_the_start_is_one() {
        let mut w = StragglerWatch::new(StragglerConfig::default());
        for i in 0..40 {
            let slow_start = |n: u32| if n == 0 && i < 6 { 0.4 } else { 0.1 };
            assert_eq!(w.step(step(3, 1, slow_start)), None, "step {i}");
        }
        // Later, two steps of noise on one node (six times slower): the window finds it slow
        // for fewer than a window of steps in a row.
        for i in 0..20 {
            let noise = |n: u32| {
                if n == 2 && (3..5).contains(&i) {
                    0.6
                } else {
                    0.1
                }
            };
            assert_eq!(w.step(step(3, 1, noise)), None, "noise at step {i}");
        }
        let mut w = StragglerWatch::new(StragglerConfig::default());
        let mut started = None;
        for i in 0..30 {
            if let Some(Change::Started(s)) = w.step(step(3, 1, |n| if n == 1 { 0.4 } else { 0.1 }))
            {
                started = started.or(Some((i, s.node)));
            }
        }
        assert!(
            matches!(started, Some((i, 1)) if (13..20).contains(&i)),
            "named after its warm-up, a window and a window in a row: {started:?}"
        );
    }

    #[test]
    fn relative_speeds_are_over_the_median_rank() {
        let t = step(3, 1, |n| [0.1, 0.1, 0.3][n as usize]);
        let r = relative_speeds(&t);
        assert!(
            (r[2] - 0.31 / 0.11).abs() < 1e-9 && (r[0] - 1.0).abs() < 1e-9,
            "{r:?}"
        );
    }
}
