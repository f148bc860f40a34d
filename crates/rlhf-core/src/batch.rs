//! `DataBatch`: what role actors exchange — named tensors (row-major, little-endian, first
//! dimension = rows), per-row columns (prompt text, ids) and batch metadata. It splits
//! across ranks (`chunk`), gathers back (`concat`), pads to a divisor and unpads, and has a
//! self-describing byte encoding that is streamed in chunks (gRPC refuses messages over a
//! few MiB by default, and whole batches are often hundreds of MiB).
//!
//! Streaming copies as little as it can: tensor storage is shared ([`TensorBytes`]), so
//! [`encode_chunks`] hands out views of it as chunk data, and the [`Assembler`] copies each
//! received byte once, into its final tensor buffer, hashing it on the way.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use rlhf_proto::v1 as pb;
use serde::{Deserialize, Serialize};

pub use crate::tensor_bytes::{SharedRegion, TensorBytes};
use crate::{Error, Result};

use rlhf_types::Checksum;
pub use rlhf_types::DType;

#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Little-endian, row-major.
    pub data: TensorBytes,
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

const MAGIC: &[u8; 4] = b"RLHB";
const FORMAT_VERSION: u32 = 1;
/// Magic, version and header length.
const PREFIX: usize = 16;

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

/// The prefix and JSON header: everything of the encoding but the tensor bytes, which
/// follow it in name order (`DataBatch::tensors`).
pub fn encode_header(b: &DataBatch) -> Result<Vec<u8>> {
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
    let mut out = Vec::with_capacity(PREFIX + h.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    Ok(out)
}

/// Encoding: "RLHB", u32 version, u64 header length, JSON header, then each tensor's bytes
/// in header order (name order). All integers little-endian.
pub fn encode(b: &DataBatch) -> Result<Vec<u8>> {
    let mut out = encode_header(b)?;
    out.reserve_exact(b.tensors.values().map(|t| t.data.len()).sum());
    for t in b.tensors.values() {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// Encodes straight into stream chunks of `chunk_bytes` (the last one shorter). A chunk
/// that lies inside one tensor is a zero-copy view of that tensor's storage; only chunks
/// that straddle the header or a tensor boundary are copied. Same bytes as
/// `to_chunks(encode(b)?, chunk_bytes)`, without the two whole-batch copies.
pub fn encode_chunks(b: &DataBatch, chunk_bytes: usize) -> Result<Vec<pb::BatchChunk>> {
    let head = Bytes::from(encode_header(b)?);
    let total = head.len() as u64 + b.tensors.values().map(|t| t.data.len() as u64).sum::<u64>();
    let segments = std::iter::once(head).chain(b.tensors.values().map(|t| t.data.to_bytes()));
    Ok(chunk_segments(segments, total, chunk_bytes))
}

/// Cuts the concatenation of `segments` (`total` bytes) into chunks of `chunk_bytes`.
fn chunk_segments(
    segments: impl Iterator<Item = Bytes>,
    total: u64,
    chunk_bytes: usize,
) -> Vec<pb::BatchChunk> {
    let size = chunk_bytes.max(1);
    let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0).div_ceil(size).max(1));
    let mut segments = segments.filter(|s| !s.is_empty());
    let mut cur = Bytes::new();
    loop {
        if cur.is_empty() {
            match segments.next() {
                Some(s) => cur = s,
                None => break,
            }
        }
        let data = if cur.len() >= size {
            cur.split_to(size)
        } else {
            // Straddles a boundary: gather the pieces into one buffer.
            let mut buf = BytesMut::with_capacity(size);
            buf.extend_from_slice(&cur);
            cur = Bytes::new();
            while buf.len() < size {
                let Some(mut s) = segments.next() else { break };
                let take = (size - buf.len()).min(s.len());
                buf.extend_from_slice(&s.split_to(take));
                cur = s;
            }
            buf.freeze()
        };
        out.push(pb::BatchChunk {
            data,
            total_bytes: total,
            index: out.len() as u32,
            shared: None,
        });
    }
    if out.is_empty() {
        out.push(pb::BatchChunk {
            data: Bytes::new(),
            total_bytes: 0,
            index: 0,
            shared: None,
        });
    }
    out
}

fn corrupt(why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("malformed batch encoding: {why}"))
}

