//! A network's tensors as flat `f32` buffers, in the order of its fields, with PyTorch's
//! names: what checkpoints, model files and the all-reduce carry.
//!
//! A convolution's weight (`[c_out, c_in, kh, kw]`) lies in them as the kernels multiply by it,
//! `[c_out][kh][kw][c_in]` (`kernels::conv::WeightLayout::TapsFirst`), and [`load`] gives the
//! model tensors stored so (channels-last): the kernels then read the weight as it lies and
//! hand its gradient back the same way, with no pass over either to PyTorch's layout and back
//! each step. Checkpoints and model files convert at their edge (`checkpoint`), as they do
//! for burn's transposed linear weights.

use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use kernels::layout::{copied, copy};
use kernels::sgd::Sgd;
use rayon::prelude::*;

use super::Net;

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
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The shape PyTorch gives this tensor (Linear weights transposed).
    pub(crate) fn torch_shape(&self) -> Vec<usize> {
        if self.is_linear_weight() {
            vec![self.shape[1], self.shape[0]]
        } else {
            self.shape.clone()
        }
    }

    /// burn stores Linear weights as `[in, out]`, PyTorch as `[out, in]`.
    pub(crate) fn is_linear_weight(&self) -> bool {
        self.path.starts_with("fc") && self.path.ends_with(".weight")
    }

    /// A convolution's weight: in the flat buffers `[c_out][kh][kw][c_in]`, PyTorch's
    /// `[c_out][c_in][kh][kw]` elsewhere (the only 4-d tensors of the models).
    pub(crate) fn is_conv_weight(&self) -> bool {
        self.trainable && self.shape.len() == 4
    }
}

/// The axes that take a 4-d tensor `[c_out, c_in, kh, kw]` to the flat buffers' order
/// `[c_out, kh, kw, c_in]`, and back; any other rank as it is.
fn to_flat_order<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    permute_4d(t, [0, 2, 3, 1])
}

fn from_flat_order<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    permute_4d(t, [0, 3, 1, 2])
}

fn permute_4d<const D: usize>(t: Tensor<D>, axes4: [usize; 4]) -> Tensor<D> {
    if D != 4 {
        return t;
    }
    let mut axes = [0usize; D];
    axes.copy_from_slice(&axes4);
    t.permute(axes)
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
        let values = if trainable {
            to_vec(to_flat_order(tensor))
        } else {
            to_vec(tensor)
        };
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
        let trainable = !is_buffer(&self.path.leaf());
        let values: &mut &[f32] = if !trainable {
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
        let mut fresh = if trainable && D == 4 {
            // Stored in the flat order, seen as `[c_out, c_in, kh, kw]`.
            let flat_shape = [shape[0], shape[2], shape[3], shape[1]];
            let data = TensorData::new(copied(mine), flat_shape.to_vec());
            from_flat_order(Tensor::<D>::from_data(data, &device))
        } else {
            Tensor::<D>::from_data(TensorData::new(copied(mine), shape), &device)
        };
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

/// Changes the model's trainable parameters where they lie: `update(offset, values)` gets each
/// one's values in the flat buffers' order (convolution weights taps first), `offset` being
/// where they start in those buffers, and changes them in place.
///
/// Between steps the model is the only holder of its parameters' storage (the backward's graph
/// and the gradients are gone), so each tensor's buffer moves out of burn, is updated, and
/// moves back: no copy, where a [`snapshot`], an update of the flat buffers and a [`load`] pass
/// over every parameter twice more. A tensor still shared elsewhere is copied first, so the
/// result is the same either way.
pub fn update<M: Net>(model: M, update: &mut dyn FnMut(usize, &mut [f32])) -> M {
    struct Updater<'a> {
        path: Path,
        offset: usize,
        update: &'a mut dyn FnMut(usize, &mut [f32]),
    }
    impl ModuleMapper for Updater<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, container: &str) {
            self.path.exit(container);
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if is_buffer(&self.path.leaf()) {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            let device = tensor.device();
            let require_grad = tensor.is_require_grad();
            // A convolution's weight is stored taps first: seen so, it is contiguous, and its
            // buffer moves out whole.
            let flat = to_flat_order(tensor);
            let shape = flat.shape();
            let mut values = to_vec(flat);
            (self.update)(self.offset, &mut values);
            self.offset += values.len();
            let mut fresh = from_flat_order(Tensor::<D>::from_data(
                TensorData::new(values, shape),
                &device,
            ));
            if require_grad {
                fresh = fresh.require_grad();
            }
            Param::from_mapped_value(id, fresh, mapper)
        }
    }
    model.settle();
    model.map(&mut Updater {
        path: Path::default(),
        offset: 0,
        update,
    })
}

