//! trainctl's own kernels (crate `kernels`) as burn operations of the flex backend, with their
//! gradients for autodiff, through burn's backend extensions: convolution (+ bias + ReLU), max
//! pooling and training-mode batch norm (with a ResNet block's residual add and ReLU fused).
//!
//! Tensors stay NCHW to burn, but the outputs of these operations are stored channels-last
//! (a permuted layout over an NHWC buffer): burn's other operations read any layout, and the
//! next operation of ours takes its input without a copy. Only inputs in another layout (the
//! batch of images, gradients from burn's own operations) are converted.
//!
//! With `trainer::device`, the one other module that names a backend.

mod autodiff;
mod flex;
pub(crate) mod parts;
pub(crate) mod profile;

use std::borrow::Cow;

use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, ExtensionType, backend_extension};
use burn::nn::conv::Conv2d;
use burn::nn::pool::MaxPool2d;
use burn::nn::{BatchNorm, PaddingConfig2d};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use kernels::conv::{Algorithm, ConvShape, WeightLayout};
use kernels::layout::nchw_to_nhwc;
use kernels::pool::PoolShape;

/// Whether the model uses a tensor once or also elsewhere (a ResNet block's input goes to the
/// block's first convolution and to the residual or the downsample path).
///
/// A shared input's gradient comes in two parts, one from each of the two operations of ours
/// that read it (both marked `Shared`, never more): [`parts`] sums them channels-last and
/// hands burn the sum, which burn's own add would walk element by element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Input {
    Once,
    Shared,
}

/// What a convolution does besides its weights: stride, symmetric padding, fused ReLU, how its
/// input is used, and whether it has a bias (a ResNet's convolutions have none: their bias
/// tensor is zeros, which the forward does not add).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvSpec {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub relu: bool,
    pub input: Input,
    pub bias: bool,
}

/// A max pooling window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PoolSpec {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

/// What a training-mode batch norm does besides normalising: its epsilon, a ReLU after it (and
/// after the residual add, when there is one), and how the residual is used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct NormSpec {
    pub epsilon: f64,
    pub relu: bool,
    pub residual: Input,
}

/// Training-mode batch norm: the output and the batch statistics (for the running state).
#[derive(ExtensionType)]
pub(crate) struct NormOutput<B: burn::backend::Backend> {
    pub output: FloatTensor<B>,
    pub mean: FloatTensor<B>,
    pub var: FloatTensor<B>,
}

#[backend_extension(Flex, Autodiff)]
pub(crate) trait TrainctlOps: burn::backend::Backend {
    /// `x` `[n, c_in, h, w]`, `weight` `[c_out, c_in, kh, kw]`, `bias` `[c_out]`.
    fn conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;

    /// `x` `[n, c, h, w]`.
    fn max_pool2d(x: FloatTensor<Self>, spec: PoolSpec) -> FloatTensor<Self>;

    /// Normalises `x` `[n, c, h, w]` with its own per-channel statistics (biased variance),
    /// then applies ReLU if `spec.relu`.
    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        spec: NormSpec,
    ) -> NormOutput<Self>;

    /// [`batch_norm_train`](TrainctlOps::batch_norm_train) with `residual` (the shape of `x`)
    /// added before the ReLU. (burn's extension traits take no optional tensors.)
    fn batch_norm_add_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        spec: NormSpec,
    ) -> NormOutput<Self>;
}

fn symmetric_padding(padding: &PaddingConfig2d, what: &str) -> [usize; 2] {
    match *padding {
        PaddingConfig2d::Valid => [0, 0],
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => {
            [top, left]
        }
        ref other => panic!("trainctl's {what} needs symmetric explicit padding, got {other:?}"),
    }
}

/// `relu(conv(x) + bias)` (or without the ReLU) with `conv`'s weights, stride and padding.
///
/// # Panics
/// On a dilated or grouped convolution, or asymmetric padding: the seed CNN and the ResNets
/// have none.
pub(crate) fn conv2d(conv: &Conv2d, x: Tensor<4>, relu: bool, input: Input) -> Tensor<4> {
    assert!(
        conv.dilation == [1, 1] && conv.groups == 1,
        "trainctl's convolution has no dilation or groups"
    );
    let weight = conv.weight.val();
    // burn's extension traits take no optional tensors: a layer without a bias passes zeros,
    // and says so.
    let bias = match &conv.bias {
        Some(b) => b.val(),
        None => Tensor::zeros([weight.dims()[0]], &weight.device()),
    };
    let spec = ConvSpec {
        stride: conv.stride,
        padding: symmetric_padding(&conv.padding, "convolution"),
        relu,
        input,
        bias: conv.bias.is_some(),
    };
    Tensor::from_dispatch(<Dispatch as TrainctlOps>::conv2d(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        spec,
    ))
}

