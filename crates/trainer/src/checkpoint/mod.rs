//! Model files and checkpoints.
//!
//! The model file is plain safetensors with PyTorch's names (the seed's `nn.Sequential`,
//! torchvision's ResNet keys), so `model.load_state_dict(safetensors.torch.load_file(path))`
//! works; its metadata (`trainctl.model`, [`ModelInfo`]) says which network it is and names its
//! classes, for `eval` and `predict`. A checkpoint is the same
//! tensors plus the optimizer's momentum and the training position, inside an envelope with a
//! checksum, written atomically: a crash leaves the old checkpoint or the new one, never half of
//! one, and a damaged file is reported, never used.

mod atomic;
mod info;
mod model_file;
mod tensors;
#[cfg(test)]
pub(crate) mod tests;
mod training;

pub use atomic::write_atomic;
pub use info::ModelInfo;
pub use model_file::{ModelFile, read_model, save_model};
pub use training::{
    Checkpoint, Progress, checkpoint_step, inspect_checkpoint, load_checkpoint, save_checkpoint,
    save_checkpoint_if_newer,
};

pub(crate) use model_file::describe_model;
pub(crate) use training::{envelope, parse_checkpoint};