/// A step's gradients as the update reads them, in parameter order.
#[derive(Clone, Copy, Debug)]
pub enum StepGradients<'a> {
    /// One flat buffer: what the all-reduce sums ([`ParamGradients::flatten_into`]).
    Flat(&'a [f32]),
    /// Each parameter's own, as burn handed it over ([`ParamGradients`]): a rank alone has
    /// nothing to sum, and the copy into one buffer (a pass over every gradient, 2.4 ms of
    /// resnet18's 60–100 ms step at batch 32, at 1 thread as at 2) is spared.
    Parts(&'a ParamGradients),
}

impl StepGradients<'_> {
    fn len(&self) -> usize {
        match self {
            StepGradients::Flat(flat) => flat.len(),
            StepGradients::Parts(parts) => parts.len(),
        }
    }
}

/// PyTorch's SGD ([`kernels::sgd::step`]) on the model's own parameters ([`update`]), with the
/// momentum as a flat buffer in their order.
pub fn sgd_step<M: Net>(model: M, momentum: &mut [f32], grads: StepGradients, sgd: Sgd) -> M {
    assert_eq!(momentum.len(), grads.len(), "a momentum for every gradient");
    let mut index = 0;
    let mut zeros = Vec::new();
    update(model, &mut |offset, params| {
        let at = offset..offset + params.len();
        let grad = match grads {
            StepGradients::Flat(flat) => &flat[at.clone()],
            StepGradients::Parts(parts) => {
                let (len, values) = &parts.parts[index];
                assert_eq!(*len, params.len(), "parameter {index}'s gradient size");
                values.as_deref().unwrap_or_else(|| {
                    zeros.resize(*len, 0.0);
                    &zeros[..]
                })
            }
        };
        index += 1;
        kernels::sgd::step(params, &mut momentum[at], grad, sgd);
    })
}

/// Gradients of the trainable parameters in parameter order, each as burn handed it over (its
/// values moved out of burn, uncopied): element counts, and `None` where a parameter got no
/// gradient.
#[derive(Debug)]
pub struct ParamGradients {
    parts: Vec<(usize, Option<Vec<f32>>)>,
}

