//! Time spent in each of trainctl's operations, by shape, for `trainctl bench --layers`: off
//! (one relaxed load per operation) unless a benchmark turns it on.

use std::collections::BTreeMap;
use std::time::Instant;

use kernels::phases::Recording;

static TIMES: Recording<OpTimes> = Recording::new();

/// One operation at one shape: calls and seconds over the recorded steps, and the arithmetic of
/// one call.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub(crate) struct OpTimes {
    /// A convolution's shape.
    pub conv: Option<kernels::conv::ConvShape>,
    pub calls: usize,
    pub forward_s: f64,
    pub backward_s: f64,
    pub forward_flops: Flops,
}

/// A forward call's arithmetic, 2 per multiply-add (0 where there is none to speak of).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub(crate) struct Flops {
    /// As the direct algorithm computes it: the same for every algorithm, so that the rates of
    /// two algorithms compare (Winograd's can pass the machine's peak).
    pub nominal: f64,
    /// As the chosen algorithm's GEMMs compute it (`kernels::conv::Algorithm::multiply_adds`):
    /// over the time, the rate the layer's arithmetic actually runs at, against the peak.
    pub executed: f64,
}

/// Starts recording (and forgets what was recorded before).
pub(crate) fn start() {
    TIMES.start();
}

/// Stops recording and returns what was recorded, by operation name.
pub(crate) fn finish() -> BTreeMap<String, OpTimes> {
    TIMES.finish()
}

/// Runs the forward pass `f`, adding a call and its time to the operation `what()` names
/// (with its arithmetic; `what` runs only while recording, off the training step's path).
pub(crate) fn timed<R>(
    what: impl FnOnce() -> (String, Flops),
    conv: Option<kernels::conv::ConvShape>,
    f: impl FnOnce() -> R,
) -> R {
    if !TIMES.is_on() {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    let seconds = t0.elapsed().as_secs_f64();
    let (name, forward_flops) = what();
    TIMES.update(name, |entry| {
        entry.conv = conv;
        entry.calls += 1;
        entry.forward_s += seconds;
        entry.forward_flops = forward_flops;
    });
    out
}

/// A backward pass being timed: its time goes to its operation when this is dropped.
pub(crate) struct Backward(Option<(String, Instant)>);

impl Backward {
    pub(crate) fn start(name: impl FnOnce() -> String) -> Self {
        Backward(TIMES.is_on().then(|| (name(), Instant::now())))
    }
}

impl Drop for Backward {
    fn drop(&mut self) {
        if let Some((name, t0)) = self.0.take() {
            let seconds = t0.elapsed().as_secs_f64();
            TIMES.update(name, |entry| entry.backward_s += seconds);
        }
    }
}
