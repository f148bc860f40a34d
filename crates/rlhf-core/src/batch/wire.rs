//! The byte encoding of a [`DataBatch`]: a prefix, a JSON header and the tensor bytes in
//! name order; streamed in chunks ([`encode_chunks`]) and decoded as the chunks arrive
//! ([`Assembler`]: each byte copied once, into its final buffer, hashed on the way), or viewed
//! in place in a shared-memory region ([`decode_view`]). Split from batch/mod.rs, which holds
//! what a batch is.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rlhf_proto::v1 as pb;
use rlhf_types::Checksum;
use serde::{Deserialize, Serialize};

use super::{DType, DataBatch, SharedRegion, TensorBytes, TensorData};
use crate::{Error, Result};

pub(super) const MAGIC: &[u8; 4] = b"RLHB";
pub(super) const FORMAT_VERSION: u32 = 1;
/// Magic, version and header length.
pub(super) const PREFIX: usize = 16;

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

/// [`encode_header`] and the length of the whole encoding (header and tensor bytes), for
/// senders that write the tensors from where they live.
pub fn encode_header_sized(b: &DataBatch) -> Result<(Vec<u8>, u64)> {
    let head = encode_header(b)?;
    let total = head.len() as u64 + b.tensors.values().map(|t| t.data.len() as u64).sum::<u64>();
    Ok((head, total))
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
    let (head, total) = encode_header_sized(b)?;
    let head = Bytes::from(head);
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
pub(super) struct Decoder {
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
pub(super) const PREFAULT_MIN: usize = 1 << 20;
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
pub(super) fn prefault(ptr: *mut u8, len: usize) -> bool {
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
pub(super) fn prefault(_ptr: *mut u8, _len: usize) -> bool {
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
    pub(super) fn new(total: usize) -> Self {
        Self {
            total,
            seen: 0,
            head: Vec::new(),
            head_end: None,
            body: None,
            hasher: Checksum::new(),
        }
    }

    pub(super) fn feed(&mut self, mut data: &[u8]) -> Result<()> {
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
    pub(super) fn finish(self) -> Result<(DataBatch, u64)> {
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
