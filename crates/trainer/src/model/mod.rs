//! The networks the trainer knows ([`Model`]: the seed CNN, torchvision's ResNets), the
//! limits a model file's metadata is checked against, and ([`flat`]) their tensors as flat
//! `f32` buffers with PyTorch's names.
//!
//! Invariant: tensors are always listed in the order of the model's fields (the seed's
//! `nn.Sequential` order, torchvision's `state_dict` order); flat buffers, checkpoints and the
//! all-reduce rely on it.

mod cnn;
pub(crate) mod flat;
pub mod resnet;

use burn::module::Module;
use burn::nn::BatchNorm;
use burn::tensor::{Device, Tensor};
use contract::choices::{self, Choice};

pub use cnn::SeedCnn;
pub(crate) use flat::to_vec;
pub use flat::{
    Entry, ParamGradients, Snapshot, StepGradients, buffers, load, sgd_step, snapshot, update,
};
use resnet::{Arch, ResNet};

/// Which network `trainctl train --model` trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    SeedCnn,
    ResNet(Arch),
}

impl From<choices::Model> for Architecture {
    fn from(model: choices::Model) -> Architecture {
        match model {
            choices::Model::SeedCnn => Architecture::SeedCnn,
            choices::Model::ResNet18 => Architecture::ResNet(Arch::ResNet18),
            choices::Model::ResNet34 => Architecture::ResNet(Arch::ResNet34),
            choices::Model::ResNet50 => Architecture::ResNet(Arch::ResNet50),
            choices::Model::ResNet101 => Architecture::ResNet(Arch::ResNet101),
        }
    }
}

impl Architecture {
    /// The setting that names it (`--model`, `job.model`).
    pub fn model(self) -> choices::Model {
        match self {
            Architecture::SeedCnn => choices::Model::SeedCnn,
            Architecture::ResNet(Arch::ResNet18) => choices::Model::ResNet18,
            Architecture::ResNet(Arch::ResNet34) => choices::Model::ResNet34,
            Architecture::ResNet(Arch::ResNet50) => choices::Model::ResNet50,
            Architecture::ResNet(Arch::ResNet101) => choices::Model::ResNet101,
        }
    }

    /// `seed-cnn`, `resnet18`, ...
    pub fn parse(name: &str) -> Option<Architecture> {
        choices::Model::parse(name).map(Architecture::from)
    }

    pub fn name(self) -> &'static str {
        self.model().name()
    }

    /// The names `--model` takes, for messages.
    pub fn choices() -> String {
        choices::Model::choices()
    }

    /// Why this network cannot take `size`² images, if it cannot (sizes from files are checked
    /// here too, before anything is allocated for them).
    pub fn check_image_size(self, size: usize) -> Result<(), String> {
        match self {
            Architecture::SeedCnn if size != 32 => Err(format!(
                "the seed CNN takes 32×32 images (its classifier is sized for them), not {size}×{size}: pass --image-size 32 or choose a ResNet with --model"
            )),
            Architecture::ResNet(a) if size < 32 => Err(format!(
                "{} needs images of at least 32×32 pixels, not {size}×{size}: pass a larger --image-size",
                a.name()
            )),
            Architecture::ResNet(a) if size > MAX_IMAGE_SIZE => Err(format!(
                "{} takes images of at most {MAX_IMAGE_SIZE}×{MAX_IMAGE_SIZE} pixels here, not \
                 {size}×{size} (one larger image's activations alone outgrow a machine's memory): \
                 pass a smaller --image-size",
                a.name()
            )),
            _ => Ok(()),
        }
    }
}

/// The largest image side a ResNet is built for (ImageNet's recipe trains at 224).
pub(crate) const MAX_IMAGE_SIZE: usize = 1024;

/// The most classes a model may have (ImageNet-21k has 21,841).
pub const MAX_CLASSES: usize = 100_000;

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The network being trained, evaluated or asked for predictions: what the training loop,
/// checkpoints, evaluation and prediction go through.
// A process holds one Model, so the seed CNN's smaller variant wastes nothing worth a Box, and
// boxing would put a Box in burn's Module derive, whose record paths the checkpoints rely on.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Model {
    SeedCnn(SeedCnn),
    ResNet(ResNet),
}

impl Model {
    pub fn new(arch: Architecture, classes: usize, device: &Device) -> Model {
        match arch {
            Architecture::SeedCnn => Model::SeedCnn(SeedCnn::new(classes, device)),
            Architecture::ResNet(a) => Model::ResNet(ResNet::new(a, classes, device)),
        }
    }

    /// `[batch, 3, size, size]` → logits `[batch, classes]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        match self {
            Model::SeedCnn(m) => m.forward(x),
            Model::ResNet(m) => m.forward(x),
        }
    }
}

impl Net for Model {
    fn settle(&self) {
        match self {
            Model::SeedCnn(m) => m.settle(),
            Model::ResNet(m) => m.settle(),
        }
    }

    fn torch_name(&self, path: &str) -> String {
        match self {
            Model::SeedCnn(m) => m.torch_name(path),
            Model::ResNet(m) => m.torch_name(path),
        }
    }
}

/// A network whose tensors move to and from flat buffers ([`snapshot`], [`load`],
/// [`ParamGradients`]): the seed CNN, the ResNets, [`Model`].
pub trait Net: Module + Sized {
    /// PyTorch's `state_dict` key of the tensor at burn path `path` (e.g. `conv12.weight`).
    fn torch_name(&self, path: &str) -> String;

    /// Folds the BatchNorm statistics of the last forward pass into the running state.
    ///
    /// burn's `RunningState` keeps a forward's update aside (per thread) and applies it only
    /// at the next forward; visitors and mappers see the stale value, and a value mapped in
    /// would be overwritten by the pending update. Every read or write of buffers settles first.
    /// Only the calling thread's update is folded in: settle on the thread that ran the forward
    /// (a step runs on any of the compute pool's threads, `device::on_compute_threads`), or a
    /// later forward on another thread leaves two updates that burn averages.
    fn settle(&self);
}

/// Settles each BatchNorm's pending running-statistics update (see [`Net::settle`]).
pub(crate) fn settle_norms<'a>(norms: impl IntoIterator<Item = &'a BatchNorm>) {
    for bn in norms {
        bn.running_mean.value_sync();
        bn.running_var.value_sync();
    }
}

#[cfg(test)]
mod tests {
    use contract::choices::{Choice, Model};

    use super::Architecture;

    /// The trainer knows exactly the networks the other crates offer (`job.model`).
    #[test]
    fn every_model_of_the_contract_is_a_network_and_back() {
        for model in <Model as Choice>::ALL {
            assert_eq!(Architecture::from(*model).model(), *model);
            assert_eq!(
                Architecture::parse(model.name()).map(|a| a.model()),
                Some(*model)
            );
        }
        assert_eq!(Architecture::parse("resnet152"), None);
    }
}
