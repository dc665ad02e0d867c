//! The operations on autodiff tensors: the forward pass on flex, and each operation's backward
//! step with the state it needs.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Flex};
use kernels::conv;
use kernels::norm::{self, BatchStats, ReluMask};
use kernels::pool;

use super::flex::{
    KeptWeight, conv_with_weight, max_pool_with_taps, norm_add_relu as flex_norm_add_relu,
};
use super::{
    ConvSpec, NormOutput, NormSpec, PoolSpec, TrainctlOps, conv_profile, conv_shape, dims4, f32s,
    from_nhwc, from_vec, input_gradient, nhwc, norm_name, pool_name, pool_shape, profile,
    weight_gradient,
};

#[derive(Debug)]
struct ConvBackward;

impl Backward<Flex, 3> for ConvBackward {
    /// Input, weight, the weight as the forward's algorithm took it, the output when the ReLU
    /// is fused, and the spec.
    type State = (
        FlexTensor,
        FlexTensor,
        Arc<KeptWeight>,
        Option<FlexTensor>,
        ConvSpec,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        let (x, weight, kept, y, spec) = ops.state;
        let shape = conv_shape(&x, &weight, &spec);
        let timer = profile::Backward::start(|| conv_profile(&shape).0);
        let prepared = kept.get(&shape, &weight);
        let y = y.as_ref().map(nhwc);
        let g = conv::backward(
            &shape,
            &nhwc(&x),
            &prepared,
            y.as_deref(),
            &nhwc(&dy),
            conv::Wanted {
                input: node_x.is_some(),
                bias: node_b.is_some(),
            },
        );
        let dx = match (&node_x, g.input) {
            (Some(node), Some(dx)) => input_gradient(node.id.value, dx, dims4(&x), spec.input),
            _ => None,
        };
        drop(timer);
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<Flex>(node.id, dx);
        }
        if let Some(node) = node_w {
            let dw = weight_gradient(g.weight, dims4(&weight), prepared.layout());
            grads.register::<Flex>(node.id, dw);
        }
        if let (Some(node), Some(db)) = (node_b, g.bias) {
            grads.register::<Flex>(node.id, from_vec(db, &[shape.c_out]));
        }
    }
}

#[derive(Debug)]
struct PoolBackward;

impl Backward<Flex, 1> for PoolBackward {
    /// The input's dims, the taps of the maxima, the spec.
    type State = ([usize; 4], Arc<Vec<u32>>, PoolSpec);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        let (dims, taps, spec) = ops.state;
        let Some(node) = node_x else { return };
        let timer = profile::Backward::start(|| pool_name(dims, &spec));
        let shape = pool_shape(dims, &spec);
        let dx = from_nhwc(pool::max_backward(&shape, &nhwc(&dy), &taps), dims);
        drop(timer);
        grads.register::<Flex>(node.id, dx);
    }
}

/// Batch norm's backward; `N` parents: input, gamma, beta, and the residual when there is one.
#[derive(Debug)]
struct NormBackward<const N: usize>;

impl<const N: usize> Backward<Flex, N> for NormBackward<N> {
    /// Input, gamma, the batch statistics, the spec, and the ReLU's mask when it is fused.
    type State = (
        FlexTensor,
        FlexTensor,
        Arc<BatchStats>,
        NormSpec,
        Option<Arc<ReluMask>>,
    );

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mut parents = ops.parents.into_iter();
        let mut parent = || parents.next().flatten();
        let (node_x, node_gamma, node_beta, node_residual) =
            (parent(), parent(), parent(), parent());
        let dy = grads.consume::<Flex>(&ops.node);
        let (x, gamma, stats, spec, mask) = ops.state;
        let dims = dims4(&x);
        let timer = profile::Backward::start(|| norm_name(dims));
        let g = norm::backward(
            &nhwc(&x),
            &f32s(&gamma),
            &stats,
            spec.epsilon,
            &nhwc(&dy),
            mask.as_deref(),
            node_residual.is_some(),
        );
        let dx = from_nhwc(g.input, dims);
        let dr = match (&node_residual, g.residual) {
            (Some(node), Some(dr)) => input_gradient(node.id.value, dr, dims, spec.residual),
            _ => None,
        };
        drop(timer);
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<Flex>(node.id, from_vec(g.gamma, &[dims[1]]));
        }
        if let Some(node) = node_beta {
            grads.register::<Flex>(node.id, from_vec(g.beta, &[dims[1]]));
        }
        if let (Some(node), Some(dr)) = (node_residual, dr) {
            grads.register::<Flex>(node.id, dr);
        }
    }
}

impl<C: CheckpointStrategy> TrainctlOps for Autodiff<Flex, C> {
    fn conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self> {
        match ConvBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, weight) = (x.into_primitive(), weight.into_primitive());
                let (y, kept) = conv_with_weight(&x, &weight, &bias.into_primitive(), &spec);
                let saved_y = spec.relu.then(|| y.clone());
                prep.finish((x, weight, Arc::new(kept), saved_y, spec), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::conv2d(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                spec,
            )),
        }
    }

    fn max_pool2d(x: FloatTensor<Self>, spec: PoolSpec) -> FloatTensor<Self> {
        match PoolBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let x = x.into_primitive();
                let (y, taps) = max_pool_with_taps(&x, &spec);
                prep.finish((dims4(&x), Arc::new(taps), spec), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::max_pool2d(x.into_primitive(), spec)),
        }
    }

    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        spec: NormSpec,
    ) -> NormOutput<Self> {
        norm_add_relu::<C>(x, gamma, beta, None, spec)
    }

    fn batch_norm_add_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        spec: NormSpec,
    ) -> NormOutput<Self> {
        norm_add_relu::<C>(x, gamma, beta, Some(residual), spec)
    }
}

/// Batch norm (+ residual, + ReLU) on flex, with the backward that takes the residual's node
/// as a fourth parent when there is one.
fn norm_add_relu<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    gamma: FloatTensor<Autodiff<Flex, C>>,
    beta: FloatTensor<Autodiff<Flex, C>>,
    residual: Option<FloatTensor<Autodiff<Flex, C>>>,
    spec: NormSpec,
) -> NormOutput<Autodiff<Flex, C>> {
    let nodes = [x.node(), gamma.node(), beta.node()];
    let residual_node = residual.as_ref().map(|r| r.node());
    let (x, gamma) = (x.into_primitive(), gamma.into_primitive());
    let residual = residual.map(|r| r.into_primitive());
    let (out, mask) =
        flex_norm_add_relu(&x, &gamma, &beta.into_primitive(), residual.as_ref(), spec);
    let stats = Arc::new(BatchStats {
        mean: f32s(&out.mean).into_owned(),
        var: f32s(&out.var).into_owned(),
    });
    type Ad<C> = Autodiff<Flex, C>;
    let (mean, var) = (Ad::<C>::from_inner(out.mean), Ad::<C>::from_inner(out.var));
    let state = (x, gamma, stats, spec, mask.map(Arc::new));
    let output = match residual_node {
        None => match NormBackward::<3>
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, out.output),
            OpsKind::UnTracked(prep) => prep.finish(out.output),
        },
        Some(r) => {
            let [x, gamma, beta] = nodes;
            match NormBackward::<4>
                .prepare::<C>([x, gamma, beta, r])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, out.output),
                OpsKind::UnTracked(prep) => prep.finish(out.output),
            }
        }
    };
    NormOutput { output, mean, var }
}
