//! Conversions between wire tensors and the host vectors / candle tensors of the loop.

use candle_core::{Device, Tensor};
use rlhf_core::batch::{DataBatch, TensorData};
use rlhf_core::{Error, Result};

pub fn get<'a>(b: &'a DataBatch, name: &str, from: &str) -> Result<&'a TensorData> {
    b.tensors.get(name).ok_or_else(|| {
        Error::internal(format!(
            "{from} answered without tensor '{name}' (has: {})",
            b.tensors.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })
}

/// A `[rows, cols]` f32 tensor from an answer, checked.
pub fn f32_2d(b: &DataBatch, name: &str, rows: usize, cols: usize, from: &str) -> Result<Vec<f32>> {
    let t = get(b, name, from)?;
    if t.shape != [rows, cols] {
        return Err(Error::internal(format!(
            "{from}: tensor '{name}' has shape {:?}, expected [{rows}, {cols}]",
            t.shape
        )));
    }
    t.to_f32()
}

pub fn f32_1d(b: &DataBatch, name: &str, rows: usize, from: &str) -> Result<Vec<f32>> {
    let t = get(b, name, from)?;
    if t.shape != [rows] {
        return Err(Error::internal(format!(
            "{from}: tensor '{name}' has shape {:?}, expected [{rows}]",
            t.shape
        )));
    }
    t.to_f32()
}

pub fn candle(v: &[f32], shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)
        .map_err(|e| Error::internal(format!("building a tensor of shape {shape:?}: {e}")))
}

pub fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| Error::internal(format!("reading a tensor: {e}")))
}

pub fn wire_f32(v: &[f32], shape: &[usize]) -> Result<TensorData> {
    TensorData::from_f32(shape.to_vec(), v)
}

pub fn wire_i64(v: &[i64], shape: &[usize]) -> Result<TensorData> {
    TensorData::from_i64(shape.to_vec(), v)
}
