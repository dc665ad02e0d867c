//! The forward passes on flex tensors.

use std::borrow::Cow;
use std::sync::Arc;

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use kernels::conv::{self, ConvShape, Prepared, Weight};
use kernels::matmul::Precision;
use kernels::{norm, pool};

use super::{
    ConvSpec, NormOutput, NormSpec, PoolSpec, TrainctlOps, conv_profile, conv_shape, conv_weight,
    dims4, f32s, from_nhwc, from_vec, nhwc, norm_name, pool_name, pool_shape, profile,
};

impl TrainctlOps for Flex {
    fn conv2d(x: FlexTensor, weight: FlexTensor, bias: FlexTensor, spec: ConvSpec) -> FlexTensor {
        conv_with_weight(&x, &weight, &bias, &spec).0
    }

    fn max_pool2d(x: FlexTensor, spec: PoolSpec) -> FlexTensor {
        max_pool_with_taps(&x, &spec).0
    }

    fn batch_norm_train(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        spec: NormSpec,
    ) -> NormOutput<Self> {
        norm_add_relu(&x, &gamma, &beta, None, spec).0
    }

    fn batch_norm_add_train(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        residual: FlexTensor,
        spec: NormSpec,
    ) -> NormOutput<Self> {
        norm_add_relu(&x, &gamma, &beta, Some(&residual), spec).0
    }
}

/// Batch norm with the batch's statistics, plus `residual` when there is one, then the ReLU if
/// `spec.relu`, whose mask (channels-last, as `nhwc` gives the input) comes too.
pub(super) fn norm_add_relu(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    residual: Option<&FlexTensor>,
    spec: NormSpec,
) -> (NormOutput<Flex>, Option<norm::ReluMask>) {
    let dims = dims4(x);
    profile::timed(
        || (norm_name(dims), profile::Flops::default()),
        None,
        || {
            let xs = nhwc(x);
            let stats = norm::batch_stats(&xs, dims[1]);
            let residual = residual.map(nhwc);
            let (y, mask) = norm::normalize(
                &xs,
                &f32s(gamma),
                &f32s(beta),
                &stats,
                spec.epsilon,
                residual.as_deref(),
                spec.relu,
            );
            let out = NormOutput {
                output: from_nhwc(y, dims),
                mean: from_vec(stats.mean, &[dims[1]]),
                var: from_vec(stats.var, &[dims[1]]),
            };
            (out, mask)
        },
    )
}

/// The weight as the forward's algorithm took it, for the backward: kept when the algorithm
/// transformed it (Winograd, or any weight in PyTorch's layout); taken again from the weight
/// tensor, at no cost, when im2col or the direct kernel multiplied by it as it lies.
#[derive(Debug)]
pub(super) enum KeptWeight {
    Transformed(Arc<Prepared<'static>>),
    AsItLies(Precision),
}

impl KeptWeight {
    /// The prepared weight; `weight` is the forward's weight tensor.
    pub(super) fn get<'a>(
        &'a self,
        shape: &ConvShape,
        weight: &'a FlexTensor,
    ) -> Cow<'a, Prepared<'a>> {
        match self {
            KeptWeight::Transformed(prepared) => Cow::Borrowed(&**prepared),
            KeptWeight::AsItLies(precision) => {
                let (values, layout) = conv_weight(weight);
                let values = match values {
                    Cow::Borrowed(values) => values,
                    // The forward kept it otherwise (`conv_with_weight`).
                    Cow::Owned(_) => unreachable!("a weight taken as it lies is borrowed"),
                };
                Cow::Owned(Prepared::new(shape, Weight { values, layout }, *precision))
            }
        }
    }
}

/// The convolution's output and the weight as its algorithm took it (for the backward).
pub(super) fn conv_with_weight(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: &FlexTensor,
    spec: &ConvSpec,
) -> (FlexTensor, KeptWeight) {
    let shape = conv_shape(x, weight, spec);
    profile::timed(
        || conv_profile(&shape),
        Some(shape),
        || {
            let (values, layout) = conv_weight(weight);
            let precision = crate::device::precision();
            let prepared = Prepared::new(
                &shape,
                Weight {
                    values: &values,
                    layout,
                },
                precision,
            );
            let bias = spec.bias.then(|| f32s(bias));
            let y = conv::forward(&shape, &nhwc(x), &prepared, bias.as_deref(), spec.relu);
            let [oh, ow] = shape.out_size();
            // Only values the tensor holds as they are can be borrowed again.
            let kept = if prepared.borrows() && matches!(values, Cow::Borrowed(_)) {
                KeptWeight::AsItLies(precision)
            } else {
                KeptWeight::Transformed(Arc::new(prepared.into_owned()))
            };
            (from_nhwc(y, [shape.batch, shape.c_out, oh, ow]), kept)
        },
    )
}

/// The pooled tensor and, per output element, the tap its maximum came from.
pub(super) fn max_pool_with_taps(x: &FlexTensor, spec: &PoolSpec) -> (FlexTensor, Vec<u32>) {
    let dims = dims4(x);
    profile::timed(
        || (pool_name(dims, spec), profile::Flops::default()),
        None,
        || {
            let shape = pool_shape(dims, spec);
            let (y, taps) = pool::max_forward(&shape, &nhwc(x));
            let [oh, ow] = shape.out_size();
            (from_nhwc(y, [shape.batch, shape.channels, oh, ow]), taps)
        },
    )
}
