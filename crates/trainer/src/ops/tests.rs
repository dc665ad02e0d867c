//! trainctl's operations against burn's own, forward and backward.

use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Distribution, Tensor};
use proptest::prelude::*;

use super::Input;
use crate::device::training_device;
use crate::model::to_vec;

/// Largest |a - b| over the largest |b| (at least 1).
fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Between two f32 summations of up to a few thousand terms in different orders.
const TOLERANCE: f32 = 2e-5;

/// burn's ReLU of `y`, but passing where `ours` (the fused op's output) is positive: two
/// correct convolutions can put an output a hair either side of zero, and a ReLU then passes
/// all or none of its gradient. With one mask, the gradients compare the convolutions alone
/// (and a wrong mask in the fused backward still shows).
fn relu_as_ours(y: Tensor<4>, ours: &Tensor<4>) -> Tensor<4> {
    y * ours.clone().detach().greater_elem(0.0).float()
}

/// Forward output and the gradients of x, weight and bias of `sum(out * r)` for a random `r`,
/// by trainctl's op (its input used as `uses` says) and by burn's module.
fn compare(conv: &Conv2d, input: [usize; 4], relu_after: bool, uses: Input) {
    let device = training_device();
    let x = Tensor::<4>::random(input, Distribution::Uniform(-1.0, 1.0), &device).require_grad();
    let ours = super::conv2d(conv, x.clone(), relu_after, uses);
    let y = conv.forward(x.clone());
    let theirs = if relu_after {
        relu(y.clone())
    } else {
        y.clone()
    };
    assert_eq!(ours.dims(), theirs.dims());
    let e = worst(&to_vec(ours.clone()), &to_vec(theirs));
    assert!(e < TOLERANCE, "forward differs by {e} for {input:?}");

    let theirs = if relu_after {
        relu_as_ours(y, &ours)
    } else {
        y
    };
    let r = Tensor::<4>::random(ours.dims(), Distribution::Uniform(-1.0, 1.0), &device);
    let g_ours = (ours * r.clone()).sum().backward();
    let g_theirs = (theirs * r).sum().backward();
    let grad = |t: &Tensor<4>, g| to_vec(t.grad(g).expect("x has a gradient"));
    let e = worst(&grad(&x, &g_ours), &grad(&x, &g_theirs));
    assert!(e < TOLERANCE, "input gradient differs by {e} for {input:?}");
    let w = conv.weight.val();
    let e = worst(&grad(&w, &g_ours), &grad(&w, &g_theirs));
    assert!(
        e < TOLERANCE,
        "weight gradient differs by {e} for {input:?}"
    );
    if let Some(b) = conv.bias.as_ref().map(|b| b.val()) {
        let bias_grad = |g| to_vec(b.grad(g).expect("bias has a gradient"));
        let e = worst(&bias_grad(&g_ours), &bias_grad(&g_theirs));
        assert!(e < TOLERANCE, "bias gradient differs by {e} for {input:?}");
    }
}

fn conv(c_in: usize, c_out: usize, kernel: usize, stride: usize, padding: usize) -> Conv2d {
    Conv2dConfig::new([c_in, c_out], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(
            padding, padding, padding, padding,
        ))
        .init(&training_device())
}

#[test]
fn seed_cnn_layers_match_burn() {
    for (c_in, c_out, size) in kernels::bench::CONV_LAYERS.map(|(_, i, o, s)| (i, o, s)) {
        compare(
            &conv(c_in, c_out, 3, 1, 1),
            [3, c_in, size, size],
            true,
            Input::Once,
        );
    }
}

#[test]
fn convolutions_without_a_bias_match_burn() {
    // A ResNet's convolutions have none: 3×3, 1×1 and the stride-2 7×7 stem.
    for (c_in, c_out, kernel, stride, padding, size) in [
        (8, 16, 3, 1, 1, 6),
        (16, 8, 1, 1, 0, 5),
        (3, 8, 7, 2, 3, 11),
    ] {
        let layer = Conv2dConfig::new([c_in, c_out], [kernel, kernel])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(
                padding, padding, padding, padding,
            ))
            .with_bias(false)
            .init(&training_device());
        assert!(layer.bias.is_none());
        for relu_after in [false, true] {
            compare(&layer, [2, c_in, size, size], relu_after, Input::Once);
        }
    }
}

