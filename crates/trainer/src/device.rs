//! The one place that chooses where tensors live.
//!
//! Invariant: no other module names a backend. A `cuda` feature adds its device here, and
//! nowhere else.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Device;
use kernels::Precision;

/// The backend's name, as run records give it.
pub(crate) const BACKEND: &str = "flex";

/// The device a model is trained on (with autodiff).
pub(crate) fn training_device() -> Device {
    inference_device().autodiff()
}

/// The device for evaluation and prediction.
pub fn inference_device() -> Device {
    Device::flex()
}

/// Sizes the CPU backend's thread pool. Call once, before any tensor work; a second call keeps
/// the first size (the pool is global) and says so.
pub(crate) fn set_cpu_threads(threads: usize) {
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build_global()
    {
        tracing::debug!(error = %e, "thread pool already sized");
    }
}

/// Whether the convolutions' GEMMs take bf16 inputs ([`set_precision`]).
static BF16: AtomicBool = AtomicBool::new(false);

/// Sets the precision of the convolutions' arithmetic for the whole process, as
/// [`set_cpu_threads`] sizes its pool: [`Precision::Bf16`] rounds their GEMMs' inputs to bf16
/// and sums in f32 (PyTorch's CPU autocast); weights, gradients, the optimizer and batch
/// norm stay f32 either way. Refused, with what to do, where the CPU cannot.
pub fn set_precision(precision: Precision) -> Result<(), String> {
    check_precision(precision, kernels::available(precision))?;
    BF16.store(precision == Precision::Bf16, Ordering::Relaxed);
    Ok(())
}

/// The precision [`set_precision`] set (f32 unless it was called).
pub fn precision() -> Precision {
    if BF16.load(Ordering::Relaxed) {
        Precision::Bf16
    } else {
        Precision::F32
    }
}

/// `precision` where the CPU has it (`available`), else what to do instead.
pub fn check_precision(precision: Precision, available: bool) -> Result<(), String> {
    if available {
        return Ok(());
    }
    Err(format!(
        "--precision {}: this CPU has no AVX512_BF16 (the bf16 multiply-add trainctl's bf16 \
         GEMM is built on; Intel Cooper Lake or Sapphire Rapids and later, AMD Zen 4 and later \
         have it); leave --precision out to train in fp32",
        precision.name()
    ))
}

/// Runs `f` on a thread of the pool [`set_cpu_threads`] sized, the caller waiting, with the
/// pool's other threads kept awake for its parallel loops until it returns
/// ([`kernels::awake`]). The kernels' parallel loops started from a thread outside the pool are
/// each handed to it and waited for (a wake-up and a sleep per loop: about 7,000 context
/// switches in 9 resnet18 steps at 1 thread, 17 with the steps run here); started on one of its
/// threads they are queued on that thread's own deque. Run a step's forward, backward and
/// update through this; nothing that waits on the network or a disk.
pub(crate) fn on_compute_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    kernels::awake::with_threads_awake(f)
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
    fn bf16_is_refused_with_what_to_do_where_the_cpu_lacks_it() {
        assert_eq!(check_precision(Precision::F32, true), Ok(()));
        assert_eq!(check_precision(Precision::Bf16, true), Ok(()));
        let refused = check_precision(Precision::Bf16, false).unwrap_err();
        assert!(
            refused.contains("--precision bf16")
                && refused.contains("AVX512_BF16")
                && refused.contains("leave --precision out"),
            "{refused}"
        );
    }

    #[test]
    fn compute_runs_on_a_thread_of_the_pool() {
        assert_eq!(rayon::current_thread_index(), None, "a test thread");
        assert!(
            on_compute_threads(rayon::current_thread_index).is_some(),
            "the step would hand each parallel loop to the pool"
        );
    }
}
