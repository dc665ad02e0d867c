//! The networks the trainer knows ([`Model`]: the seed CNN, torchvision's ResNets), and their
//! tensors as flat `f32` buffers with PyTorch's names.
//!
//! Invariant: tensors are always listed in the order of the model's fields (the seed's
//! `nn.Sequential` order, torchvision's `state_dict` order); flat buffers, checkpoints and the
//! all-reduce rely on it.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};

use crate::ops::{batch_norm, conv2d, max_pool2d};
use crate::resnet::{Arch, ResNet};

/// Which network `trainctl train --model` trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    SeedCnn,
    ResNet(Arch),
}

impl Architecture {
    /// The names `--model` takes, for messages.
    pub const CHOICES: &str = "seed-cnn, resnet18, resnet34, resnet50 or resnet101";

    /// `seed-cnn`, `resnet18`, ...
    pub fn parse(name: &str) -> Option<Architecture> {
        match name {
            "seed-cnn" => Some(Architecture::SeedCnn),
            other => Arch::parse(other).map(Architecture::ResNet),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Architecture::SeedCnn => "seed-cnn",
            Architecture::ResNet(a) => a.name(),
        }
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
pub const MAX_IMAGE_SIZE: usize = 1024;

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

/// A network whose tensors move to and from flat buffers ([`snapshot`], [`load`],
/// [`gradients`]): the seed CNN, the ResNets, [`Model`].
pub trait Net: Module + Sized {
    /// PyTorch's `state_dict` key of the tensor at burn path `path` (e.g. `conv12.weight`).
    fn torch_name(&self, path: &str) -> String;

    /// Folds the BatchNorm statistics of the last forward pass into the running state.
    ///
    /// burn's `RunningState` keeps a forward's update aside (per thread) and applies it only
    /// at the next forward; visitors and mappers see the stale value, and a value mapped in
    /// would be overwritten by the pending update. Every read or write of buffers settles first.
    fn settle(&self);
}

/// Settles each BatchNorm's pending running-statistics update (see [`Net::settle`]).
pub(crate) fn settle_norms<'a>(norms: impl IntoIterator<Item = &'a BatchNorm>) {
    for bn in norms {
        bn.running_mean.value_sync();
        bn.running_var.value_sync();
    }
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
        let x = conv2d(&self.conv0, x, true);
        let x = conv2d(&self.conv2, x, true);
        let x = batch_norm(&self.bn5, max_pool2d(&self.pool, x));
        let x = conv2d(&self.conv6, x, true);
        let x = conv2d(&self.conv8, x, true);
        let x = batch_norm(&self.bn11, max_pool2d(&self.pool, x));
        let x = conv2d(&self.conv12, x, true);
        let x = conv2d(&self.conv14, x, true);
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

/// One named tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// burn's path, e.g. `fc19.weight`.
    pub path: String,
    /// PyTorch's name, e.g. `network.19.weight` ([`Net::torch_name`]).
    pub torch_name: String,
    pub shape: Vec<usize>,
    /// Trained by the optimizer (false for BatchNorm running statistics).
    pub trainable: bool,
}

impl Entry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The shape PyTorch gives this tensor (Linear weights transposed).
    pub fn torch_shape(&self) -> Vec<usize> {
        if self.is_linear_weight() {
            vec![self.shape[1], self.shape[0]]
        } else {
            self.shape.clone()
        }
    }

    /// burn stores Linear weights as `[in, out]`, PyTorch as `[out, in]`.
    pub fn is_linear_weight(&self) -> bool {
        self.path.starts_with("fc") && self.path.ends_with(".weight")
    }
}

/// The model's tensors as flat buffers, in field order.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub entries: Vec<Entry>,
    /// Trainable parameters, concatenated.
    pub params: Vec<f32>,
    /// Buffers (BatchNorm running mean and variance), concatenated.
    pub buffers: Vec<f32>,
}

impl Snapshot {
    /// `(entry, values)` for every tensor in order, parameters and buffers interleaved as in the
    /// model.
    pub fn tensors(&self) -> Vec<(&Entry, &[f32])> {
        let (mut p, mut b) = (0, 0);
        self.entries
            .iter()
            .map(|e| {
                let n = e.numel();
                if e.trainable {
                    p += n;
                    (e, &self.params[p - n..p])
                } else {
                    b += n;
                    (e, &self.buffers[b - n..b])
                }
            })
            .collect()
    }
}

#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    /// An enum's variant (burn's container `Enum:...`, e.g. [`Model`]'s) is which network, not
    /// a part of one: it is left out of the path, as PyTorch's names have no such level.
    fn enter(&mut self, name: &str, container: &str) {
        if !container.starts_with("Enum:") {
            self.0.push(name.to_string());
        }
    }
    fn exit(&mut self, container: &str) {
        if !container.starts_with("Enum:") {
            self.0.pop();
        }
    }
    fn leaf(&self) -> String {
        self.0.join(".")
    }
}

