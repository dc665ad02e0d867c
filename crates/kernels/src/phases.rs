//! Time inside a kernel, phase by phase (a Winograd layer's input transform apart from its
//! products and its weight's transform), for `trainctl bench --layers`: off unless a benchmark
//! turns it on, at the cost of one relaxed load a phase. What a layer's rate in the operation
//! profile does not say: which of its passes holds it below the peak.
//!
//! A phase is timed on the thread that runs it, however many threads it shares its work with;
//! phases that run side by side (the chunks of a Winograd backward, one group of chunks a
//! thread) add up their threads' times.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static TIMES: Mutex<BTreeMap<String, Phase>> = Mutex::new(BTreeMap::new());

/// One phase of one kernel at one shape: its runs and their seconds, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phase {
    pub calls: usize,
    pub seconds: f64,
}

/// Starts recording (and forgets what was recorded before).
pub fn start() {
    TIMES.lock().unwrap_or_else(|e| e.into_inner()).clear();
    ON.store(true, Ordering::Relaxed);
}

/// Stops recording and returns what was recorded, by phase name.
pub fn finish() -> BTreeMap<String, Phase> {
    ON.store(false, Ordering::Relaxed);
    std::mem::take(&mut *TIMES.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Runs `f`, adding its time to the phase `name()` names (`name` runs only while recording).
pub(crate) fn timed<R>(name: impl FnOnce() -> String, f: impl FnOnce() -> R) -> R {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    let seconds = t0.elapsed().as_secs_f64();
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let phase = times.entry(name()).or_default();
    phase.calls += 1;
    phase.seconds += seconds;
    out
}

#[cfg(test)]
mod tests {
    use crate::conv::{self, Algorithm, ConvShape, Prepared, Wanted, Weight};

    /// A Winograd layer's forward and backward while recording: each of its passes is named
    /// with the layer and timed once a call; the same calls after `finish` record nothing.
    #[test]
    fn a_recorded_layer_names_each_of_its_passes_and_an_unrecorded_one_nothing() {
        let s = ConvShape::same_3x3(2, 8, 8, 4);
        let x: Vec<f32> = (0..s.input_len()).map(|i| (i % 7) as f32 - 3.0).collect();
        let w: Vec<f32> = (0..s.weight_len()).map(|i| (i % 5) as f32 - 2.0).collect();
        let dy = vec![1.0f32; s.output_len()];
        let run = || {
            let prepared = Prepared::with(Algorithm::Winograd, &s, Weight::torch(&w));
            let y = conv::forward(&s, &x, &prepared, None, false);
            conv::backward(&s, &x, &prepared, None, &dy, Wanted::ALL);
            y
        };
        super::start();
        run();
        let recorded = super::finish();
        let name = |what: &str| format!("conv 3x3/1 8->8 at 4x4 (winograd): {what}");
        for what in [
            "weight transform",
            "input transform",
            "products",
            "output transform",
            "output gradient transform",
            "weight gradient products",
            "input gradient products",
            "input gradient transform",
            "weight gradient transform",
        ] {
            let phase = recorded.get(&name(what));
            assert!(
                phase.is_some_and(|p| p.calls >= 1 && p.seconds > 0.0),
                "{what}: {phase:?} in {:?}",
                recorded.keys().collect::<Vec<_>>()
            );
        }
        // Forward and backward each transform the input once.
        assert!(recorded[&name("input transform")].calls >= 2);
        run();
        let after = super::finish();
        assert!(
            !after
                .keys()
                .any(|k| k.starts_with("conv 3x3/1 8->8 at 4x4")),
            "recorded while off: {after:?}"
        );
    }
}