#[test]
fn an_input_of_burn_layout_and_one_of_ours_give_the_same_result() {
    // The second convolution reads the first one's channels-last output; the first reads
    // burn's NCHW. A chain of both against burn's chain checks both paths and the gradient
    // flowing from one op of ours into another.
    let device = training_device();
    let (a, b) = (conv(3, 8, 3, 1, 1), conv(8, 4, 3, 2, 1));
    let x = Tensor::<4>::random([2, 3, 9, 9], Distribution::Default, &device).require_grad();
    let first = super::conv2d(&a, x.clone(), true, Input::Once);
    let ours = super::conv2d(&b, first.clone(), false, Input::Once);
    let theirs = b.forward(relu_as_ours(a.forward(x.clone()), &first));
    let e = worst(&to_vec(ours.clone()), &to_vec(theirs.clone()));
    assert!(e < TOLERANCE, "forward differs by {e}");
    let (go, gt) = (ours.sum().backward(), theirs.sum().backward());
    let e = worst(&to_vec(x.grad(&go).unwrap()), &to_vec(x.grad(&gt).unwrap()));
    assert!(e < TOLERANCE, "input gradient differs by {e}");
    let w = a.weight.val();
    let e = worst(&to_vec(w.grad(&go).unwrap()), &to_vec(w.grad(&gt).unwrap()));
    assert!(e < TOLERANCE, "first weight gradient differs by {e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_shapes_match_burn(
        batch in 1usize..4,
        c_in in 1usize..6,
        c_out in 1usize..6,
        size in 1usize..10,
        kernel in prop::sample::select(vec![1usize, 3, 5, 7]),
        stride in 1usize..3,
        padding in 0usize..4,
        relu_after in any::<bool>(),
    ) {
        prop_assume!(size + 2 * padding >= kernel);
        let layer = conv(c_in, c_out, kernel, stride, padding);
        compare(&layer, [batch, c_in, size, size], relu_after, Input::Once);
    }
}