impl ParamGradients {
    /// Every parameter's gradient out of `grads`.
    pub fn take<M: Net>(model: &M, grads: &mut burn::tensor::Gradients) -> Self {
        /// Each parameter's element count and gradient, in order.
        struct Grads<'a> {
            path: Path,
            grads: &'a mut burn::tensor::Gradients,
            parts: Vec<(usize, Option<Vec<f32>>)>,
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
                let len = tensor.shape().num_elements();
                let grad = tensor.grad_remove(self.grads);
                self.parts
                    .push((len, grad.map(|g| to_vec(to_flat_order(g)))));
            }
        }
        let mut visitor = Grads {
            path: Path::default(),
            grads,
            parts: Vec::new(),
        };
        model.visit(&mut visitor);
        ParamGradients {
            parts: visitor.parts,
        }
    }

    /// Their values in all.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|(len, _)| len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Into `out`, flat in parameter order, zeros for a parameter without one (so that every
    /// rank's buffer has the same layout), copied on rayon's threads (`out` keeps its
    /// allocation from step to step).
    pub(crate) fn flatten_into(&self, out: &mut Vec<f32>) {
        let total = self.len();
        if out.len() != total {
            out.clear();
            out.resize(total, 0.0);
        }
        let mut rest = out.as_mut_slice();
        let mut jobs = Vec::with_capacity(self.parts.len());
        for (len, values) in &self.parts {
            let (mine, after) = std::mem::take(&mut rest).split_at_mut(*len);
            rest = after;
            jobs.push((mine, values));
        }
        jobs.into_par_iter().for_each(|(dst, values)| match values {
            Some(v) => copy(dst, v),
            None => dst.fill(0.0),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::training_device;
    use crate::model::SeedCnn;

    /// The model's first 4-d tensor as burn reads it: PyTorch's order, whatever its storage.
    fn first_4d<M: Net>(model: &M) -> Vec<f32> {
        struct First(Option<Vec<f32>>);
        impl ModuleVisitor for First {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if D == 4 && self.0.is_none() {
                    self.0 = Some(to_vec(param.val()));
                }
            }
        }
        let mut first = First(None);
        model.visit(&mut first);
        first.0.expect("a convolution")
    }

    /// The flat buffers hold a convolution weight `[c_out][kh][kw][c_in]`, and `load` gives it
    /// back to the model as the same `[c_out, c_in, kh, kw]` tensor, stored channels-last.
    #[test]
    fn conv_weights_lie_taps_first_in_the_flat_buffers_and_load_back_as_they_were() {
        let device = training_device();
        let model = SeedCnn::new(10, &device);
        let snap = snapshot(&model);
        let (entry, flat) = snap.tensors()[0];
        assert!(entry.is_conv_weight(), "{entry:?}");
        let [co, ci, kh, kw] = [
            entry.shape[0],
            entry.shape[1],
            entry.shape[2],
            entry.shape[3],
        ];
        let torch = first_4d(&model);
        let at = |o: usize, c: usize, y: usize, x: usize| ((o * ci + c) * kh + y) * kw + x;
        for o in 0..co {
            for y in 0..kh {
                for x in 0..kw {
                    for c in 0..ci {
                        let flat_at = ((o * kh + y) * kw + x) * ci + c;
                        assert_eq!(flat[flat_at], torch[at(o, c, y, x)], "({o}, {c}, {y}, {x})");
                    }
                }
            }
        }
        // A bias, a linear weight: as they are.
        assert!(!snap.tensors()[1].0.is_conv_weight());
        let loaded = load(model, Some(&snap.params), &snap.buffers);
        assert_eq!(first_4d(&loaded), torch, "the weight as it was");
        assert_eq!(snapshot(&loaded), snap, "a snapshot of what was loaded");
    }

    /// `update` hands each parameter over at its place in the flat buffers, what it writes is
    /// what the model then holds, and after a step (forward, backward, gradients out) the next
    /// update finds each parameter's storage where the last one left it: nothing was copied.
    #[test]
    fn updates_see_the_flat_buffers_and_change_the_parameters_in_place() {
        let device = training_device();
        let model = SeedCnn::new(10, &device);
        let snap = snapshot(&model);
        let mut seen = vec![f32::NAN; snap.params.len()];
        let model = update(model, &mut |offset, values| {
            seen[offset..offset + values.len()].copy_from_slice(values);
            values.iter_mut().for_each(|v| *v = 0.5 - *v);
        });
        assert_eq!(
            seen, snap.params,
            "each tensor at its place in the flat buffers"
        );
        let after = snapshot(&model);
        let wanted: Vec<f32> = snap.params.iter().map(|v| 0.5 - v).collect();
        assert_eq!(
            after.params, wanted,
            "the model holds what the update wrote"
        );
        assert_eq!(after.buffers, snap.buffers, "buffers are not parameters");

        let mut first = Vec::new();
        let model = update(model, &mut |_, values| first.push(values.as_ptr() as usize));
        let loss = model
            .forward(Tensor::<4>::ones([2, 3, 32, 32], &device))
            .sum();
        let mut grads = loss.backward();
        let mut flat = Vec::new();
        ParamGradients::take(&model, &mut grads).flatten_into(&mut flat);
        drop(grads);
        let mut second = Vec::new();
        let _ = update(model, &mut |_, values| {
            second.push(values.as_ptr() as usize)
        });
        assert_eq!(
            second, first,
            "every parameter's storage moved out and back, uncopied"
        );
    }

    /// A rank alone updates from each parameter's gradient where burn left it: the same bits
    /// as from the flat buffer the all-reduce sums, for the parameters and the momentum.
    #[test]
    fn the_update_from_each_parameters_gradient_is_the_flat_buffers_to_the_bit() {
        let device = training_device();
        let model = SeedCnn::new(10, &device);
        let pixels: Vec<f32> = (0..2 * 3 * 32 * 32)
            .map(|i| (i % 17) as f32 / 17.0)
            .collect();
        let x = Tensor::<4>::from_data(TensorData::new(pixels, [2, 3, 32, 32]), &device);
        let mut grads = model.forward(x).sum().backward();
        let taken = ParamGradients::take(&model, &mut grads);
        let mut flat = Vec::new();
        taken.flatten_into(&mut flat);
        assert_eq!(flat.len(), taken.len());
        assert!(flat.iter().filter(|g| **g != 0.0).count() > flat.len() / 2);
        let before = snapshot(&model).params;
        let sgd = Sgd {
            learning_rate: 0.1,
            momentum: 0.9,
            weight_decay: 1e-4,
            first: false,
            grad_scale: 1.0,
        };
        let momentum: Vec<f32> = (0..flat.len()).map(|i| (i % 7) as f32 * 0.01).collect();
        let (mut from_flat, mut from_parts) = (momentum.clone(), momentum);
        let a = sgd_step(
            model.clone(),
            &mut from_flat,
            StepGradients::Flat(&flat),
            sgd,
        );
        let b = sgd_step(model, &mut from_parts, StepGradients::Parts(&taken), sgd);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let (a, b) = (snapshot(&a).params, snapshot(&b).params);
        assert_eq!(bits(&a), bits(&b), "the parameters");
        assert_eq!(bits(&from_flat), bits(&from_parts), "the momentum");
        assert_ne!(a, before, "the update moved them");
    }

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
