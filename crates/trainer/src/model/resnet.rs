//! torchvision's ResNets (resnet18, 34, 50, 101) as burn modules, on trainctl's kernels.
//!
//! The architecture is torchvision's (`torchvision.models.resnet`): a 7×7 stride-2 stem
//! without bias, BatchNorm, ReLU, 3×3 stride-2 max pooling with padding 1, four stages of
//! BasicBlocks (18, 34) or Bottlenecks (50, 101; the stride in the 3×3, as torchvision's "v1.5"),
//! a 1×1 convolution + BatchNorm shortcut where the shape changes, adaptive average pooling and
//! one linear layer. Any input of at least 32×32 pixels and any number of classes. Fields are
//! named so that [`torch_name`] gives torchvision's `state_dict` keys.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Initializer, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::{Device, Tensor};

use super::{Net, settle_norms};
use crate::ops::{Input, batch_norm, conv2d, max_pool2d, norm_add_relu};

/// Which ResNet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    ResNet18,
    ResNet34,
    ResNet50,
    ResNet101,
}

impl Arch {
    pub const ALL: [Arch; 4] = [
        Arch::ResNet18,
        Arch::ResNet34,
        Arch::ResNet50,
        Arch::ResNet101,
    ];

    /// torchvision's name: `resnet18`, ...
    pub fn name(self) -> &'static str {
        super::Architecture::ResNet(self).name()
    }

    /// Blocks per stage.
    fn blocks(self) -> [usize; 4] {
        match self {
            Arch::ResNet18 => [2, 2, 2, 2],
            Arch::ResNet34 | Arch::ResNet50 => [3, 4, 6, 3],
            Arch::ResNet101 => [3, 4, 23, 3],
        }
    }

    fn bottleneck(self) -> bool {
        matches!(self, Arch::ResNet50 | Arch::ResNet101)
    }

    /// Output channels of a block over its width (`planes`): 1 (BasicBlock) or 4 (Bottleneck).
    fn expansion(self) -> usize {
        if self.bottleneck() { 4 } else { 1 }
    }
}

/// The shortcut of a block whose shape changes: torchvision's `downsample` Sequential
/// (`downsample.0` the 1×1 convolution, `downsample.1` its BatchNorm).
#[derive(Module, Debug)]
pub(crate) struct Downsample {
    conv: Conv2d,
    bn: BatchNorm,
}

/// A BasicBlock (`conv3`/`bn3` absent) or a Bottleneck.
#[derive(Module, Debug)]
pub(crate) struct Block {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    conv3: Option<Conv2d>,
    bn3: Option<BatchNorm>,
    downsample: Option<Downsample>,
}

#[derive(Module, Debug)]
pub struct ResNet {
    conv1: Conv2d,
    bn1: BatchNorm,
    layer1: Vec<Block>,
    layer2: Vec<Block>,
    layer3: Vec<Block>,
    layer4: Vec<Block>,
    fc: Linear,
    maxpool: MaxPool2d,
}

