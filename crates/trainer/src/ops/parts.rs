//! The gradient of an input two of these operations read ([`Input::Shared`]: a ResNet block's
//! input, read by its first convolution and by the residual add or the downsample
//! convolution), summed here, channels-last, and handed to burn once.
//!
//! burn sums the gradients registered for one tensor itself, but its add walks a channels-last
//! tensor element by element (3-4 ms a block of resnet50 at 64 px). Both parts went to it
//! NCHW instead, at the cost of three transposes a block (each part out, the sum back in):
//! 2.7 % of resnet50's step at 1 thread. Now the first of the two backward steps to run parks
//! its part ([`add_part`]), and the second adds it to its own and registers the sum.
//!
//! Invariant: an [`Input::Shared`] tensor is read by exactly two of these operations, both
//! marked so. burn runs a graph's backward steps one after the other on the thread that
//! called `backward`, and both parts before the step that consumes their sum (the tensor's
//! producer): the parked parts are that thread's, and none is left when `backward` returns
//! ([`assert_none_parked`]).

use std::cell::RefCell;
use std::collections::HashMap;

use rayon::prelude::*;

#[cfg(doc)]
use super::Input;

thread_local! {
    /// The first part of each shared tensor's gradient whose second has not come yet, by the
    /// tensor's autodiff node.
    static PARKED: RefCell<HashMap<u64, Vec<f32>>> = RefCell::new(HashMap::new());
}

/// One part (`part`, NHWC) of the gradient of node `node`'s tensor: `None` while it is the
/// first (parked), the whole gradient with the second.
pub(super) fn add_part(node: u64, mut part: Vec<f32>) -> Option<Vec<f32>> {
    let first = PARKED.with(|parked| parked.borrow_mut().remove(&node));
    match first {
        None => {
            PARKED.with(|parked| parked.borrow_mut().insert(node, part));
            None
        }
        Some(first) => {
            assert_eq!(
                first.len(),
                part.len(),
                "the two parts of a shared gradient"
            );
            part.par_chunks_mut(1 << 16)
                .zip(first.par_chunks(1 << 16))
                .for_each(|(sum, first)| {
                    for (s, f) in sum.iter_mut().zip(first) {
                        *s += f;
                    }
                });
            Some(part)
        }
    }
}

/// Whether no part waits for its second on this thread: true after every backward pass.
pub(crate) fn none_parked() -> bool {
    PARKED.with(|parked| parked.borrow().is_empty())
}

/// Panics, saying why, unless [`none_parked`]: called after each backward pass of a step.
pub(crate) fn assert_none_parked() {
    assert!(
        none_parked(),
        "a shared input's gradient lost a part: an `Input::Shared` tensor must be read by \
         exactly two of trainctl's operations, both marked `Shared`"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_part_brings_the_sum_and_takes_the_first_away() {
        assert_eq!(add_part(7, vec![1.0; 100_000]), None);
        assert!(!none_parked());
        // Another tensor's part waits apart.
        assert_eq!(add_part(8, vec![5.0; 3]), None);
        let sum = add_part(7, (0..100_000).map(|i| i as f32).collect()).unwrap();
        assert!(sum.iter().enumerate().all(|(i, v)| *v == i as f32 + 1.0));
        assert_eq!(add_part(8, vec![1.0; 3]), Some(vec![6.0; 3]));
        assert!(none_parked());
    }
}
