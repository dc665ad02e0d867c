//! The one place that chooses where tensors live.
//!
//! Invariant: no other module names a backend. A `cuda` feature adds its device here, and
//! nowhere else.

use burn::tensor::Device;

/// The backend's name, as run records give it.
pub const BACKEND: &str = "flex";

/// The device a model is trained on (with autodiff).
pub fn training_device() -> Device {
    inference_device().autodiff()
}

/// The device for evaluation and prediction.
pub fn inference_device() -> Device {
    Device::flex()
}

/// Sizes the CPU backend's thread pool. Call once, before any tensor work; a second call keeps
/// the first size (the pool is global) and says so.
pub fn set_cpu_threads(threads: usize) {
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build_global()
    {
        tracing::debug!(error = %e, "thread pool already sized");
    }
}

/// Threads per worker when the user gives none: the machine's cores shared by the local workers.
pub fn default_threads(local_world_size: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_world_size.max(1)).max(1)
}