/// A convolution without bias, initialised as torchvision does (Kaiming normal, fan out, ReLU
/// gain).
fn conv(inputs: usize, outputs: usize, kernel: usize, stride: usize, device: &Device) -> Conv2d {
    let pad = kernel / 2;
    Conv2dConfig::new([inputs, outputs], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_bias(false)
        .with_initializer(Initializer::KaimingNormal {
            gain: std::f64::consts::SQRT_2,
            fan_out_only: true,
        })
        .init(device)
}

fn norm(channels: usize, device: &Device) -> BatchNorm {
    BatchNormConfig::new(channels).init(device)
}

impl Block {
    fn new(arch: Arch, inputs: usize, planes: usize, stride: usize, device: &Device) -> Block {
        let outputs = planes * arch.expansion();
        let downsample = (stride != 1 || inputs != outputs).then(|| Downsample {
            conv: conv(inputs, outputs, 1, stride, device),
            bn: norm(outputs, device),
        });
        if arch.bottleneck() {
            Block {
                conv1: conv(inputs, planes, 1, 1, device),
                bn1: norm(planes, device),
                conv2: conv(planes, planes, 3, stride, device),
                bn2: norm(planes, device),
                conv3: Some(conv(planes, outputs, 1, 1, device)),
                bn3: Some(norm(outputs, device)),
                downsample,
            }
        } else {
            Block {
                conv1: conv(inputs, planes, 3, stride, device),
                bn1: norm(planes, device),
                conv2: conv(planes, planes, 3, 1, device),
                bn2: norm(planes, device),
                conv3: None,
                bn3: None,
                downsample,
            }
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        // Each norm with what follows it fused: the ReLU, and at the end the residual add. The
        // block's input goes to its first convolution and to the residual or the downsample
        // path: shared.
        let conv1 = conv2d(&self.conv1, x.clone(), false, Input::Shared);
        let out = norm_add_relu(&self.bn1, conv1, None, true);
        let residual = |x: Tensor<4>| match &self.downsample {
            Some(d) => (
                batch_norm(&d.bn, conv2d(&d.conv, x, false, Input::Shared)),
                Input::Once,
            ),
            None => (x, Input::Shared),
        };
        match (&self.conv3, &self.bn3) {
            (Some(conv3), Some(bn3)) => {
                let out = conv2d(&self.conv2, out, false, Input::Once);
                let out = norm_add_relu(&self.bn2, out, None, true);
                let out = conv2d(conv3, out, false, Input::Once);
                norm_add_relu(bn3, out, Some(residual(x)), true)
            }
            _ => {
                let out = conv2d(&self.conv2, out, false, Input::Once);
                norm_add_relu(&self.bn2, out, Some(residual(x)), true)
            }
        }
    }

    fn norms(&self) -> impl Iterator<Item = &BatchNorm> {
        [Some(&self.bn1), Some(&self.bn2), self.bn3.as_ref()]
            .into_iter()
            .flatten()
            .chain(self.downsample.as_ref().map(|d| &d.bn))
    }
}

impl ResNet {
    pub fn new(arch: Arch, classes: usize, device: &Device) -> ResNet {
        let mut inputs = 64;
        let mut stage = |planes: usize, stride: usize, blocks: usize| -> Vec<Block> {
            (0..blocks)
                .map(|i| {
                    let block = Block::new(
                        arch,
                        inputs,
                        planes,
                        if i == 0 { stride } else { 1 },
                        device,
                    );
                    inputs = planes * arch.expansion();
                    block
                })
                .collect()
        };
        let [b1, b2, b3, b4] = arch.blocks();
        let layer1 = stage(64, 1, b1);
        let layer2 = stage(128, 2, b2);
        let layer3 = stage(256, 2, b3);
        let layer4 = stage(512, 2, b4);
        ResNet {
            conv1: conv(3, 64, 7, 2, device),
            bn1: norm(64, device),
            layer1,
            layer2,
            layer3,
            layer4,
            fc: LinearConfig::new(512 * arch.expansion(), classes).init(device),
            maxpool: MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
        }
    }

    /// `[batch, 3, H, W]` (H, W ≥ 32) → logits `[batch, classes]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = norm_add_relu(
            &self.bn1,
            conv2d(&self.conv1, x, false, Input::Once),
            None,
            true,
        );
        let mut x = max_pool2d(&self.maxpool, x);
        for block in self.blocks() {
            x = block.forward(x);
        }
        // Adaptive average pooling to 1×1, then flatten.
        let x: Tensor<2> = x.mean_dim(3).mean_dim(2).flatten(1, 3);
        self.fc.forward(x)
    }

    fn blocks(&self) -> impl Iterator<Item = &Block> {
        self.layer1
            .iter()
            .chain(&self.layer2)
            .chain(&self.layer3)
            .chain(&self.layer4)
    }
}

impl Net for ResNet {
    fn settle(&self) {
        settle_norms(std::iter::once(&self.bn1).chain(self.blocks().flat_map(Block::norms)));
    }

    fn torch_name(&self, path: &str) -> String {
        torch_name(path)
    }
}

