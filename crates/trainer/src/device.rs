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

/// Runs `f` on a thread of the pool [`set_cpu_threads`] sized, the caller waiting. The kernels'
/// parallel loops started from a thread outside the pool are each handed to it and waited for
/// (a wake-up and a sleep per loop: about 7,000 context switches in 9 resnet18 steps at 1
/// thread, 17 with the steps run here); started on one of its threads they are queued on that
/// thread's own deque. Run a step's forward and backward through this.
pub fn on_compute_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Threads per worker when the user gives none: the machine's cores shared by the local workers.
pub fn default_threads(local_world_size: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_world_size.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_runs_on_a_thread_of_the_pool() {
        assert_eq!(rayon::current_thread_index(), None, "a test thread");
        assert!(
            on_compute_threads(rayon::current_thread_index).is_some(),
            "the step would hand each parallel loop to the pool"
        );
    }
}