fn is_buffer(path: &str) -> bool {
    path.ends_with("running_mean") || path.ends_with("running_var")
}

struct Reader<'a> {
    path: Path,
    snapshot: Snapshot,
    /// Read only the buffers (the cheap per-step sync of BatchNorm statistics).
    buffers_only: bool,
    torch_name: &'a dyn Fn(&str) -> String,
}

impl ModuleVisitor for Reader<'_> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        self.path.exit(container);
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let path = self.path.leaf();
        let trainable = !is_buffer(&path);
        if self.buffers_only && trainable {
            return;
        }
        let tensor = param.val();
        let shape = tensor.shape().dims::<D>().to_vec();
        let values = to_vec(tensor);
        if trainable {
            self.snapshot.params.extend(values);
        } else {
            self.snapshot.buffers.extend(values);
        }
        self.snapshot.entries.push(Entry {
            torch_name: (self.torch_name)(&path),
            path,
            shape,
            trainable,
        });
    }
}

pub(crate) fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("a float tensor converts to f32")
}

fn read<M: Net>(model: &M, buffers_only: bool) -> Snapshot {
    model.settle();
    let mut reader = Reader {
        path: Path::default(),
        snapshot: Snapshot {
            entries: Vec::new(),
            params: Vec::new(),
            buffers: Vec::new(),
        },
        buffers_only,
        torch_name: &|path| model.torch_name(path),
    };
    model.visit(&mut reader);
    reader.snapshot
}

/// Reads every tensor of `model`.
pub fn snapshot<M: Net>(model: &M) -> Snapshot {
    read(model, false)
}

/// Reads only the BatchNorm running statistics.
pub fn buffers<M: Net>(model: &M) -> Vec<f32> {
    read(model, true).buffers
}

struct Writer<'a> {
    path: Path,
    params: Option<&'a [f32]>,
    buffers: &'a [f32],
}

impl ModuleMapper for Writer<'_> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        self.path.exit(container);
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let values: &mut &[f32] = if is_buffer(&self.path.leaf()) {
            &mut self.buffers
        } else {
            match self.params.as_mut() {
                Some(params) => params,
                None => return param,
            }
        };
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let (mine, rest) = values.split_at(shape.num_elements());
        *values = rest;
        let device = tensor.device();
        let require_grad = tensor.is_require_grad();
        let mut fresh = Tensor::<D>::from_data(TensorData::new(mine.to_vec(), shape), &device);
        if require_grad {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Replaces the model's parameters (when given) and buffers with flat buffers laid out as
/// [`snapshot`] produces them.
pub fn load<M: Net>(model: M, params: Option<&[f32]>, buffers: &[f32]) -> M {
    model.settle();
    model.map(&mut Writer {
        path: Path::default(),
        params,
        buffers,
    })
}

/// Gradients of the trainable parameters, flattened in parameter order. Parameters that got no
/// gradient contribute zeros, so every rank's buffer has the same layout.
pub fn gradients<M: Net>(model: &M, grads: &burn::tensor::Gradients, out: &mut Vec<f32>) {
    struct Grads<'a> {
        path: Path,
        grads: &'a burn::tensor::Gradients,
        out: &'a mut Vec<f32>,
    }
    impl ModuleVisitor for Grads<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, container: &str) {
            self.path.exit(container);
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if is_buffer(&self.path.leaf()) {
                return;
            }
            let tensor = param.val();
            match tensor.grad(self.grads) {
                Some(g) => self.out.extend(to_vec(g)),
                None => self
                    .out
                    .extend(std::iter::repeat_n(0.0, tensor.shape().num_elements())),
            }
        }
    }
    out.clear();
    model.visit(&mut Grads {
        path: Path::default(),
        grads,
        out,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::training_device;

    #[test]
    fn buffers_read_after_a_forward_are_current_and_loads_stick() {
        let device = training_device();
        let model = SeedCnn::new(10, &device);
        let before = buffers(&model);
        let x = Tensor::<4>::ones([2, 3, 32, 32], &device);
        let _ = model.forward(x.clone());
        let after = buffers(&model);
        assert_ne!(
            before, after,
            "the forward's statistics are visible at once"
        );

        let wanted: Vec<f32> = (0..after.len()).map(|i| i as f32).collect();
        let model = load(model, None, &wanted);
        assert_eq!(
            buffers(&model),
            wanted,
            "a loaded value is not overwritten by a pending update"
        );
    }
}

#[cfg(test)]
mod batchnorm_tests {
    use super::*;
    use crate::device::training_device;

    /// After many forwards on one batch the running statistics are that batch's statistics, so
    /// inference (running statistics) and training (batch statistics) agree on it.
    #[test]
    fn inference_matches_training_once_running_stats_converge() {
        let device = training_device();
        let model = SeedCnn::new(10, &device);
        let data = crate::cifar::synthetic::generate(4, 5);
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