/// torchvision's `state_dict` key of the tensor at burn path `path`: BatchNorm's `gamma` and
/// `beta` are `weight` and `bias`, a shortcut's convolution and BatchNorm are `downsample.0`
/// and `downsample.1`.
pub(crate) fn torch_name(path: &str) -> String {
    path.split('.')
        .map(|part| match part {
            "gamma" => "weight",
            "beta" => "bias",
            "conv" => "0",
            "bn" => "1",
            other => other,
        })
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::training_device;
    use crate::model::{ParamGradients, snapshot, to_vec};
    use burn::tensor::TensorData;

    /// The parameter counts torchvision's models have with 1000 classes
    /// (`sum(p.numel() for p in resnetN().parameters())`, as torchvision's model table lists).
    #[test]
    fn parameter_counts_are_torchvisions() {
        let device = training_device();
        for (arch, count) in [
            (Arch::ResNet18, 11_689_512),
            (Arch::ResNet34, 21_797_672),
            (Arch::ResNet50, 25_557_032),
            (Arch::ResNet101, 44_549_160),
        ] {
            let model = ResNet::new(arch, 1000, &device);
            assert_eq!(snapshot(&model).params.len(), count, "{}", arch.name());
        }
    }

    /// torchvision's key names, in its order, for the stem, a first block with a shortcut, a
    /// bottleneck's third convolution and the classifier.
    #[test]
    fn tensors_carry_torchvisions_names() {
        let device = training_device();
        let names = |arch| -> Vec<String> {
            snapshot(&ResNet::new(arch, 10, &device))
                .entries
                .iter()
                .map(|e| torch_name(&e.path))
                .collect()
        };
        let r18 = names(Arch::ResNet18);
        assert_eq!(
            r18[..6],
            [
                "conv1.weight",
                "bn1.weight",
                "bn1.bias",
                "bn1.running_mean",
                "bn1.running_var",
                "layer1.0.conv1.weight"
            ]
        );
        for name in [
            "layer2.0.downsample.0.weight",
            "layer2.0.downsample.1.weight",
            "layer2.0.downsample.1.running_var",
            "layer4.1.bn2.bias",
            "fc.weight",
            "fc.bias",
        ] {
            assert!(r18.iter().any(|n| n == name), "{name} not in {r18:?}");
        }
        assert!(!r18.iter().any(|n| n.starts_with("layer1.0.downsample")));
        assert!(!r18.iter().any(|n| n.contains("conv3")));
        let r50 = names(Arch::ResNet50);
        for name in [
            "layer1.0.downsample.0.weight",
            "layer3.5.conv3.weight",
            "layer3.5.bn3.running_mean",
        ] {
            assert!(r50.iter().any(|n| n == name), "{name} not in resnet50");
        }
        assert!(!r50.iter().any(|n| n.starts_with("layer3.6")));
    }

    /// Any input of at least 32 pixels: logits for every class, and a gradient for every
    /// parameter.
    #[test]
    fn forward_and_backward_at_small_and_odd_sizes() {
        let device = training_device();
        for (arch, size) in [(Arch::ResNet18, 32), (Arch::ResNet50, 45)] {
            let model = ResNet::new(arch, 7, &device);
            let n = 2 * 3 * size * size;
            let pixels: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 / 101.0).collect();
            let x = Tensor::<4>::from_data(TensorData::new(pixels, [2, 3, size, size]), &device);
            let logits = model.forward(x);
            assert_eq!(logits.dims(), [2, 7]);
            let values = to_vec(logits.clone());
            assert!(values.iter().all(|v| v.is_finite()), "{values:?}");
            let mut grads = logits.sum().backward();
            let mut flat = Vec::new();
            ParamGradients::take(&model, &mut grads).flatten_into(&mut flat);
            let snap = snapshot(&model);
            assert_eq!(flat.len(), snap.params.len());
            // Every tensor got a gradient (a parameter left out of the graph would be all zeros).
            let mut at = 0;
            for e in snap.entries.iter().filter(|e| e.trainable) {
                let g = &flat[at..at + e.numel()];
                at += e.numel();
                assert!(g.iter().any(|v| *v != 0.0), "{} has no gradient", e.path);
            }
        }
    }
}