pub fn decode(bytes: &[u8]) -> Result<DataBatch> {
    let mut d = Decoder::new(bytes.len());
    d.feed(bytes)?;
    d.finish().map(|(b, _)| b)
}

/// Decodes a batch from pieces as they arrive: the header is parsed as soon as it is
/// complete, then every piece is copied once, straight into its tensor's final buffer,
/// and hashed while it is still in cache.
struct Decoder {
    total: usize,
    seen: usize,
    head: Vec<u8>,
    /// Prefix plus header length, once the prefix has arrived.
    head_end: Option<usize>,
    body: Option<Body>,
    hasher: Checksum,
}

struct Body {
    tensors: Vec<PendingTensor>,
    columns: BTreeMap<String, Vec<serde_json::Value>>,
    meta: BTreeMap<String, serde_json::Value>,
    /// The tensor the next byte belongs to.
    cur: usize,
    /// Header order is name order, so the running hash equals `checksum` of the result.
    sorted: bool,
}

struct PendingTensor {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
    data: Vec<u8>,
    /// Bytes of `data`'s capacity already mapped in by `prefault`.
    prefaulted: usize,
}

/// Tensors this big get their memory mapped in ahead of the copy, this many bytes at a
/// time: one madvise call maps a window far cheaper than one page fault per 4 KiB page,
/// which otherwise is the largest single cost of receiving a batch.
const PREFAULT_MIN: usize = 1 << 20;
const PREFAULT_STEP: usize = 4 << 20;

impl PendingTensor {
    /// Maps in the capacity the next `n` bytes will be copied to, a window at a time.
    fn prefault_for(&mut self, n: usize) {
        let need = self.data.len() + n;
        if self.len < PREFAULT_MIN || need <= self.prefaulted {
            return;
        }
        let from = self.prefaulted.max(self.data.len());
        let to = (from + PREFAULT_STEP).max(need).min(self.len);
        let base = self.data.as_mut_ptr().wrapping_add(from);
        // On failure (old kernel, other OS) let page faults do the work from here on.
        self.prefaulted = if prefault(base, to - from) {
            to
        } else {
            self.len
        };
    }
}

#[cfg(target_os = "linux")]
fn prefault(ptr: *mut u8, len: usize) -> bool {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let page = *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p).unwrap_or(0).max(1)
    });
    let start = (ptr as usize).next_multiple_of(page);
    let end = (ptr as usize + len) / page * page;
    if end <= start {
        return true;
    }
    // SAFETY: [start, end) lies inside the spare capacity of a Vec the caller owns and
    // keeps alive across the call. MADV_POPULATE_WRITE only maps pages in (zero-filled
    // where new) without reading or writing anything Rust considers initialized.
    unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn prefault(_ptr: *mut u8, _len: usize) -> bool {
    false
}

/// Pieces are hashed this many bytes at a time, right after their copy, while in cache.
const HASH_STEP: usize = 64 << 10;

/// Where the JSON header ends, from the 16-byte prefix of a `total`-byte encoding.
fn header_end(p: &[u8], total: usize) -> Result<usize> {
    if p.len() < PREFIX || &p[..4] != MAGIC {
        return Err(corrupt("missing RLHB header"));
    }
    let version = u32::from_le_bytes([p[4], p[5], p[6], p[7]]);
    if version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "format version {version}, this build reads {FORMAT_VERSION}"
        )));
    }
    let hlen = u64::from_le_bytes([p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]]);
    usize::try_from(hlen)
        .ok()
        .and_then(|h| PREFIX.checked_add(h))
        .filter(|&e| e <= total)
        .ok_or_else(|| {
            corrupt(format!(
                "header length {hlen} runs past the end of a {total}-byte batch"
            ))
        })
}

