//! Between the wire batch (`rlhf_core::batch::DataBatch`, little-endian host bytes) and
//! candle tensors, with errors that name the call, the tensor and the shapes.

use candle_core::{DType, Device, Tensor};
use rlhf_core::batch::{DataBatch, TensorData};

use crate::error::{Error, Result};

/// A request batch with the name of the call it came with, for error messages.
pub struct Request<'a> {
    pub call: &'static str,
    pub batch: &'a DataBatch,
}

impl<'a> Request<'a> {
    pub fn new(call: &'static str, batch: &'a DataBatch) -> Self {
        Self { call, batch }
    }

    /// Rows of the batch (every tensor and column agrees).
    pub fn rows(&self) -> Result<usize> {
        Ok(self.batch.len()?)
    }

    pub fn tensor(&self, name: &str) -> Result<&'a TensorData> {
        self.batch.tensors.get(name).ok_or_else(|| {
            let have: Vec<&str> = self.batch.tensors.keys().map(String::as_str).collect();
            Error::invalid(format!(
                "{} request has no tensor '{name}' (it carries: {}); the driver must send it",
                self.call,
                if have.is_empty() {
                    "none".to_string()
                } else {
                    have.join(", ")
                }
            ))
        })
    }

    fn shaped(&self, name: &str, shape: &[usize]) -> Result<&'a TensorData> {
        let t = self.tensor(name)?;
        if t.shape != shape {
            return Err(Error::invalid(format!(
                "{}: tensor '{name}' has shape {:?}, expected {shape:?}",
                self.call, t.shape
            )));
        }
        Ok(t)
    }

    /// An I64 id or mask tensor of exactly `shape`, as a u32 tensor.
    pub fn ids(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let t = self.shaped(name, shape)?;
        let v = t
            .to_i64()
            .map_err(|e| Error::invalid(format!("{}: tensor '{name}': {e}", self.call)))?;
        let mut out = Vec::with_capacity(v.len());
        for (i, x) in v.into_iter().enumerate() {
            let x = u32::try_from(x).map_err(|_| {
                Error::invalid(format!(
                    "{}: tensor '{name}' holds {x} at flat index {i}; ids and masks must be in 0..2^32",
                    self.call
                ))
            })?;
            out.push(x);
        }
        Ok(Tensor::from_vec(out, shape, device)?)
    }

    /// An F32 tensor of exactly `shape` (finiteness is the caller's check: only valid
    /// positions matter).
    pub fn f32(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let t = self.shaped(name, shape)?;
        let v = t
            .to_f32()
            .map_err(|e| Error::invalid(format!("{}: tensor '{name}': {e}", self.call)))?;
        Ok(Tensor::from_vec(v, shape, device)?)
    }

    /// An optional `u64` from the batch meta.
    pub fn meta_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.batch.meta.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: meta '{key}' must be a non-negative integer, got {v}",
                    self.call
                ))
            }),
        }
    }

    /// A string column, one entry per row.
    pub fn strings(&self, name: &str) -> Result<Vec<String>> {
        let col = self.batch.columns.get(name).ok_or_else(|| {
            let have: Vec<&str> = self.batch.columns.keys().map(String::as_str).collect();
            Error::invalid(format!(
                "{} request has no column '{name}' (columns: {})",
                self.call,
                if have.is_empty() {
                    "none".to_string()
                } else {
                    have.join(", ")
                }
            ))
        })?;
        col.iter()
            .enumerate()
            .map(|(i, v)| match v {
                serde_json::Value::String(s) => Ok(s.clone()),
                other => Err(Error::invalid(format!(
                    "{}: column '{name}' row {i} is {other}, expected a string",
                    self.call
                ))),
            })
            .collect()
    }
}

/// A `[B, ...]` f32 tensor as wire data.
pub fn f32_data(t: &Tensor) -> Result<TensorData> {
    let shape = t.dims().to_vec();
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(TensorData::from_f32(shape, &v)?)
}

/// A `[B, ...]` integer tensor as I64 wire data.
pub fn i64_data(t: &Tensor) -> Result<TensorData> {
    let shape = t.dims().to_vec();
    let v = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
    Ok(TensorData::from_i64(shape, &v)?)
}

/// Rows `idx` of `t` (dim 0).
pub fn rows(t: &Tensor, idx: &[usize]) -> Result<Tensor> {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    let ids = Tensor::from_vec(ids, idx.len(), t.device())?;
    Ok(t.index_select(&ids, 0)?)
}
