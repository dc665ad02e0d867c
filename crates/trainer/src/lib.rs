//! The worker: the seed CNN and torchvision's ResNets on burn, CIFAR-10 and image folders,
//! data-parallel training over the collective,
//! crash-safe checkpoints, evaluation and prediction.

pub mod bench;
pub mod checkpoint;
pub mod cifar;
pub mod data;
pub mod device;
mod error;
pub mod eval;
pub mod model;
pub mod ops;
pub mod record;
pub mod resnet;
pub mod sampler;
pub mod train;

pub use error::{Result, TrainError};