/// Decodes the encoding that fills `region` from byte `offset` to its end without copying a
/// tensor byte: every tensor of the result is a view of the region (a sealed shared-memory
/// batch, mapped), which it keeps alive. The header is checked as the streamed decoder
/// checks it.
pub fn decode_view(region: Arc<dyn SharedRegion>, offset: usize) -> Result<DataBatch> {
    let bytes = region
        .bytes()
        .get(offset..)
        .ok_or_else(|| corrupt(format!("starts at byte {offset}, past the end")))?;
    let total = bytes.len();
    let end = header_end(bytes, total)?;
    let header: Header = serde_json::from_slice(&bytes[PREFIX..end]).map_err(corrupt)?;
    let body = Body::new(header, total - end)?;
    let mut out = DataBatch {
        columns: body.columns,
        meta: body.meta,
        ..Default::default()
    };
    let mut at = offset + end;
    for t in body.tensors {
        let data = TensorBytes::view(region.clone(), at..at + t.len)
            .ok_or_else(|| corrupt(format!("tensor '{}' runs past the end", t.name)))?;
        at += t.len;
        out.tensors.insert(
            t.name,
            TensorData {
                dtype: t.dtype,
                shape: t.shape,
                data,
            },
        );
    }
    out.len()?;
    Ok(out)
}

impl Decoder {
    fn new(total: usize) -> Self {
        Self {
            total,
            seen: 0,
            head: Vec::new(),
            head_end: None,
            body: None,
            hasher: Checksum::new(),
        }
    }

    fn feed(&mut self, mut data: &[u8]) -> Result<()> {
        if data.len() > self.total - self.seen {
            return Err(corrupt(format!(
                "more bytes than the {} announced",
                self.total
            )));
        }
        self.seen += data.len();
        while self.body.is_none() && !data.is_empty() {
            let want = self.head_end.unwrap_or(PREFIX);
            let take = (want - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
            self.parse_head()?;
        }
        if data.is_empty() {
            return Ok(());
        }
        let Some(body) = &mut self.body else {
            return Err(corrupt("tensor bytes before the header"));
        };
        while !data.is_empty() {
            let Some(t) = body.tensors.get_mut(body.cur) else {
                return Err(corrupt(format!("{} trailing bytes", data.len())));
            };
            let take = (t.len - t.data.len()).min(data.len());
            for piece in data[..take].chunks(HASH_STEP) {
                t.prefault_for(piece.len());
                t.data.extend_from_slice(piece);
                self.hasher.update(piece);
            }
            data = &data[take..];
            body.skip_full(&mut self.hasher);
        }
        Ok(())
    }

    fn parse_head(&mut self) -> Result<()> {
        if self.head_end.is_none() && self.head.len() == PREFIX {
            let end = header_end(&self.head, self.total)?;
            self.head.reserve_exact(end - PREFIX);
            self.head_end = Some(end);
        }
        if self.head_end == Some(self.head.len()) {
            let header: Header = serde_json::from_slice(&self.head[PREFIX..]).map_err(corrupt)?;
            let mut body = Body::new(header, self.total - self.head.len())?;
            for t in &mut body.tensors {
                t.data.reserve_exact(t.len);
            }
            body.skip_full(&mut self.hasher);
            self.body = Some(body);
            self.head = Vec::new();
        }
        Ok(())
    }

    /// The batch and its `checksum`.
    fn finish(self) -> Result<(DataBatch, u64)> {
        if self.seen != self.total {
            return Err(corrupt(format!(
                "stream ended after {} of {} bytes",
                self.seen, self.total
            )));
        }
        let Some(body) = self.body else {
            return Err(corrupt("missing RLHB header"));
        };
        if let Some(t) = body.tensors.get(body.cur) {
            return Err(corrupt(format!("tensor '{}' runs past the end", t.name)));
        }
        let mut out = DataBatch {
            columns: body.columns,
            meta: body.meta,
            ..Default::default()
        };
        for t in body.tensors {
            out.tensors.insert(
                t.name,
                TensorData {
                    dtype: t.dtype,
                    shape: t.shape,
                    data: t.data.into(),
                },
            );
        }
        out.len()?;
        let sum = if body.sorted {
            self.hasher.finish()
        } else {
            checksum(&out)
        };
        Ok((out, sum))
    }
}

impl Body {
    /// Checks the header against itself and against the bytes that follow it, before any
    /// tensor buffer is allocated (so a corrupt length cannot ask for terabytes).
    fn new(h: Header, body_bytes: usize) -> Result<Self> {
        let mut tensors = Vec::with_capacity(h.tensors.len());
        let mut sum = 0usize;
        let mut sorted = true;
        for t in h.tensors {
            let want = t
                .shape
                .iter()
                .try_fold(t.dtype.size(), |a, &d| a.checked_mul(d));
            if want != Some(t.len) {
                return Err(corrupt(format!(
                    "tensor '{}' of shape {:?} and dtype {:?} needs {} bytes, the header says {}",
                    t.name,
                    t.shape,
                    t.dtype,
                    want.map_or_else(|| "more than usize::MAX".to_string(), |w| w.to_string()),
                    t.len
                )));
            }
            if tensors.iter().any(|p: &PendingTensor| p.name == t.name) {
                return Err(corrupt(format!("tensor '{}' appears twice", t.name)));
            }
            if let Some(prev) = tensors.last() {
                sorted &= prev.name < t.name;
            }
            sum = sum
                .checked_add(t.len)
                .filter(|&s| s <= body_bytes)
                .ok_or_else(|| {
                    corrupt(format!(
                        "tensor '{}' runs past the end: the header describes more than the {body_bytes} bytes that follow it",
                        t.name
                    ))
                })?;
            tensors.push(PendingTensor {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                len: t.len,
                data: Vec::new(),
                prefaulted: 0,
            });
        }
        if sum != body_bytes {
            return Err(corrupt(format!(
                "{} trailing bytes after the {sum} bytes of tensors the header describes",
                body_bytes - sum
            )));
        }
        Ok(Self {
            tensors,
            columns: h.columns,
            meta: h.meta,
            cur: 0,
            sorted,
        })
    }

