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

/// Measurements by name that a benchmark turns on, then collects: off, a caller pays one
/// relaxed load. The kernels' passes here; `trainer::ops::profile`'s operations too.
pub struct Recording<T> {
    on: AtomicBool,
    entries: Mutex<BTreeMap<String, T>>,
}

impl<T: Default> Recording<T> {
    pub const fn new() -> Self {
        Recording {
            on: AtomicBool::new(false),
            entries: Mutex::new(BTreeMap::new()),
        }
    }

    /// Starts recording (and forgets what was recorded before).
    pub fn start(&self) {
        self.lock().clear();
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops recording and returns what was recorded, by name.
    pub fn finish(&self) -> BTreeMap<String, T> {
        self.on.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.lock())
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Updates the entry `name` (a default one if it is new).
    pub fn update(&self, name: String, f: impl FnOnce(&mut T)) {
        f(self.lock().entry(name).or_default());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, T>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T: Default> Default for Recording<T> {
    fn default() -> Self {
        Self::new()
    }
}

static PHASES: Recording<Phase> = Recording::new();

/// One phase of one kernel at one shape: its runs and their seconds, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phase {
    pub calls: usize,
    pub seconds: f64,
}

/// Starts recording (and forgets what was recorded before).
pub fn start() {
    PHASES.start();
}

/// Stops recording and returns what was recorded, by phase name.
pub fn finish() -> BTreeMap<String, Phase> {
    PHASES.finish()
}

/// Runs `f`, adding its time to the phase `name()` names (`name` runs only while recording).
pub(crate) fn timed<R>(name: impl FnOnce() -> String, f: impl FnOnce() -> R) -> R {
    if !PHASES.is_on() {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    let seconds = t0.elapsed().as_secs_f64();
    PHASES.update(name(), |phase| {
        phase.calls += 1;
        phase.seconds += seconds;
    });
    out
}

#[cfg(test)]
mod tests {
    use crate::conv::{self, Algorithm, ConvShape, Prepared, Wanted, Weight};
    use std::sync::Mutex;

    /// Held by each test here: the recording is one for the whole process.
    static RECORDING: Mutex<()> = Mutex::new(());

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
        let _alone = RECORDING.lock().unwrap_or_else(|e| e.into_inner());
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

    /// An im2col layer (a 3×3 at stride 2, whose patches are copied and whose input gradient
    /// goes back through col2im) names its passes too, the products apart from the patches.
    #[test]
    fn a_recorded_im2col_layer_names_its_products_apart_from_its_patches() {
        let s = ConvShape {
            stride: [2, 2],
            ..ConvShape::same_3x3(2, 8, 8, 4)
        };
        let x: Vec<f32> = (0..s.input_len()).map(|i| (i % 7) as f32 - 3.0).collect();
        let w: Vec<f32> = (0..s.weight_len()).map(|i| (i % 5) as f32 - 2.0).collect();
        let dy = vec![1.0f32; s.output_len()];
        let _alone = RECORDING.lock().unwrap_or_else(|e| e.into_inner());
        super::start();
        let prepared = Prepared::with(Algorithm::Im2col, &s, Weight::torch(&w));
        conv::forward(&s, &x, &prepared, None, false);
        conv::backward(&s, &x, &prepared, None, &dy, Wanted::ALL);
        let recorded = super::finish();
        for what in [
            "weight layout",
            "patches",
            "products",
            "output gradient (ReLU mask, bias)",
            "weight gradient products",
            "input gradient products",
            "input gradient (col2im)",
            "weight gradient sum",
            "weight gradient layout",
        ] {
            let name = format!("conv 3x3/2 8->8 at 4x4 (im2col): {what}");
            assert!(
                recorded.get(&name).is_some_and(|p| p.calls >= 1),
                "{name} in {:?}",
                recorded.keys().collect::<Vec<_>>()
            );
        }
    }
}
