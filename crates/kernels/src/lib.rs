//! trainctl's CPU compute kernels over plain `f32` slices: convolution (pixel by pixel for
//! small outputs whose windows are mostly padding, Winograd F(4×4, 3×3) or F(2×2, 3×3) for
//! stride-1 3×3 layers, batched im2col + GEMM for the rest; bias and ReLU fused; both
//! gradients), max pooling, batch norm, layout conversions and the SGD update.
//!
//! No burn here: `trainer::ops` registers these kernels with burn's flex backend. Everything is
//! deterministic: the same inputs give bit-identical outputs whatever the thread count, which
//! data-parallel training relies on (every rank must hold the same weights).

pub mod awake;
pub mod bench;
pub mod conv;
pub mod layout;
pub mod matmul;
pub use matmul::{Precision, available};
pub mod norm;
pub mod phases;
pub mod pool;
mod scratch;
pub mod sgd;

#[cfg(test)]
mod tests;
