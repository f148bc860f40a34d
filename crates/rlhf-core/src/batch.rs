//! `DataBatch`: what role actors exchange — named tensors (row-major, little-endian, first
//! dimension = rows), per-row columns (prompt text, ids) and batch metadata. It splits
//! across ranks (`chunk`), gathers back (`concat`), pads to a divisor and unpads, and has a
//! self-describing byte encoding that is streamed in chunks (gRPC refuses messages over a
//! few MiB by default, and whole batches are often hundreds of MiB).

use std::collections::BTreeMap;

use rlhf_proto::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    U32,
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Little-endian, row-major.
    pub data: Vec<u8>,
}

impl TensorData {
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let want = shape.iter().product::<usize>() * dtype.size();
        if data.len() != want {
            return Err(Error::invalid(format!(
                "tensor of shape {shape:?} and dtype {dtype:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(Self { dtype, shape, data })
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
        Ok(self
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
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

    fn row_bytes(&self) -> usize {
        self.shape.iter().skip(1).product::<usize>() * self.dtype.size()
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
            data: self.data[start * rb..end * rb].to_vec(),
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
            data,
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
                    data,
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

const MAGIC: &[u8; 4] = b"RLHB";
const FORMAT_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Header {
    tensors: Vec<TensorHeader>,
    columns: BTreeMap<String, Vec<serde_json::Value>>,
    meta: BTreeMap<String, serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
struct TensorHeader {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
}

/// Encoding: "RLHB", u32 version, u64 header length, JSON header, then each tensor's bytes
/// in header order. All integers little-endian.
pub fn encode(b: &DataBatch) -> Result<Vec<u8>> {
    b.len()?;
    let header = Header {
        tensors: b
            .tensors
            .iter()
            .map(|(k, t)| TensorHeader {
                name: k.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: t.data.len(),
            })
            .collect(),
        columns: b.columns.clone(),
        meta: b.meta.clone(),
    };
    let h = serde_json::to_vec(&header)
        .map_err(|e| Error::internal(format!("encoding batch header: {e}")))?;
    let total: usize = 16 + h.len() + b.tensors.values().map(|t| t.data.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in b.tensors.values() {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

fn corrupt(why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("malformed batch encoding: {why}"))
}

pub fn decode(bytes: &[u8]) -> Result<DataBatch> {
    if bytes.len() < 16 || &bytes[..4] != MAGIC {
        return Err(corrupt("missing RLHB header"));
    }
    let version = u32::from_le_bytes(bytes[4..8].try_into().map_err(corrupt)?);
    if version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "format version {version}, this build reads {FORMAT_VERSION}"
        )));
    }
    let hlen = u64::from_le_bytes(bytes[8..16].try_into().map_err(corrupt)?) as usize;
    let hend = 16usize
        .checked_add(hlen)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| corrupt("header length past the end"))?;
    let header: Header = serde_json::from_slice(&bytes[16..hend]).map_err(corrupt)?;
    let mut pos = hend;
    let mut out = DataBatch {
        columns: header.columns,
        meta: header.meta,
        ..Default::default()
    };
    for t in header.tensors {
        let end = pos
            .checked_add(t.len)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| corrupt(format!("tensor '{}' runs past the end", t.name)))?;
        let td = TensorData::new(t.dtype, t.shape, bytes[pos..end].to_vec())
            .map_err(|e| corrupt(format!("tensor '{}': {e}", t.name)))?;
        out.tensors.insert(t.name, td);
        pos = end;
    }
    if pos != bytes.len() {
        return Err(corrupt(format!("{} trailing bytes", bytes.len() - pos)));
    }
    out.len()?;
    Ok(out)
}

/// An FNV-1a-style 64-bit hash over every tensor's bytes in name order, eight bytes per
/// step (a byte-wise loop would cost more than the transfer it checks).
pub fn checksum(b: &DataBatch) -> u64 {
    const PRIME: u64 = 0x0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in b.tensors.values() {
        let words = t.data.chunks_exact(8);
        let tail = words.remainder();
        for w in words {
            h ^= u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            h = h.wrapping_mul(PRIME);
        }
        for &x in tail {
            h ^= u64::from(x);
            h = h.wrapping_mul(PRIME);
        }
        h ^= t.data.len() as u64;
        h = h.wrapping_mul(PRIME);
    }
    h
}

/// Default chunk size for streaming: well under gRPC's 4 MiB default message limit.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Splits an encoded batch into stream messages.
pub fn to_chunks(bytes: Vec<u8>, chunk_bytes: usize) -> Vec<pb::BatchChunk> {
    let total = bytes.len() as u64;
    if bytes.is_empty() {
        return vec![pb::BatchChunk {
            data: Vec::new(),
            total_bytes: 0,
            index: 0,
        }];
    }
    bytes
        .chunks(chunk_bytes.max(1))
        .enumerate()
        .map(|(i, c)| pb::BatchChunk {
            data: c.to_vec(),
            total_bytes: total,
            index: i as u32,
        })
        .collect()
}

/// Reassembles a streamed batch, refusing out-of-order chunks and anything above `max_bytes`.
pub struct Assembler {
    buf: Vec<u8>,
    total: Option<u64>,
    next: u32,
    max_bytes: u64,
}

impl Assembler {
    pub fn new(max_bytes: u64) -> Self {
        Self {
            buf: Vec::new(),
            total: None,
            next: 0,
            max_bytes,
        }
    }

    pub fn push(&mut self, c: pb::BatchChunk) -> Result<()> {
        if c.index != self.next {
            return Err(corrupt(format!(
                "chunk {} arrived, expected {}",
                c.index, self.next
            )));
        }
        match self.total {
            None => {
                if c.total_bytes > self.max_bytes {
                    return Err(Error::invalid(format!(
                        "batch of {} bytes is over the {} byte limit",
                        c.total_bytes, self.max_bytes
                    )));
                }
                self.total = Some(c.total_bytes);
                self.buf.reserve(c.total_bytes as usize);
            }
            Some(t) if t != c.total_bytes => {
                return Err(corrupt(format!(
                    "chunk {} says {} total bytes, chunk 0 said {t}",
                    c.index, c.total_bytes
                )))
            }
            _ => {}
        }
        if (self.buf.len() + c.data.len()) as u64 > self.total.unwrap_or(0) {
            return Err(corrupt("more bytes than announced"));
        }
        self.buf.extend_from_slice(&c.data);
        self.next += 1;
        Ok(())
    }

    pub fn finish(self) -> Result<DataBatch> {
        let total = self.total.ok_or_else(|| corrupt("empty stream"))?;
        if self.buf.len() as u64 != total {
            return Err(corrupt(format!(
                "stream ended after {} of {total} bytes",
                self.buf.len()
            )));
        }
        decode(&self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(rows: usize) -> DataBatch {
        let ids: Vec<i64> = (0..rows as i64 * 3).collect();
        let lp: Vec<f32> = (0..rows * 3).map(|i| i as f32 * 0.5).collect();
        DataBatch::new()
            .with_tensor(
                "input_ids",
                TensorData::from_i64(vec![rows, 3], &ids).unwrap(),
            )
            .with_tensor(
                "logprobs",
                TensorData::from_f32(vec![rows, 3], &lp).unwrap(),
            )
            .with_column(
                "prompt",
                (0..rows).map(|i| json!(format!("p{i}"))).collect(),
            )
    }

    #[test]
    fn chunk_then_concat_is_identity() {
        let b = sample(7);
        let parts = b.chunk(3).unwrap();
        let sizes: Vec<usize> = parts.iter().map(|p| p.len().unwrap()).collect();
        assert_eq!(sizes, vec![3, 2, 2]);
        assert_eq!(parts[1].columns["prompt"][0], json!("p3"));
        assert_eq!(parts[1].tensors["input_ids"].to_i64().unwrap()[0], 9);
        assert_eq!(DataBatch::concat(&parts).unwrap(), b);
    }

    #[test]
    fn pad_and_unpad() {
        let b = sample(5);
        let (p, pad) = b.pad_to_multiple(4).unwrap();
        assert_eq!((p.len().unwrap(), pad), (8, 3));
        assert_eq!(p.columns["prompt"][5], json!("p0"));
        assert_eq!(p.unpad(pad).unwrap(), b);
        assert_eq!(b.pad_to_multiple(5).unwrap().1, 0);
    }

    #[test]
    fn inconsistent_rows_name_the_culprits() {
        let mut b = sample(4);
        b.columns.insert("extra".into(), vec![json!(1)]);
        let e = b.len().unwrap_err().to_string();
        assert!(e.contains("'extra' has 1"), "{e}");
        let e = TensorData::from_f32(vec![2, 2], &[1.0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs 16 bytes, got 4"), "{e}");
        let a = sample(2);
        let mut c = sample(2);
        c.tensors.insert(
            "logprobs".into(),
            TensorData::from_f32(vec![2, 4], &[0.0; 8]).unwrap(),
        );
        let e = DataBatch::concat(&[a, c]).unwrap_err().to_string();
        assert!(e.contains("'logprobs'") && e.contains("[2, 4]"), "{e}");
    }

    #[test]
    fn encode_decode_and_stream_round_trip() {
        let mut b = sample(9);
        b.meta.insert("step".into(), json!(3));
        let bytes = encode(&b).unwrap();
        assert_eq!(decode(&bytes).unwrap(), b);
        let chunks = to_chunks(bytes.clone(), 100);
        assert!(chunks.len() > 3);
        let mut a = Assembler::new(1 << 20);
        for c in chunks.clone() {
            a.push(c).unwrap();
        }
        assert_eq!(a.finish().unwrap(), b);
        // Out of order, truncated, over the limit, corrupted: errors, never panics.
        let mut a = Assembler::new(1 << 20);
        assert!(a
            .push(chunks[1].clone())
            .unwrap_err()
            .to_string()
            .contains("expected 0"));
        let mut a = Assembler::new(1 << 20);
        a.push(chunks[0].clone()).unwrap();
        assert!(a
            .finish()
            .unwrap_err()
            .to_string()
            .contains("stream ended after"));
        let mut a = Assembler::new(10);
        assert!(a
            .push(chunks[0].clone())
            .unwrap_err()
            .to_string()
            .contains("over the 10 byte limit"));
        for cut in [0, 3, 15, 40, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err());
        }
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(decode(&bad).is_err());
        // The checksum sees a single flipped bit, in the body or in the tail.
        let mut c = b.clone();
        let sum = checksum(&b);
        c.tensors.get_mut("logprobs").unwrap().data[5] ^= 1;
        assert_ne!(checksum(&c), sum);
        let mut c = b.clone();
        let d = &mut c.tensors.get_mut("input_ids").unwrap().data;
        let last = d.len() - 1;
        d[last] ^= 0x80;
        assert_ne!(checksum(&c), sum);
    }
}
