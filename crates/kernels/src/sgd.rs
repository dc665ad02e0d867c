//! The optimizer's update over flat parameter buffers.

use multiversion::multiversion;
use rayon::prelude::*;

/// Elements per parallel chunk of [`step`]: large enough that a chunk costs more than handing it
/// to a thread, small enough that two threads share a ResNet's buffers evenly.
const CHUNK: usize = 1 << 16;

/// The hyper-parameters of one [`step`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub learning_rate: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    /// The first step: the momentum buffer starts as the step's direction.
    pub first: bool,
    /// What each gradient is multiplied by as it is read: `1 / world size` turns an
    /// all-reduce's sums into PyTorch's mean without a pass of its own over the buffer.
    pub grad_scale: f32,
}

/// PyTorch's SGD (`torch.optim.SGD`, no dampening or Nesterov) on the gradients `scale·g`
/// (rounded as a separate multiplication would round them): `d = g + wd·p`; `buf = d` on
/// the first step or without momentum, else `momentum·buf + d`; `p -= lr·buf`. Element by
/// element, so bit-identical on any number of threads.
pub fn step(params: &mut [f32], momentum: &mut [f32], grads: &[f32], sgd: Sgd) {
    assert_eq!(params.len(), grads.len(), "a gradient for every parameter");
    assert_eq!(
        params.len(),
        momentum.len(),
        "a momentum for every parameter"
    );
    params
        .par_chunks_mut(CHUNK)
        .zip(momentum.par_chunks_mut(CHUNK))
        .zip(grads.par_chunks(CHUNK))
        .for_each(|((p, b), g)| chunk(p, b, g, sgd));
}

#[multiversion(targets = "simd")]
fn chunk(params: &mut [f32], momentum: &mut [f32], grads: &[f32], sgd: Sgd) {
    let Sgd {
        learning_rate: lr,
        momentum: mu,
        weight_decay: wd,
        first,
        grad_scale,
    } = sgd;
    let restart = first || mu == 0.0;
    for ((p, b), g) in params.iter_mut().zip(momentum.iter_mut()).zip(grads) {
        let d = g * grad_scale + wd * *p;
        *b = if restart { d } else { mu * *b + d };
        *p -= lr * *b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::random;

    /// The rule written out for one element, as PyTorch's documentation gives it, on the
    /// gradient scaled first, as a pass of its own over the buffer would.
    fn reference(p: f32, b: f32, g: f32, sgd: Sgd) -> (f32, f32) {
        let g = g * sgd.grad_scale;
        let d = g + sgd.weight_decay * p;
        let b = if sgd.first || sgd.momentum == 0.0 {
            d
        } else {
            sgd.momentum * b + d
        };
        (p - sgd.learning_rate * b, b)
    }

    #[test]
    fn every_element_follows_pytorchs_rule_on_any_thread_count() {
        let len = 3 * CHUNK + 17;
        let (p0, b0, g) = (random(len, 1), random(len, 2), random(len, 3));
        for (first, momentum, grad_scale) in [
            (true, 0.0, 1.0),
            (true, 0.9, 1.0),
            (false, 0.0, 1.0),
            (false, 0.9, 1.0),
            (false, 0.9, 1.0 / 3.0),
        ] {
            let sgd = Sgd {
                learning_rate: 0.1,
                momentum,
                weight_decay: 1e-4,
                first,
                grad_scale,
            };
            let mut results = Vec::new();
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (mut p, mut b) = (p0.clone(), b0.clone());
                pool.install(|| step(&mut p, &mut b, &g, sgd));
                results.push((p, b));
            }
            for (i, ((p, b), ((&p0, &b0), &g))) in results[0]
                .0
                .iter()
                .zip(&results[0].1)
                .zip(p0.iter().zip(&b0).zip(&g))
                .enumerate()
            {
                assert_eq!((*p, *b), reference(p0, b0, g, sgd), "element {i}, {sgd:?}");
            }
            assert!(
                results.windows(2).all(|w| w[0] == w[1]),
                "thread counts differ"
            );
        }
    }
}
