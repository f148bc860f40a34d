//! Between the call types' host matrices and candle tensors (feature `candle`): the one
//! place both the roles and the driver convert, with errors naming the tensor.

use candle_core::{DType, Device, Tensor};

use super::Mat;
use crate::error::{Error, Result};

fn candle_err(what: &str, e: candle_core::Error) -> Error {
    Error::internal(format!("{what}: {e}"))
}

/// An id or mask matrix as a U32 tensor on `device`; `name` is for the error when a value
/// does not fit (ids and masks are in 0..2^32).
pub fn ids_tensor(m: &Mat<i64>, name: &str, device: &Device) -> Result<Tensor> {
    let mut out = Vec::with_capacity(m.data.len());
    for (i, &x) in m.data.iter().enumerate() {
        out.push(u32::try_from(x).map_err(|_| {
            Error::invalid(format!(
                "tensor '{name}' holds {x} at row {} column {}; ids and masks must be in 0..2^32",
                i / m.cols.max(1),
                i % m.cols.max(1)
            ))
        })?);
    }
    Tensor::from_vec(out, (m.rows, m.cols), device).map_err(|e| candle_err(name, e))
}

/// An F32 matrix as a tensor on `device`.
pub fn f32_tensor(m: &Mat<f32>, name: &str, device: &Device) -> Result<Tensor> {
    Tensor::from_slice(&m.data, (m.rows, m.cols), device).map_err(|e| candle_err(name, e))
}

/// A `[rows, cols]` tensor of any float dtype, on any device, as an F32 host matrix.
pub fn mat_f32(t: &Tensor, name: &str) -> Result<Mat<f32>> {
    let (rows, cols) = t.dims2().map_err(|e| candle_err(name, e))?;
    let data = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| candle_err(name, e))?;
    Mat::new(rows, cols, data)
}

/// A `[rows, cols]` integer tensor as an I64 host matrix.
pub fn mat_i64(t: &Tensor, name: &str) -> Result<Mat<i64>> {
    let (rows, cols) = t.dims2().map_err(|e| candle_err(name, e))?;
    let data = t
        .to_dtype(DType::I64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<i64>())
        .map_err(|e| candle_err(name, e))?;
    Mat::new(rows, cols, data)
}

/// A `[rows]` tensor as F32 host values.
pub fn vec_f32(t: &Tensor, name: &str) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| candle_err(name, e))
}
