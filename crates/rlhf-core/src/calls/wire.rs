//! The host side of the wire: [`Mat`], the element types that cross it, and the reader and
//! writers the call types in `super` are built from (with errors that name the call and the
//! tensor).

use serde_json::{json, Value};

use crate::batch::{DataBatch, TensorData};
use crate::error::{Error, Result};
use rlhf_proto::BatchCall;

/// A row-major `[rows, cols]` matrix on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Mat<T> {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<T>,
}

impl<T: Copy> Mat<T> {
    /// Checks that `data` holds `rows * cols` values.
    pub fn new(rows: usize, cols: usize, data: Vec<T>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(Error::invalid(format!(
                "a [{rows}, {cols}] matrix needs {} values, got {}",
                rows * cols,
                data.len()
            )));
        }
        Ok(Self { rows, cols, data })
    }

    pub fn filled(rows: usize, cols: usize, value: T) -> Self {
        Self {
            rows,
            cols,
            data: vec![value; rows * cols],
        }
    }

    pub fn row(&self, i: usize) -> &[T] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [T] {
        &mut self.data[i * self.cols..(i + 1) * self.cols]
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// `[a | b]` row by row (prompt and response halves of a sequence).
    pub fn hcat(a: &Mat<T>, b: &Mat<T>) -> Result<Mat<T>> {
        if a.rows != b.rows {
            return Err(Error::invalid(format!(
                "cannot join a {:?} and a {:?} matrix side by side",
                a.shape(),
                b.shape()
            )));
        }
        let mut data = Vec::with_capacity(a.data.len() + b.data.len());
        for i in 0..a.rows {
            data.extend_from_slice(a.row(i));
            data.extend_from_slice(b.row(i));
        }
        Ok(Mat {
            rows: a.rows,
            cols: a.cols + b.cols,
            data,
        })
    }

    /// The rows `which` (in that order) of matrices of one width stacked one on another:
    /// `which[k] = (part, row)`. Builds a batch from the groups dynamic sampling keeps.
    pub fn gather_rows(parts: &[&Mat<T>], which: &[(usize, usize)]) -> Result<Mat<T>> {
        let cols = parts.first().map_or(0, |m| m.cols);
        let mut data = Vec::with_capacity(which.len() * cols);
        for &(p, r) in which {
            let m = parts.get(p).filter(|m| r < m.rows).ok_or_else(|| {
                Error::internal(format!("row {r} of part {p} is not among the matrices"))
            })?;
            if m.cols != cols {
                return Err(Error::invalid(format!(
                    "cannot stack a {:?} matrix under one {cols} wide",
                    m.shape()
                )));
            }
            data.extend_from_slice(m.row(r));
        }
        Ok(Mat {
            rows: which.len(),
            cols,
            data,
        })
    }
}

/// An element type that crosses the wire.
pub trait Elem: Copy {
    fn to_wire(shape: Vec<usize>, values: &[Self]) -> Result<TensorData>;
    fn from_wire(t: &TensorData) -> Result<Vec<Self>>;
}

impl Elem for f32 {
    fn to_wire(shape: Vec<usize>, values: &[Self]) -> Result<TensorData> {
        TensorData::from_f32(shape, values)
    }
    fn from_wire(t: &TensorData) -> Result<Vec<Self>> {
        t.to_f32()
    }
}

impl Elem for i64 {
    fn to_wire(shape: Vec<usize>, values: &[Self]) -> Result<TensorData> {
        TensorData::from_i64(shape, values)
    }
    fn from_wire(t: &TensorData) -> Result<Vec<Self>> {
        t.to_i64()
    }
}

/// Reads a wire batch for one call, with errors that name the call and the tensor.
pub(super) struct Reader<'a> {
    call: BatchCall,
    batch: &'a DataBatch,
    rows: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(call: BatchCall, batch: &'a DataBatch) -> Result<Self> {
        let rows = batch
            .len()
            .map_err(|e| Error::invalid(format!("{} batch: {e}", call.name())))?;
        Ok(Self { call, batch, rows })
    }

    pub(super) fn fail(&self, what: String) -> Error {
        Error::invalid(format!("{} batch: {what}", self.call.name()))
    }

    pub(super) fn tensor(&self, name: &str) -> Result<&'a TensorData> {
        self.batch.tensors.get(name).ok_or_else(|| {
            let have: Vec<&str> = self.batch.tensors.keys().map(String::as_str).collect();
            self.fail(format!(
                "no tensor '{name}' (it carries: {})",
                if have.is_empty() {
                    "none".into()
                } else {
                    have.join(", ")
                }
            ))
        })
    }

    pub(super) fn mat<T: Elem>(&self, name: &str) -> Result<Mat<T>> {
        let t = self.tensor(name)?;
        let [rows, cols] = t.shape[..] else {
            return Err(self.fail(format!(
                "tensor '{name}' has shape {:?}; a [rows, columns] matrix was expected",
                t.shape
            )));
        };
        if rows != self.rows {
            return Err(self.fail(format!(
                "tensor '{name}' has {rows} rows, not {}",
                self.rows
            )));
        }
        let data = T::from_wire(t).map_err(|e| self.fail(format!("tensor '{name}': {e}")))?;
        Mat::new(rows, cols, data)
    }

    pub(super) fn opt_mat<T: Elem>(&self, name: &str) -> Result<Option<Mat<T>>> {
        if self.batch.tensors.contains_key(name) {
            self.mat(name).map(Some)
        } else {
            Ok(None)
        }
    }

    pub(super) fn vec<T: Elem>(&self, name: &str) -> Result<Vec<T>> {
        let t = self.tensor(name)?;
        if t.shape != [self.rows] {
            return Err(self.fail(format!(
                "tensor '{name}' has shape {:?}, expected [{}]",
                t.shape, self.rows
            )));
        }
        T::from_wire(t).map_err(|e| self.fail(format!("tensor '{name}': {e}")))
    }

    pub(super) fn u64(&self, key: &str) -> Result<u64> {
        match self.batch.meta.get(key) {
            Some(v) => v.as_u64().ok_or_else(|| {
                self.fail(format!(
                    "meta '{key}' must be a non-negative integer, got {v}"
                ))
            }),
            None => Err(self.fail(format!("no meta '{key}'"))),
        }
    }

    pub(super) fn strings(&self, name: &str) -> Result<Vec<String>> {
        self.opt_strings(name)?
            .ok_or_else(|| self.fail(format!("no column '{name}'")))?
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or_else(|| self.fail(format!("column '{name}' row {i} is null"))))
            .collect()
    }

    pub(super) fn opt_strings(&self, name: &str) -> Result<Option<Vec<Option<String>>>> {
        let Some(col) = self.batch.columns.get(name) else {
            return Ok(None);
        };
        col.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(Some(s.clone())),
                Value::Null => Ok(None),
                other => Err(self.fail(format!(
                    "column '{name}' row {i} is {other}, expected a string"
                ))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

pub(super) fn put<T: Elem>(b: &mut DataBatch, name: &str, m: &Mat<T>) -> Result<()> {
    b.tensors
        .insert(name.into(), T::to_wire(m.shape().to_vec(), &m.data)?);
    Ok(())
}

pub(super) fn put_strings<'a>(
    b: &mut DataBatch,
    name: &str,
    v: impl Iterator<Item = Option<&'a String>>,
) {
    b.columns.insert(
        name.into(),
        v.map(|s| s.map_or(Value::Null, |s| json!(s))).collect(),
    );
}