/// `pool`'s max pooling.
///
/// # Panics
/// On dilation or ceil mode, which the seed CNN and the ResNets do not use.
pub(crate) fn max_pool2d(pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    assert!(
        pool.dilation == [1, 1] && !pool.ceil_mode,
        "trainctl's max pooling has no dilation or ceil mode"
    );
    let spec = PoolSpec {
        kernel: pool.kernel_size,
        stride: pool.stride,
        padding: symmetric_padding(&pool.padding, "max pooling"),
    };
    Tensor::from_dispatch(<Dispatch as TrainctlOps>::max_pool2d(
        x.into_dispatch(),
        spec,
    ))
}

/// `bn` on `x`: in training (an autodiff device, the layer not frozen) with the batch's
/// statistics, folded into the running state as burn's `BatchNorm` does; otherwise burn's own
/// inference path with the running statistics.
pub(crate) fn batch_norm(bn: &BatchNorm, x: Tensor<4>) -> Tensor<4> {
    norm_add_relu(bn, x, None, false)
}

/// `relu(bn(x) + residual)` (without the add when `residual` is `None`, without the ReLU when
/// `!relu`): a ResNet block's tail, in one pass in training (see [`batch_norm`]). The residual
/// comes with how the model uses it.
pub(crate) fn norm_add_relu(
    bn: &BatchNorm,
    x: Tensor<4>,
    residual: Option<(Tensor<4>, Input)>,
    relu: bool,
) -> Tensor<4> {
    if !(x.device().is_autodiff() && bn.training.is_enabled()) {
        let y = bn.forward(x);
        let y = match residual {
            Some((r, _)) => y.add(r),
            None => y,
        };
        return if relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        };
    }
    let (x, gamma, beta) = (
        x.into_dispatch(),
        bn.gamma.val().into_dispatch(),
        bn.beta.val().into_dispatch(),
    );
    let spec = NormSpec {
        epsilon: bn.epsilon,
        relu,
        residual: residual.as_ref().map_or(Input::Once, |(_, input)| *input),
    };
    let out = match residual {
        Some((r, _)) => {
            <Dispatch as TrainctlOps>::batch_norm_add_train(x, gamma, beta, r.into_dispatch(), spec)
        }
        None => <Dispatch as TrainctlOps>::batch_norm_train(x, gamma, beta, spec),
    };
    let (mean, var) = (
        Tensor::<1>::from_dispatch(out.mean).detach(),
        Tensor::<1>::from_dispatch(out.var).detach(),
    );
    let momentum = bn.momentum;
    let update = |state: &burn::module::RunningState<Tensor<1>>, batch: Tensor<1>| {
        let running = state.value_sync().to_device(&batch.device());
        state.update(
            running
                .mul_scalar(1.0 - momentum)
                .add(batch.mul_scalar(momentum))
                .detach(),
        );
    };
    update(&bn.running_mean, mean);
    update(&bn.running_var, var);
    Tensor::from_dispatch(out.output)
}

fn dims4(t: &FlexTensor) -> [usize; 4] {
    let s = t.layout().shape();
    assert_eq!(s.num_dims(), 4, "a 4-d tensor");
    [s[0], s[1], s[2], s[3]]
}

fn f32s(t: &FlexTensor) -> Cow<'_, [f32]> {
    assert_eq!(t.dtype(), DType::F32, "trainctl's kernels compute in f32");
    match t.as_slice::<f32>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(
            t.to_contiguous()
                .into_data()
                .try_into_vec::<f32>()
                .expect("an f32 tensor"),
        ),
    }
}

/// The strides of a dense channels-last `[n, c, h, w]` tensor.
fn channels_last_strides([_, c, h, w]: [usize; 4]) -> [isize; 4] {
    [(h * w * c) as isize, 1, (w * c) as isize, c as isize]
}

/// Whether `t` (4-d) is stored channels-last.
fn is_channels_last(t: &FlexTensor) -> bool {
    let dims = dims4(t);
    t.layout()
        .strides()
        .iter()
        .zip(channels_last_strides(dims))
        .zip(dims)
        .all(|((have, want), size)| size <= 1 || *have == want)
}

