//! The seed's CNN for CIFAR-10, layer for layer.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{Net, settle_norms};
use crate::ops::{Input, batch_norm, conv2d, max_pool2d};

/// Conv(3→32) ReLU, Conv(32→64) ReLU, MaxPool2, BatchNorm(64), Conv(64→128) ReLU,
/// Conv(128→128) ReLU, MaxPool2, BatchNorm(128), Conv(128→256) ReLU, Conv(256→256) ReLU,
/// MaxPool2, BatchNorm(256), Flatten, Linear(4096→512) ReLU, Linear(512→10).
/// Field names carry the index of the layer in the seed's `nn.Sequential`.
#[derive(Module, Debug)]
pub struct SeedCnn {
    conv0: Conv2d,
    conv2: Conv2d,
    bn5: BatchNorm,
    conv6: Conv2d,
    conv8: Conv2d,
    bn11: BatchNorm,
    conv12: Conv2d,
    conv14: Conv2d,
    bn17: BatchNorm,
    fc19: Linear,
    fc21: Linear,
    pool: MaxPool2d,
}

fn conv(i: usize, o: usize, device: &Device) -> Conv2d {
    Conv2dConfig::new([i, o], [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init(device)
}

impl SeedCnn {
    /// The seed's network; `classes` is 10 for CIFAR-10.
    pub fn new(classes: usize, device: &Device) -> Self {
        SeedCnn {
            conv0: conv(3, 32, device),
            conv2: conv(32, 64, device),
            bn5: BatchNormConfig::new(64).init(device),
            conv6: conv(64, 128, device),
            conv8: conv(128, 128, device),
            bn11: BatchNormConfig::new(128).init(device),
            conv12: conv(128, 256, device),
            conv14: conv(256, 256, device),
            bn17: BatchNormConfig::new(256).init(device),
            fc19: LinearConfig::new(4096, 512).init(device),
            fc21: LinearConfig::new(512, classes).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
        }
    }

    /// `[batch, 3, 32, 32]` → logits `[batch, 10]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = conv2d(&self.conv0, x, true, Input::Once);
        let x = conv2d(&self.conv2, x, true, Input::Once);
        let x = batch_norm(&self.bn5, max_pool2d(&self.pool, x));
        let x = conv2d(&self.conv6, x, true, Input::Once);
        let x = conv2d(&self.conv8, x, true, Input::Once);
        let x = batch_norm(&self.bn11, max_pool2d(&self.pool, x));
        let x = conv2d(&self.conv12, x, true, Input::Once);
        let x = conv2d(&self.conv14, x, true, Input::Once);
        let x = batch_norm(&self.bn17, max_pool2d(&self.pool, x));
        let x: Tensor<2> = x.flatten(1, 3);
        self.fc21.forward(relu(self.fc19.forward(x)))
    }
}

impl Net for SeedCnn {
    fn settle(&self) {
        settle_norms([&self.bn5, &self.bn11, &self.bn17]);
    }

    /// The seed's `nn.Sequential`: `conv12.weight` → `network.12.weight`, `bn5.gamma` →
    /// `network.5.weight`.
    fn torch_name(&self, path: &str) -> String {
        let (module, field) = path.split_once('.').unwrap_or((path, ""));
        let index: String = module.chars().filter(|c| c.is_ascii_digit()).collect();
        let field = match field {
            "gamma" => "weight",
            "beta" => "bias",
            other => other,
        };
        format!("network.{index}.{field}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::training_device;
    use crate::model::{Architecture, snapshot, to_vec};
    use burn::tensor::TensorData;

    /// After many forwards on one batch the running statistics are that batch's statistics, so
    /// inference (running statistics) and training (batch statistics) agree on it.
    #[test]
    fn inference_matches_training_once_running_stats_converge() {
        let device = training_device();
        let model = SeedCnn::new(10, &device);
        let data = crate::data::synthetic::cifar(4, 5);
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        data.fill_batch(&(0..4).collect::<Vec<_>>(), &mut pixels, &mut labels);
        let x = Tensor::<4>::from_data(TensorData::new(pixels.clone(), [4, 3, 32, 32]), &device);
        let mut train_logits = Vec::new();
        // 0.9^150: nothing of the initial statistics is left.
        for _ in 0..150 {
            train_logits = to_vec(model.forward(x.clone()));
        }
        let snap = snapshot(&model);
        let inference =
            crate::eval::inference_model(Architecture::SeedCnn, 10, &snap.params, &snap.buffers);
        let xi = Tensor::<4>::from_data(
            TensorData::new(pixels, [4, 3, 32, 32]),
            &crate::device::inference_device(),
        );
        let eval_logits = to_vec(inference.forward(xi));
        let worst = train_logits
            .iter()
            .zip(&eval_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let scale = train_logits.iter().map(|a| a.abs()).fold(0.0f32, f32::max);
        assert!(
            worst < 0.05 * scale.max(1.0),
            "train and inference logits differ by {worst} (scale {scale})"
        );
    }
}
