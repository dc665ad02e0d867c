//! The worker: the seed CNN and torchvision's ResNets on burn, CIFAR-10 and image folders,
//! data-parallel training over the collective,
//! crash-safe checkpoints, evaluation and prediction.

pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod device;
mod error;
pub mod eval;
#[doc(hidden)]
pub mod fuzzing;
pub mod model;
pub(crate) mod ops;
pub mod sampler;
pub mod train;

pub use error::{Result, TrainError};