/// `t`'s elements in NHWC order: borrowed when `t` is already stored so.
fn nhwc(t: &FlexTensor) -> Cow<'_, [f32]> {
    assert_eq!(t.dtype(), DType::F32, "trainctl's kernels compute in f32");
    let dims = dims4(t);
    let len = dims.iter().product::<usize>();
    if is_channels_last(t) {
        let start = t.layout().start_offset();
        return Cow::Borrowed(&t.storage::<f32>()[start..start + len]);
    }
    let [_, c, h, w] = dims;
    Cow::Owned(nchw_to_nhwc(&f32s(t), c, h * w))
}

/// A convolution weight `[c_out, c_in, kh, kw]` as it lies: borrowed in the kernels' layout
/// when stored so (the trainer's parameters are, see `model::flat`), else in PyTorch's.
fn conv_weight(t: &FlexTensor) -> (Cow<'_, [f32]>, WeightLayout) {
    if is_channels_last(t) {
        (nhwc(t), WeightLayout::TapsFirst)
    } else {
        (f32s(t), WeightLayout::Torch)
    }
}

/// A weight gradient the kernels gave in `layout`, as a tensor of `dims` stored so.
fn weight_gradient(data: Vec<f32>, dims: [usize; 4], layout: WeightLayout) -> FlexTensor {
    match layout {
        // `[c_out][kh][kw][c_in]` is the weight's "channels-last".
        WeightLayout::TapsFirst => from_nhwc(data, dims),
        WeightLayout::Torch => from_vec(data, &dims),
    }
}

/// The gradient (NHWC) of an input of autodiff node `node`, channels-last, as burn is to hold
/// it: all of it, or for an [`Input::Shared`] input `None` until its second part comes
/// ([`parts`]).
fn input_gradient(node: u64, data: Vec<f32>, dims: [usize; 4], input: Input) -> Option<FlexTensor> {
    let whole = match input {
        Input::Once => Some(data),
        Input::Shared => parts::add_part(node, data),
    };
    whole.map(|data| from_nhwc(data, dims))
}

/// An NHWC buffer as a `[n, c, h, w]` tensor stored channels-last.
fn from_nhwc(data: Vec<f32>, dims: [usize; 4]) -> FlexTensor {
    let [n, c, h, w] = dims;
    let t = FlexTensor::from_data(TensorData::new(data, [n, h, w, c]));
    t.with_layout(Layout::new(
        Shape::from(dims.to_vec()),
        channels_last_strides(dims).to_vec(),
        0,
    ))
}

fn from_vec(data: Vec<f32>, dims: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, dims.to_vec()))
}

fn conv_shape(x: &FlexTensor, weight: &FlexTensor, spec: &ConvSpec) -> ConvShape {
    let [batch, c_in, height, width] = dims4(x);
    let [c_out, wc_in, kh, kw] = dims4(weight);
    assert_eq!(
        c_in, wc_in,
        "convolution input has {c_in} channels, the weight {wc_in}"
    );
    let shape = ConvShape {
        batch,
        c_in,
        height,
        width,
        c_out,
        kernel: [kh, kw],
        stride: spec.stride,
        padding: spec.padding,
    };
    if let Err(e) = shape.validate() {
        panic!("{e}");
    }
    shape
}

/// A convolution's name in the operation profile, and its forward arithmetic.
fn conv_profile(s: &ConvShape) -> (String, profile::Flops) {
    let algorithm = Algorithm::of(s);
    let name = kernels::conv::layer_name(s, algorithm);
    let flops = profile::Flops {
        nominal: 2.0 * (s.output_len() * s.k()) as f64,
        executed: 2.0 * algorithm.multiply_adds(s) as f64,
    };
    (name, flops)
}

fn norm_name([_, c, h, w]: [usize; 4]) -> String {
    format!("batch norm {c} at {h}x{w}")
}

fn pool_name([_, c, h, w]: [usize; 4], spec: &PoolSpec) -> String {
    format!(
        "max pool {}x{}/{} {c} at {h}x{w}",
        spec.kernel[0], spec.kernel[1], spec.stride[0]
    )
}

fn pool_shape([batch, channels, height, width]: [usize; 4], spec: &PoolSpec) -> PoolShape {
    let shape = PoolShape {
        batch,
        channels,
        height,
        width,
        kernel: spec.kernel,
        stride: spec.stride,
        padding: spec.padding,
    };
    if let Err(e) = shape.validate() {
        panic!("{e}");
    }
    shape
}

#[cfg(test)]
mod tests;
