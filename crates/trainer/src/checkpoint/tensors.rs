//! Safetensors with PyTorch's names and layout: a [`Snapshot`] (and optionally the optimizer's
//! momentum) encoded, and tensors decoded back into the flat buffers' layout against a
//! template, every name and shape checked.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};
use serde::Serialize;

use kernels::layout::transpose_each;

use crate::error::{Result, TrainError};
use crate::model::{Entry, Snapshot};

/// The prefix of the optimizer's momentum tensors' names in a checkpoint.
pub(super) const MOMENTUM_PREFIX: &str = "optimizer.momentum.";

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `values` as a `rows × cols` row-major matrix, transposed.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = values[r * cols + c];
        }
    }
    t
}

/// PyTorch's layout of one tensor: linear weights transposed to `[out, in]`, convolution
/// weights from the flat buffers' `[c_out][kh][kw][c_in]` to `[c_out][c_in][kh][kw]`.
fn to_torch(entry: &Entry, values: &[f32]) -> (Vec<usize>, Vec<f32>) {
    if entry.is_linear_weight() {
        (
            entry.torch_shape(),
            transpose(values, entry.shape[0], entry.shape[1]),
        )
    } else if entry.is_conv_weight() {
        let (c_in, taps) = (entry.shape[1], entry.shape[2] * entry.shape[3]);
        (entry.shape.clone(), transpose_each(values, taps, c_in))
    } else {
        (entry.shape.clone(), values.to_vec())
    }
}

/// The flat buffers' layout of one tensor from PyTorch's: the inverse of [`to_torch`].
fn from_torch(entry: &Entry, values: &[f32]) -> Vec<f32> {
    if entry.is_linear_weight() {
        transpose(values, entry.shape[1], entry.shape[0])
    } else if entry.is_conv_weight() {
        let (c_in, taps) = (entry.shape[1], entry.shape[2] * entry.shape[3]);
        transpose_each(values, c_in, taps)
    } else {
        values.to_vec()
    }
}

/// Serialises the model (and optionally the optimizer's momentum) as safetensors with PyTorch
/// names. `batches_tracked` fills BatchNorm's `num_batches_tracked`.
pub(super) fn encode(
    snapshot: &Snapshot,
    momentum: Option<&[f32]>,
    batches_tracked: u64,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut offset = 0;
    for (entry, values) in snapshot.tensors() {
        let (shape, data) = to_torch(entry, values);
        let name = entry.torch_name.clone();
        if let (Some(m), true) = (momentum, entry.trainable) {
            let (_, m) = to_torch(entry, &m[offset..offset + values.len()]);
            tensors.push((
                format!("{MOMENTUM_PREFIX}{name}"),
                Dtype::F32,
                shape.clone(),
                f32_bytes(&m),
            ));
        }
        if entry.trainable {
            offset += values.len();
        }
        if entry.path.ends_with("running_var") {
            let counter = name.replace("running_var", "num_batches_tracked");
            tensors.push((
                counter,
                Dtype::I64,
                vec![],
                (batches_tracked as i64).to_le_bytes().to_vec(),
            ));
        }
        tensors.push((name, Dtype::F32, shape, f32_bytes(&data)));
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TrainError::Config(format!("cannot lay out tensors: {e}")))?;
    safetensors::serialize(views, metadata)
        .map_err(|e| TrainError::Config(format!("cannot serialise tensors: {e}")))
}

/// Reads tensors named like `template`'s entries (prefixed by `prefix`) out of safetensors
/// bytes, checking every name and shape. Returns (trainable values, buffer values).
pub(super) fn decode(
    tensors: &safetensors::SafeTensors,
    template: &[Entry],
    prefix: &str,
    trainable_only: bool,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let (mut params, mut buffers) = (Vec::new(), Vec::new());
    for entry in template.iter().filter(|e| e.trainable || !trainable_only) {
        let name = format!("{prefix}{}", entry.torch_name);
        let view = tensors.tensor(&name).map_err(|_| {
            format!("has no tensor {name} (a model of another network or class count?)")
        })?;
        let expected = entry.torch_shape();
        if view.dtype() != Dtype::F32 || view.shape() != expected {
            return Err(format!(
                "tensor {name} is {:?} {:?}, expected F32 {expected:?}",
                view.dtype(),
                view.shape()
            ));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let values = from_torch(entry, &values);
        if entry.trainable {
            params.extend(values)
        } else {
            buffers.extend(values)
        }
    }
    Ok((params, buffers))
}

pub(super) fn to_json<T: Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| TrainError::Config(e.to_string()))
}
