//! `DataBatch`: what role actors exchange — named tensors (row-major, little-endian, first
//! dimension = rows), per-row columns (prompt text, ids) and batch metadata. It splits
//! across ranks (`chunk`), gathers back (`concat`), pads to a divisor and unpads, and has a
//! self-describing byte encoding that is streamed in chunks (gRPC refuses messages over a
//! few MiB by default, and whole batches are often hundreds of MiB).
//!
//! Streaming copies as little as it can: tensor storage is shared ([`TensorBytes`]), so
//! [`encode_chunks`] hands out views of it as chunk data, and the [`Assembler`] copies each
//! received byte once, into its final tensor buffer, hashing it on the way. The encoding
//! lives in `wire.rs`.

use std::collections::BTreeMap;

pub use crate::tensor_bytes::{SharedRegion, TensorBytes};
use crate::{Error, Result};

pub use rlhf_types::DType;
pub use wire::{
    checksum, decode, decode_view, encode, encode_chunks, encode_header, encode_header_sized,
    to_chunks, Assembler, CHUNK_BYTES,
};

mod wire;

#[cfg(test)]
mod tests;

#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Little-endian, row-major.
    pub data: TensorBytes,
}

impl TensorData {
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let want = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        if want != Some(data.len()) {
            return Err(Error::invalid(format!(
                "tensor of shape {shape:?} and dtype {dtype:?} needs {} bytes, got {}",
                want.map_or_else(|| "more than usize::MAX".to_string(), |w| w.to_string()),
                data.len()
            )));
        }
        Ok(Self {
            dtype,
            shape,
            data: data.into(),
        })
    }

    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self> {
        Self::new(
            DType::F32,
            shape,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Result<Self> {
        Self::new(
            DType::I64,
            shape,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.expect(DType::F32)?;
        rlhf_types::f32s_from_le_bytes(&self.data).ok_or_else(|| {
            Error::invalid(format!(
                "an f32 tensor of {} bytes holds no whole number of values",
                self.data.len()
            ))
        })
    }

    pub fn to_i64(&self) -> Result<Vec<i64>> {
        self.expect(DType::I64)?;
        Ok(self
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect())
    }

    fn expect(&self, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(Error::invalid(format!(
                "expected a {dtype:?} tensor, got {:?}",
                self.dtype
            )));
        }
        Ok(())
    }

    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    /// Saturating: a tensor of no rows may announce any row shape (its data is empty).
    fn row_bytes(&self) -> usize {
        self.shape
            .iter()
            .skip(1)
            .fold(self.dtype.size(), |a, &d| a.saturating_mul(d))
    }

    fn slice_rows(&self, start: usize, end: usize) -> TensorData {
        let rb = self.row_bytes();
        let mut shape = self.shape.clone();
        if let Some(s) = shape.first_mut() {
            *s = end - start;
        }
        TensorData {
            dtype: self.dtype,
            shape,
            data: self.data[start * rb..end * rb].to_vec().into(),
        }
    }

    fn select_rows(&self, idx: &[usize]) -> TensorData {
        let rb = self.row_bytes();
        let mut data = Vec::with_capacity(idx.len() * rb);
        for &i in idx {
            data.extend_from_slice(&self.data[i * rb..(i + 1) * rb]);
        }
        let mut shape = self.shape.clone();
        if let Some(s) = shape.first_mut() {
            *s = idx.len();
        }
        TensorData {
            dtype: self.dtype,
            shape,
            data: data.into(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DataBatch {
    pub tensors: BTreeMap<String, TensorData>,
    /// Per-row values that are not tensors (prompt text, data ids, ...).
    pub columns: BTreeMap<String, Vec<serde_json::Value>>,
    pub meta: BTreeMap<String, serde_json::Value>,
}

impl DataBatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_tensor(mut self, name: &str, t: TensorData) -> Self {
        self.tensors.insert(name.to_string(), t);
        self
    }

    pub fn with_column(mut self, name: &str, values: Vec<serde_json::Value>) -> Self {
        self.columns.insert(name.to_string(), values);
        self
    }

    /// Number of rows; every tensor and column must agree (the error names the odd one out).
    pub fn len(&self) -> Result<usize> {
        let mut n: Option<(usize, String)> = None;
        let items = self
            .tensors
            .iter()
            .map(|(k, t)| (k, t.rows()))
            .chain(self.columns.iter().map(|(k, c)| (k, c.len())));
        for (k, rows) in items {
            match &n {
                None => n = Some((rows, k.clone())),
                Some((m, first)) if *m != rows => {
                    return Err(Error::invalid(format!(
                        "batch rows disagree: '{first}' has {m} rows, '{k}' has {rows}"
                    )))
                }
                _ => {}
            }
        }
        Ok(n.map(|(m, _)| m).unwrap_or(0))
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Splits the rows into `n` contiguous parts whose sizes differ by at most one.
    pub fn chunk(&self, n: usize) -> Result<Vec<DataBatch>> {
        if n == 0 {
            return Err(Error::invalid("cannot split a batch into 0 parts"));
        }
        let len = self.len()?;
        let (base, extra) = (len / n, len % n);
        let mut out = Vec::with_capacity(n);
        let mut start = 0;
        for i in 0..n {
            let end = start + base + usize::from(i < extra);
            out.push(DataBatch {
                tensors: self
                    .tensors
                    .iter()
                    .map(|(k, t)| (k.clone(), t.slice_rows(start, end)))
                    .collect(),
                columns: self
                    .columns
                    .iter()
                    .map(|(k, c)| (k.clone(), c[start..end].to_vec()))
                    .collect(),
                meta: self.meta.clone(),
            });
            start = end;
        }
        Ok(out)
    }

    /// Concatenates parts along rows; every part must carry the same names, dtypes and
    /// trailing shapes. Metadata is taken from the first part.
    pub fn concat(parts: &[DataBatch]) -> Result<DataBatch> {
        let Some(first) = parts.first() else {
            return Ok(DataBatch::new());
        };
        let mut out = DataBatch {
            meta: first.meta.clone(),
            ..Default::default()
        };
        for (name, t0) in &first.tensors {
            let mut data = Vec::new();
            let mut rows = 0;
            for (i, p) in parts.iter().enumerate() {
                let t = p.tensors.get(name).ok_or_else(|| {
                    Error::invalid(format!("concat: part {i} has no tensor '{name}'"))
                })?;
                if t.dtype != t0.dtype || t.shape.get(1..) != t0.shape.get(1..) {
                    return Err(Error::invalid(format!(
                        "concat: tensor '{name}' is {:?} {:?} in part 0 but {:?} {:?} in part {i}",
                        t0.dtype, t0.shape, t.dtype, t.shape
                    )));
                }
                rows += t.rows();
                data.extend_from_slice(&t.data);
            }
            let mut shape = t0.shape.clone();
            if let Some(s) = shape.first_mut() {
                *s = rows;
            }
            out.tensors.insert(
                name.clone(),
                TensorData {
                    dtype: t0.dtype,
                    shape,
                    data: data.into(),
                },
            );
        }
        for name in first.columns.keys() {
            let mut all = Vec::new();
            for (i, p) in parts.iter().enumerate() {
                let c = p.columns.get(name).ok_or_else(|| {
                    Error::invalid(format!("concat: part {i} has no column '{name}'"))
                })?;
                all.extend_from_slice(c);
            }
            out.columns.insert(name.clone(), all);
        }
        for (i, p) in parts.iter().enumerate() {
            if p.tensors.len() != first.tensors.len() || p.columns.len() != first.columns.len() {
                return Err(Error::invalid(format!(
                    "concat: part {i} has different tensors or columns than part 0"
                )));
            }
        }
        out.len()?;
        Ok(out)
    }

    pub fn select(&self, idx: &[usize]) -> Result<DataBatch> {
        let len = self.len()?;
        if let Some(bad) = idx.iter().find(|&&i| i >= len) {
            return Err(Error::invalid(format!(
                "row {bad} is out of range for a batch of {len} rows"
            )));
        }
        Ok(DataBatch {
            tensors: self
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.select_rows(idx)))
                .collect(),
            columns: self
                .columns
                .iter()
                .map(|(k, c)| (k.clone(), idx.iter().map(|&i| c[i].clone()).collect()))
                .collect(),
            meta: self.meta.clone(),
        })
    }

    /// Pads to a multiple of `divisor` by repeating rows from the start, so every rank gets
    /// an equal share; returns the padded batch and how many rows were added (for `unpad`).
    pub fn pad_to_multiple(&self, divisor: usize) -> Result<(DataBatch, usize)> {
        if divisor == 0 {
            return Err(Error::invalid("pad divisor must be at least 1"));
        }
        let len = self.len()?;
        let pad = (divisor - len % divisor) % divisor;
        if pad == 0 {
            return Ok((self.clone(), 0));
        }
        if len == 0 {
            return Err(Error::invalid("cannot pad an empty batch"));
        }
        let idx: Vec<usize> = (0..len + pad).map(|i| i % len).collect();
        Ok((self.select(&idx)?, pad))
    }

    /// Drops the last `pad` rows added by `pad_to_multiple`.
    pub fn unpad(&self, pad: usize) -> Result<DataBatch> {
        let len = self.len()?;
        if pad > len {
            return Err(Error::invalid(format!(
                "cannot remove {pad} padding rows from {len}"
            )));
        }
        self.select(&(0..len - pad).collect::<Vec<_>>())
    }
}
