//! [`ModelInfo`]: the network a model file or checkpoint holds, read from its metadata or told
//! from its tensor names, and checked against the network's limits before anything is sized
//! from it.

use serde::{Deserialize, Serialize};

use crate::data::Normalisation;
use crate::data::cifar::CLASS_NAMES;
use crate::model::Architecture;
use crate::model::resnet::Arch;

/// The metadata key under which a file describes its network.
pub(super) const MODEL_KEY: &str = "trainctl.model";

/// What a model file says of its network besides the tensors: enough to rebuild it, feed it
/// images as it was trained on them, and name its predictions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// `seed-cnn`, `resnet18`, ...
    pub architecture: String,
    /// Class names by index.
    pub classes: Vec<String>,
    /// Side of the square images it takes.
    pub image_size: usize,
    pub normalisation: Normalisation,
}

impl ModelInfo {
    pub fn architecture(&self) -> Result<Architecture, String> {
        Architecture::parse(&self.architecture).ok_or_else(|| {
            format!(
                "names the network {:?}, which this trainctl does not know ({})",
                self.architecture,
                Architecture::choices()
            )
        })
    }

    /// The seed CNN on CIFAR-10, as files from before models were described are.
    pub(crate) fn seed_cifar() -> ModelInfo {
        ModelInfo {
            architecture: Architecture::SeedCnn.name().into(),
            classes: CLASS_NAMES.iter().map(|c| c.to_string()).collect(),
            image_size: 32,
            normalisation: Normalisation::Cifar,
        }
    }

    /// Checks what a file's metadata says against the network's limits and the file's own
    /// tensors, before anything is sized from it: the network is known, its image size is one
    /// it takes, and it has as many classes as its classifier's bias has entries.
    pub(super) fn check(&self, tensors: &safetensors::SafeTensors) -> Result<(), String> {
        let arch = self.architecture()?;
        arch.check_image_size(self.image_size)
            .map_err(|e| format!("{MODEL_KEY} says image_size {}: {e}", self.image_size))?;
        let n = self.classes.len();
        if n == 0 || n > crate::model::MAX_CLASSES {
            return Err(format!(
                "{MODEL_KEY} names {n} classes; a model has 1 to {}",
                crate::model::MAX_CLASSES
            ));
        }
        let bias = match arch {
            Architecture::SeedCnn => "network.21.bias",
            Architecture::ResNet(_) => "fc.bias",
        };
        let have = tensors
            .tensor(bias)
            .ok()
            .map(|t| t.shape().iter().product::<usize>());
        match have {
            Some(have) if have == n => Ok(()),
            Some(have) => Err(format!(
                "{MODEL_KEY} names {n} classes but its classifier ({bias}) has {have} outputs"
            )),
            None => Err(format!(
                "{MODEL_KEY} describes a {arch} but the file has no {bias}"
            )),
        }
    }

    /// What a file without trainctl's metadata holds, told from its tensor names: the seed's
    /// `network.N` keys, or a torchvision ResNet (which one from its blocks).
    pub(super) fn infer(tensors: &safetensors::SafeTensors) -> Result<ModelInfo, String> {
        let names = tensors.names();
        let has = |n: &str| names.contains(&n);
        // The class count sizes a list of names: bounded before anything is allocated.
        let classes_of = |bias: &str| {
            tensors
                .tensor(bias)
                .ok()
                .and_then(|t| t.shape().first().copied())
                .filter(|&n| n <= crate::model::MAX_CLASSES)
        };
        if has("network.0.weight") {
            let n = classes_of("network.21.bias").ok_or(
                "has network.0.weight but no network.21.bias (or one of too many classes)",
            )?;
            let mut info = ModelInfo::seed_cifar();
            if n != CLASS_NAMES.len() {
                info.classes = (0..n).map(|i| format!("class {i}")).collect();
            }
            return Ok(info);
        }
        if has("conv1.weight") && has("fc.bias") {
            let bottleneck = has("layer1.0.conv3.weight");
            let stage3 = (0..64)
                .take_while(|i| has(&format!("layer3.{i}.conv1.weight")))
                .count();
            let arch = match (bottleneck, stage3) {
                (false, 2) => Arch::ResNet18,
                (false, 6) => Arch::ResNet34,
                (true, 6) => Arch::ResNet50,
                (true, 23) => Arch::ResNet101,
                _ => {
                    return Err(format!(
                        "looks like a ResNet but has {stage3} blocks in layer3 (bottleneck: {bottleneck}); trainctl knows {}",
                        Architecture::choices()
                    ));
                }
            };
            let n =
                classes_of("fc.bias").ok_or("fc.bias has no shape, or one of too many classes")?;
            return Ok(ModelInfo {
                architecture: arch.name().into(),
                classes: (0..n).map(|i| format!("class {i}")).collect(),
                // torchvision's ImageNet recipe.
                image_size: 224,
                normalisation: Normalisation::ImageNet,
            });
        }
        Err(format!(
            "has no {MODEL_KEY} metadata and its tensors are neither the seed CNN's (network.0.weight, ...) nor a torchvision ResNet's (conv1.weight, ..., fc.bias)"
        ))
    }
}