    fn skip_full(&mut self, hasher: &mut Checksum) {
        while let Some(t) = self.tensors.get(self.cur) {
            if t.data.len() < t.len {
                break;
            }
            // The length closes each tensor: bytes moved across a boundary change the sum.
            hasher.update_u64(t.len as u64);
            self.cur += 1;
        }
    }
}

/// A 64-bit hash over every tensor's bytes and length in name order, to check a transfer
/// end to end (not a cryptographic digest). `Assembler::finish_with_checksum` computes
/// the same value while receiving.
pub fn checksum(b: &DataBatch) -> u64 {
    let mut h = Checksum::new();
    for t in b.tensors.values() {
        h.update(&t.data);
        h.update_u64(t.data.len() as u64);
    }
    h.finish()
}

/// Default chunk size for streaming: well under gRPC's 4 MiB default message limit.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Splits an encoded batch into stream messages (zero-copy views of `bytes`).
pub fn to_chunks(bytes: Vec<u8>, chunk_bytes: usize) -> Vec<pb::BatchChunk> {
    let total = bytes.len() as u64;
    chunk_segments(std::iter::once(Bytes::from(bytes)), total, chunk_bytes)
}

/// Reassembles a streamed batch, refusing out-of-order chunks and anything above
/// `max_bytes`. Each chunk is decoded as it arrives: its bytes are copied once, into the
/// final tensor buffers, and hashed on the way.
pub struct Assembler {
    dec: Option<Decoder>,
    next: u32,
    max_bytes: u64,
}

impl Assembler {
    pub fn new(max_bytes: u64) -> Self {
        Self {
            dec: None,
            next: 0,
            max_bytes,
        }
    }

    pub fn push(&mut self, c: pb::BatchChunk) -> Result<()> {
        if c.shared.is_some() {
            return Err(corrupt(format!(
                "chunk {} points at shared memory inside a streamed batch",
                c.index
            )));
        }
        if c.index != self.next {
            return Err(corrupt(format!(
                "chunk {} arrived, expected {}",
                c.index, self.next
            )));
        }
        let dec = match &mut self.dec {
            Some(d) => {
                if d.total as u64 != c.total_bytes {
                    return Err(corrupt(format!(
                        "chunk {} says {} total bytes, chunk 0 said {}",
                        c.index, c.total_bytes, d.total
                    )));
                }
                d
            }
            None => {
                if c.total_bytes > self.max_bytes {
                    return Err(Error::invalid(format!(
                        "batch of {} bytes is over the {} byte limit",
                        c.total_bytes, self.max_bytes
                    )));
                }
                let total = usize::try_from(c.total_bytes).map_err(|_| {
                    Error::invalid(format!(
                        "batch of {} bytes does not fit in this machine's memory",
                        c.total_bytes
                    ))
                })?;
                self.dec.insert(Decoder::new(total))
            }
        };
        dec.feed(&c.data)
            .map_err(|e| Error::invalid(format!("{e} (in chunk {})", c.index)))?;
        self.next += 1;
        Ok(())
    }