#[test]
fn max_pooling_matches_burn() {
    use burn::nn::pool::MaxPool2dConfig;
    let device = training_device();
    for (kernel, stride, padding) in [(2, 2, 0), (3, 2, 1)] {
        let pool = MaxPool2dConfig::new([kernel, kernel])
            .with_strides([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(
                padding, padding, padding, padding,
            ))
            .init();
        let x = Tensor::<4>::random([2, 3, 9, 8], Distribution::Default, &device).require_grad();
        let ours = super::max_pool2d(&pool, x.clone());
        let theirs = pool.forward(x.clone());
        assert_eq!(to_vec(ours.clone()), to_vec(theirs.clone()));
        let r = Tensor::<4>::random(ours.dims(), Distribution::Default, &device);
        let (go, gt) = (
            (ours * r.clone()).sum().backward(),
            (theirs * r).sum().backward(),
        );
        assert_eq!(to_vec(x.grad(&go).unwrap()), to_vec(x.grad(&gt).unwrap()));
    }
}

#[test]
fn batch_norm_matches_burn_in_training_and_updates_the_running_statistics() {
    use burn::nn::BatchNormConfig;
    let device = training_device();
    let ours_bn = BatchNormConfig::new(6).init(&device);
    let theirs_bn = BatchNormConfig::new(6).init(&device);
    // Non-trivial gamma and beta; the same in both.
    let gamma = Tensor::<1>::random([6], Distribution::Uniform(0.5, 1.5), &device);
    let beta = Tensor::<1>::random([6], Distribution::Default, &device);
    let set = |bn: burn::nn::BatchNorm| burn::nn::BatchNorm {
        gamma: burn::module::Param::from_tensor(gamma.clone()),
        beta: burn::module::Param::from_tensor(beta.clone()),
        ..bn
    };
    let (ours_bn, theirs_bn) = (set(ours_bn), set(theirs_bn));
    let x = (Tensor::<4>::random([4, 6, 5, 5], Distribution::Default, &device) * 3.0 + 1.0)
        .require_grad();
    let ours = super::batch_norm(&ours_bn, x.clone());
    let theirs = theirs_bn.forward(x.clone());
    let e = worst(&to_vec(ours.clone()), &to_vec(theirs.clone()));
    assert!(e < TOLERANCE, "output differs by {e}");
    let r = Tensor::<4>::random(ours.dims(), Distribution::Default, &device);
    let (go, gt) = (
        (ours * r.clone()).sum().backward(),
        (theirs * r).sum().backward(),
    );
    let e = worst(&to_vec(x.grad(&go).unwrap()), &to_vec(x.grad(&gt).unwrap()));
    assert!(e < 1e-4, "input gradient differs by {e}");
    assert_same_norm_parameter_gradients(&ours_bn, &go, &theirs_bn, &gt);
    for (ours, theirs) in [
        (&ours_bn.running_mean, &theirs_bn.running_mean),
        (&ours_bn.running_var, &theirs_bn.running_var),
    ] {
        let e = worst(&to_vec(ours.value_sync()), &to_vec(theirs.value_sync()));
        assert!(e < TOLERANCE, "running statistics differ by {e}");
    }
}

#[test]
fn the_fused_norm_add_relu_matches_burns_three_operations() {
    use burn::nn::BatchNormConfig;
    let device = training_device();
    let ours_bn = BatchNormConfig::new(6).init(&device);
    let theirs_bn = BatchNormConfig::new(6).init(&device);
    let x = (Tensor::<4>::random([4, 6, 5, 5], Distribution::Default, &device) * 2.0 + 0.5)
        .require_grad();
    let residual =
        Tensor::<4>::random([4, 6, 5, 5], Distribution::Uniform(-1.0, 1.0), &device).require_grad();
    let ours = super::norm_add_relu(
        &ours_bn,
        x.clone(),
        Some((residual.clone(), Input::Once)),
        true,
    );
    let y = theirs_bn.forward(x.clone()) + residual.clone();
    let e = worst(&to_vec(ours.clone()), &to_vec(relu(y.clone())));
    assert!(e < TOLERANCE, "output differs by {e}");
    let values = to_vec(ours.clone());
    assert!(values.contains(&0.0) && values.iter().any(|v| *v > 0.0));

    let theirs = relu_as_ours(y, &ours);
    let r = Tensor::<4>::random(ours.dims(), Distribution::Default, &device);
    let (go, gt) = (
        (ours * r.clone()).sum().backward(),
        (theirs * r).sum().backward(),
    );
    for (name, t) in [("input", &x), ("residual", &residual)] {
        let e = worst(&to_vec(t.grad(&go).unwrap()), &to_vec(t.grad(&gt).unwrap()));
        assert!(e < 1e-4, "{name} gradient differs by {e}");
    }
    assert_same_norm_parameter_gradients(&ours_bn, &go, &theirs_bn, &gt);
}

#[test]
fn a_block_input_used_twice_gets_the_sum_of_both_gradients() {
    // As in a ResNet block: `h` (channels-last, the output of an op of ours) goes to a
    // convolution and to the residual, both marked shared, so that `parts` sums their two
    // gradients; and to a downsample convolution beside the first, both shared.
    use burn::nn::BatchNormConfig;
    let device = training_device();
    let (stem, c1, down) = (
        conv(3, 6, 3, 1, 1),
        conv(6, 6, 3, 1, 1),
        conv(6, 6, 1, 1, 0),
    );
    let bn = BatchNormConfig::new(6).init(&device);
    let x = Tensor::<4>::random([2, 3, 7, 7], Distribution::Default, &device).require_grad();
    for downsample in [false, true] {
        let h = super::conv2d(&stem, x.clone(), true, Input::Once);
        let out = super::conv2d(&c1, h.clone(), false, Input::Shared);
        let residual = if downsample {
            super::conv2d(&down, h.clone(), false, Input::Shared)
        } else {
            h.clone()
        };
        let uses = if downsample {
            Input::Once
        } else {
            Input::Shared
        };
        let ours = super::norm_add_relu(&bn, out, Some((residual, uses)), true);

        let hb = relu_as_ours(stem.forward(x.clone()), &h);
        let rb = if downsample {
            down.forward(hb.clone())
        } else {
            hb.clone()
        };
        let theirs = relu_as_ours(bn.forward(c1.forward(hb)) + rb, &ours);
        let e = worst(&to_vec(ours.clone()), &to_vec(theirs.clone()));
        assert!(
            e < TOLERANCE,
            "output differs by {e} (downsample: {downsample})"
        );
        let (go, gt) = (ours.sum().backward(), theirs.sum().backward());
        assert!(super::parts::none_parked(), "a part left waiting");
        let e = worst(&to_vec(x.grad(&go).unwrap()), &to_vec(x.grad(&gt).unwrap()));
        assert!(
            e < 1e-4,
            "input gradient differs by {e} (downsample: {downsample})"
        );
        let w = stem.weight.val();
        let e = worst(&to_vec(w.grad(&go).unwrap()), &to_vec(w.grad(&gt).unwrap()));
        assert!(
            e < 1e-4,
            "stem weight gradient differs by {e} (downsample: {downsample})"
        );
    }
}

/// gamma's and beta's gradients of our batch norm (`go`) against burn's (`gt`).
fn assert_same_norm_parameter_gradients(
    ours: &burn::nn::BatchNorm,
    go: &burn::tensor::Gradients,
    theirs: &burn::nn::BatchNorm,
    gt: &burn::tensor::Gradients,
) {
    for (name, ours, theirs) in [
        ("gamma", &ours.gamma, &theirs.gamma),
        ("beta", &ours.beta, &theirs.beta),
    ] {
        let e = worst(
            &to_vec(ours.val().grad(go).unwrap()),
            &to_vec(theirs.val().grad(gt).unwrap()),
        );
        assert!(e < 1e-4, "{name} gradient differs by {e}");
    }
}