    /// Bytes received so far.
    pub fn received_bytes(&self) -> u64 {
        self.dec.as_ref().map_or(0, |d| d.seen as u64)
    }

    pub fn finish(self) -> Result<DataBatch> {
        self.finish_with_checksum().map(|(b, _)| b)
    }

    /// The batch and its `checksum`, computed while the chunks arrived (no extra pass).
    pub fn finish_with_checksum(self) -> Result<(DataBatch, u64)> {
        let dec = self.dec.ok_or_else(|| corrupt("empty stream"))?;
        dec.finish()
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

    /// Odd byte counts everywhere: a U8 tensor of 7x13, an f32 tensor, an empty tensor and
    /// a column, so chunk boundaries fall inside the header, inside tensors and on edges.
    fn odd_batch() -> DataBatch {
        let u: Vec<u8> = (0..91u32).map(|i| (i * 37 % 251) as u8).collect();
        let f: Vec<f32> = (0..7 * 5).map(|i| i as f32 - 3.25).collect();
        DataBatch::new()
            .with_tensor(
                "a_bytes",
                TensorData::new(DType::U8, vec![7, 13], u).unwrap(),
            )
            .with_tensor("b_vals", TensorData::from_f32(vec![7, 5], &f).unwrap())
            .with_tensor(
                "c_empty",
                TensorData::new(DType::I64, vec![7, 0], Vec::new()).unwrap(),
            )
            .with_column("id", (0..7).map(|i| json!(i)).collect())
    }

    fn assemble(chunks: Vec<pb::BatchChunk>, max: u64) -> Result<(DataBatch, u64)> {
        let mut a = Assembler::new(max);
        for c in chunks {
            a.push(c)?;
        }
        a.finish_with_checksum()
    }

    #[test]
    fn zero_copy_chunks_round_trip_at_every_size() {
        let b = odd_batch();
        let whole = encode(&b).unwrap();
        for size in [
            1,
            2,
            7,
            16,
            31,
            100,
            333,
            whole.len() - 1,
            whole.len(),
            1 << 20,
        ] {
            let chunks = encode_chunks(&b, size).unwrap();
            assert_eq!(chunks.len(), whole.len().div_ceil(size), "size {size}");
            let joined: Vec<u8> = chunks.iter().flat_map(|c| c.data.to_vec()).collect();
            assert_eq!(joined, whole, "size {size}");
            assert!(chunks.iter().all(|c| c.total_bytes == whole.len() as u64));
            let (got, sum) = assemble(chunks, 1 << 20).unwrap();
            assert_eq!(got, b, "size {size}");
            assert_eq!(sum, checksum(&b), "size {size}");
            // The old path gives the same chunks.
            let old: Vec<Vec<u8>> = to_chunks(whole.clone(), size)
                .into_iter()
                .map(|c| c.data.to_vec())
                .collect();
            let new: Vec<Vec<u8>> = encode_chunks(&b, size)
                .unwrap()
                .into_iter()
                .map(|c| c.data.to_vec())
                .collect();
            assert_eq!(old, new, "size {size}");
        }
    }

    #[test]
    fn chunks_inside_a_tensor_share_its_storage() {
        let data: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let b =
            DataBatch::new().with_tensor("v", TensorData::from_f32(vec![64, 64], &data).unwrap());
        let t = &b.tensors["v"].data;
        let range = t.as_ptr() as usize..t.as_ptr() as usize + t.len();
        let chunks = encode_chunks(&b, 1000).unwrap();
        let inside = chunks
            .iter()
            .filter(|c| range.contains(&(c.data.as_ptr() as usize)))
            .count();
        // All but the chunk that carries the header (and the tail it copies) are views.
        assert!(inside >= chunks.len() - 2, "{inside} of {}", chunks.len());
        // Writing to the batch afterwards leaves the chunks as they were (copy-on-write).
        let mut c = b.clone();
        c.tensors.get_mut("v").unwrap().data[40_00] ^= 0xff;
        assert_eq!(assemble(chunks, 1 << 20).unwrap().0, b);
        assert_ne!(c, b);
    }

    #[test]
    fn large_tensors_round_trip_through_prefaulted_buffers() {
        // Over PREFAULT_MIN and not a multiple of the prefault window or the page size.
        let n = (9 << 20) / 4 + 3;
        let v: Vec<f32> = (0..n).map(|i| (i % 7919) as f32 * 0.25).collect();
        let b = DataBatch::new()
            .with_tensor("big", TensorData::from_f32(vec![1, n], &v).unwrap())
            .with_tensor(
                "small",
                TensorData::new(DType::U8, vec![1, 5], vec![9; 5]).unwrap(),
            );
        for size in [CHUNK_BYTES, (1 << 20) + 7, 333_333] {
            let (got, sum) = assemble(encode_chunks(&b, size).unwrap(), 1 << 30).unwrap();
            assert_eq!(got.tensors["big"].to_f32().unwrap(), v, "chunks of {size}");
            assert_eq!(got, b);
            assert_eq!(sum, checksum(&b));
        }
    }

    #[test]
    fn random_batches_round_trip_at_random_chunk_sizes() {
        // A small xorshift generator: deterministic, no dependency.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let dtypes = [DType::F32, DType::F64, DType::BF16, DType::I64, DType::U8];
        for case in 0..60 {
            let rows = next(9);
            let mut b = DataBatch::new();
            for k in 0..next(4) {
                let dtype = dtypes[next(dtypes.len())];
                let shape = vec![rows, next(40), 1 + next(3)];
                let len = shape.iter().product::<usize>() * dtype.size();
                let data = (0..len).map(|_| next(256) as u8).collect();
                b = b.with_tensor(
                    &format!("t{k}"),
                    TensorData::new(dtype, shape, data).unwrap(),
                );
            }
            if next(2) == 0 {
                b = b.with_column("c", (0..rows).map(|i| json!(i)).collect());
            }
            let whole = encode(&b).unwrap();
            let size = 1 + next(whole.len() + 10);
            let chunks = encode_chunks(&b, size).unwrap();
            let joined: Vec<u8> = chunks.iter().flat_map(|c| c.data.to_vec()).collect();
            assert_eq!(joined, whole, "case {case}");
            let (got, sum) = assemble(chunks, 1 << 20).unwrap();
            assert_eq!((got, sum), (b.clone(), checksum(&b)), "case {case}");
        }
    }

    #[test]
    fn streamed_checksum_matches_for_any_split() {
        let b = odd_batch();
        let whole = encode(&b).unwrap();
        for piece in [1, 3, 32, 33, 64, 1000] {
            let mut d = Decoder::new(whole.len());
            for p in whole.chunks(piece) {
                d.feed(p).unwrap();
            }
            let (got, sum) = d.finish().unwrap();
            assert_eq!((got, sum), (b.clone(), checksum(&b)), "pieces of {piece}");
        }
        // A byte moved from the end of one tensor to the start of the next changes the sum.
        let x = DataBatch::new()
            .with_tensor(
                "a",
                TensorData::new(DType::U8, vec![3], vec![1, 2, 3]).unwrap(),
            )
            .with_tensor("b", TensorData::new(DType::U8, vec![1], vec![4]).unwrap());
        let y = DataBatch::new()
            .with_tensor(
                "a",
                TensorData::new(DType::U8, vec![2], vec![1, 2]).unwrap(),
            )
            .with_tensor(
                "b",
                TensorData::new(DType::U8, vec![2], vec![3, 4]).unwrap(),
            );
        assert_ne!(checksum(&x), checksum(&y));
    }

    #[test]
    fn missing_corrupt_and_mismatched_chunks_are_clear_errors() {
        let b = odd_batch();
        let chunks = encode_chunks(&b, 50).unwrap();
        assert!(chunks.len() > 4);
        // A missing chunk.
        let mut gap = chunks.clone();
        gap.remove(2);
        let e = assemble(gap, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("chunk 3 arrived, expected 2"), "{e}");
        // A lost last chunk.
        let mut short = chunks.clone();
        short.pop();
        let e = assemble(short, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("stream ended after"), "{e}");
        // Chunks that disagree on the total.
        let mut odd = chunks.clone();
        odd[3].total_bytes += 1;
        let e = assemble(odd, 1 << 20).unwrap_err().to_string();
        assert!(
            e.contains("chunk 3 says") && e.contains("chunk 0 said"),
            "{e}"
        );
        // A total that does not match what the header describes, both ways.
        for delta in [-8i64, 8] {
            let mut wrong = chunks.clone();
            for c in &mut wrong {
                c.total_bytes = (c.total_bytes as i64 + delta) as u64;
            }
            let e = assemble(wrong, 1 << 20).unwrap_err().to_string();
            assert!(e.contains("malformed batch encoding"), "{e}");
        }
        // A chunk with more bytes than announced.
        let mut big = chunks.clone();
        let last = big.len() - 1;
        let mut extra = big[last].data.to_vec();
        extra.extend_from_slice(&[0; 9]);
        big[last].data = extra.into();
        let e = assemble(big, 1 << 20).unwrap_err().to_string();
        assert!(
            e.contains("more bytes than the") && e.contains(&format!("chunk {last}")),
            "{e}"
        );
        // A corrupted header: wrong magic, and a broken JSON byte.
        let mut bad = chunks.clone();
        let mut d = bad[0].data.to_vec();
        d[1] = b'X';
        bad[0].data = d.into();
        let e = assemble(bad, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("missing RLHB header"), "{e}");
        let mut bad = chunks.clone();
        let mut d = bad[0].data.to_vec();
        d[PREFIX] = b'#';
        bad[0].data = d.into();
        assert!(assemble(bad, 1 << 20).is_err());
        // A flipped bit in tensor bytes decodes, and the checksum says so.
        let mut bad = chunks.clone();
        let mut d = bad[last].data.to_vec();
        d[0] ^= 4;
        bad[last].data = d.into();
        let (got, sum) = assemble(bad, 1 << 20).unwrap();
        assert_ne!(got, b);
        assert_ne!(sum, checksum(&b));
        assert_eq!(sum, checksum(&got));
    }

    /// Hand-made encoding with a chosen header.
    fn raw(header: serde_json::Value, body: &[u8]) -> Vec<u8> {
        let h = serde_json::to_vec(&header).unwrap();
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(h.len() as u64).to_le_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn headers_that_lie_are_refused_before_allocating() {
        let t = |name: &str, shape: serde_json::Value, len: u64| json!({"name": name, "dtype": "u8", "shape": shape, "len": len});
        let h = |ts: Vec<serde_json::Value>| json!({"tensors": ts, "columns": {}, "meta": {}});
        // Length that disagrees with the shape names the tensor.
        let e = decode(&raw(h(vec![t("x", json!([4]), 3)]), &[0; 3]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor 'x'") && e.contains("needs 4 bytes"),
            "{e}"
        );
        // A terabyte tensor in a tiny stream fails on the header, not on allocation.
        let e = decode(&raw(h(vec![t("x", json!([1u64 << 40]), 1 << 40)]), &[0; 8]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor 'x' runs past the end"), "{e}");
        // Shapes whose product overflows.
        let e = decode(&raw(h(vec![t("x", json!([u64::MAX, 4]), 4)]), &[0; 4]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than usize::MAX"), "{e}");
        // Trailing bytes after the tensors.
        let e = decode(&raw(h(vec![t("x", json!([2]), 2)]), &[0; 5]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 trailing bytes"), "{e}");
        // The same name twice.
        let e = decode(&raw(
            h(vec![t("x", json!([1]), 1), t("x", json!([1]), 1)]),
            &[0; 2],
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("'x' appears twice"), "{e}");
        // A header length past the end.
        let mut bytes = raw(h(vec![]), &[]);
        bytes[8] = 0xff;
        let e = decode(&bytes).unwrap_err().to_string();
        assert!(e.contains("runs past the end of a"), "{e}");
        // Tensors out of name order still decode, and the checksum is still `checksum`.
        let bytes = raw(
            h(vec![t("b", json!([1, 2]), 2), t("a", json!([1]), 1)]),
            &[1, 2, 3],
        );
        let mut a = Assembler::new(1 << 20);
        for c in to_chunks(bytes, 4) {
            a.push(c).unwrap();
        }
        let (got, sum) = a.finish_with_checksum().unwrap();
        assert_eq!(*got.tensors["b"].data, vec![1, 2]);
        assert_eq!(*got.tensors["a"].data, vec![3]);
        assert_eq!(sum, checksum(&got));
    }
}
