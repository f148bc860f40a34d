//! Bucketed trainer → rollout weight sync (its checksum: `checksum.rs`).
//!
//! Both sides list the same parameters in the same order (names, dtypes, shapes).
//! A sync first checks that the lists agree on every rank (one 16-byte all-gather of
//! a manifest digest; on disagreement a second all-gather of the full manifests
//! names the first differing parameter on every rank), then streams the
//! concatenated parameter bytes as buckets of at most `bucket_bytes`, one
//! broadcast per bucket. A parameter larger than a bucket spans several buckets;
//! many tiny parameters share one. Backends that can send from several slices
//! (TCP) do so without copying into a staging buffer.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{Error, Op, Result};
use crate::{as_bytes, as_bytes_mut, Communicator};
use rlhf_types::Checksum;
pub use rlhf_types::DType;

pub(crate) fn check_len(name: &str, shape: &[usize], dtype: DType, len: usize) -> Result<()> {
    let elems = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|e| e.checked_mul(dtype.size()));
    if elems != Some(len) {
        let want = elems.map_or_else(|| "an overflowing number of".into(), |e| e.to_string());
        return Err(Error::InvalidArgument {
            op: Op::WeightSync,
            detail: format!(
                "parameter '{name}': shape {shape:?} of {} needs {want} bytes but its data has {len}",
                dtype.name()
            ),
        });
    }
    Ok(())
}

/// A named parameter to send (trainer side), borrowed.
#[derive(Debug, Clone)]
pub struct Param<'a> {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    data: &'a [u8],
}

impl<'a> Param<'a> {
    /// Raw little-endian bytes with a dtype tag; the length must match the shape.
    pub fn new(
        name: impl Into<String>,
        shape: &[usize],
        dtype: DType,
        data: &'a [u8],
    ) -> Result<Self> {
        let name = name.into();
        check_len(&name, shape, dtype, data.len())?;
        Ok(Self {
            name,
            shape: shape.to_vec(),
            dtype,
            data,
        })
    }

    /// An `f32` parameter.
    pub fn f32(name: impl Into<String>, shape: &[usize], data: &'a [f32]) -> Result<Self> {
        Self::new(name, shape, DType::F32, as_bytes(data))
    }

    /// A bf16 parameter given as its u16 bit patterns.
    pub fn bf16(name: impl Into<String>, shape: &[usize], data: &'a [u16]) -> Result<Self> {
        Self::new(name, shape, DType::BF16, as_bytes(data))
    }
}

/// A named parameter to receive into (rollout side), mutably borrowed.
#[derive(Debug)]
pub struct ParamMut<'a> {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    data: &'a mut [u8],
}

impl<'a> ParamMut<'a> {
    /// Raw little-endian bytes with a dtype tag; the length must match the shape.
    pub fn new(
        name: impl Into<String>,
        shape: &[usize],
        dtype: DType,
        data: &'a mut [u8],
    ) -> Result<Self> {
        let name = name.into();
        check_len(&name, shape, dtype, data.len())?;
        Ok(Self {
            name,
            shape: shape.to_vec(),
            dtype,
            data,
        })
    }

    /// An `f32` parameter.
    pub fn f32(name: impl Into<String>, shape: &[usize], data: &'a mut [f32]) -> Result<Self> {
        Self::new(name, shape, DType::F32, as_bytes_mut(data))
    }

    /// A bf16 parameter given as its u16 bit patterns.
    pub fn bf16(name: impl Into<String>, shape: &[usize], data: &'a mut [u16]) -> Result<Self> {
        Self::new(name, shape, DType::BF16, as_bytes_mut(data))
    }
}

/// What a sync's manifest lists of a parameter: its name, shape and dtype. Every
/// [`ParamView`] is one, and so is a [`crate::ParamMeta`], a parameter whose bytes come later.
pub trait Listed {
    /// Parameter name (checkpoint key).
    fn listed_name(&self) -> &str;
    /// Shape in elements.
    fn listed_shape(&self) -> &[usize];
    /// Element type tag.
    fn listed_dtype(&self) -> DType;
}

impl<P: ParamView> Listed for P {
    fn listed_name(&self) -> &str {
        self.name()
    }
    fn listed_shape(&self) -> &[usize] {
        self.shape()
    }
    fn listed_dtype(&self) -> DType {
        self.dtype()
    }
}

/// Read access shared by [`Param`] and [`ParamMut`], for [`crate::checksum()`].
pub trait ParamView {
    /// Parameter name (checkpoint key).
    fn name(&self) -> &str;
    /// Shape in elements.
    fn shape(&self) -> &[usize];
    /// Element type tag.
    fn dtype(&self) -> DType;
    /// Raw bytes.
    fn data(&self) -> &[u8];
}

impl ParamView for Param<'_> {
    fn name(&self) -> &str {
        &self.name
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn data(&self) -> &[u8] {
        self.data
    }
}

impl ParamView for ParamMut<'_> {
    fn name(&self) -> &str {
        &self.name
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn data(&self) -> &[u8] {
        self.data
    }
}

pub(crate) fn hash_meta<P: Listed + ?Sized>(h: &mut Checksum, p: &P) {
    h.update_u64(p.listed_name().len() as u64);
    h.update(p.listed_name().as_bytes());
    h.update_u64(p.listed_dtype().tag());
    h.update_u64(p.listed_shape().len() as u64);
    for &d in p.listed_shape() {
        h.update_u64(d as u64);
    }
}

fn manifest_digest<P: Listed>(params: &[P], bucket_bytes: usize) -> [u8; 16] {
    let mut h = Checksum::new();
    h.update_u64(params.len() as u64);
    for p in params {
        hash_meta(&mut h, p);
    }
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&h.finish().to_le_bytes());
    out[8..].copy_from_slice(&(bucket_bytes as u64).to_le_bytes());
    out
}

fn describe<P: Listed>(p: &P) -> String {
    format!(
        "'{}' {} {:?}",
        p.listed_name(),
        p.listed_dtype().name(),
        p.listed_shape()
    )
}

/// One line per parameter, plus a header line with the count and bucket size.
fn manifest_text<P: Listed>(params: &[P], bucket_bytes: usize) -> Vec<u8> {
    let mut s = format!("{} parameters, bucket_bytes {bucket_bytes}\n", params.len());
    for p in params {
        s.push_str(&describe(p));
        s.push('\n');
    }
    s.into_bytes()
}

fn first_difference(root: usize, a: &str, other: usize, b: &str) -> String {
    let mut la = a.lines();
    let mut lb = b.lines();
    let (ha, hb) = (la.next().unwrap_or(""), lb.next().unwrap_or(""));
    if ha != hb {
        return format!("root rank {root} has {ha}, rank {other} has {hb}");
    }
    let mut i = 0;
    loop {
        match (la.next(), lb.next()) {
            (Some(x), Some(y)) if x == y => i += 1,
            (x, y) => {
                return format!(
                    "parameter #{i}: root rank {root} has {}, rank {other} has {}; \
                     both sides must list the same parameters in the same order",
                    x.unwrap_or("nothing"),
                    y.unwrap_or("nothing")
                )
            }
        }
    }
}

/// What a sync moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncStats {
    /// Parameters in the list.
    pub params: usize,
    /// Payload bytes (all parameters).
    pub bytes: u64,
    /// Broadcast calls made (one per bucket).
    pub buckets: usize,
    /// Wall time including the manifest check.
    pub elapsed: Duration,
}

/// Broadcasts a parameter list from one rank to all others in fixed-size buckets.
#[derive(Debug, Clone)]
pub struct BucketedSync {
    bucket_bytes: usize,
}

impl Default for BucketedSync {
    fn default() -> Self {
        Self {
            bucket_bytes: Self::DEFAULT_BUCKET_BYTES,
        }
    }
}

impl BucketedSync {
    /// 32 MiB.
    pub const DEFAULT_BUCKET_BYTES: usize = 32 << 20;

    /// Buckets of at most `bucket_bytes` (at least 1; the same on every rank).
    pub fn new(bucket_bytes: usize) -> Result<Self> {
        if bucket_bytes == 0 {
            return Err(Error::InvalidArgument {
                op: Op::WeightSync,
                detail: "bucket_bytes must be at least 1 (default 32 MiB)".into(),
            });
        }
        Ok(Self { bucket_bytes })
    }

    /// The bucket size.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// The bucket layout for parameters of these byte sizes: each bucket is a list
    /// of `(parameter index, byte range within it)`. Empty parameters appear in no
    /// bucket; the buckets cover every byte once, in order.
    pub fn plan(&self, sizes: &[usize]) -> Vec<Vec<(usize, Range<usize>)>> {
        let mut buckets = Vec::new();
        let mut cur: Vec<(usize, Range<usize>)> = Vec::new();
        let mut room = self.bucket_bytes;
        for (i, &size) in sizes.iter().enumerate() {
            let mut at = 0;
            while at < size {
                let take = room.min(size - at);
                cur.push((i, at..at + take));
                at += take;
                room -= take;
                if room == 0 {
                    buckets.push(std::mem::take(&mut cur));
                    room = self.bucket_bytes;
                }
            }
        }
        if !cur.is_empty() {
            buckets.push(cur);
        }
        buckets
    }

    /// Agrees on the parameter list across ranks; an error names the first difference.
    pub(crate) fn check_manifest<C, P>(&self, comm: &mut C, root: usize, params: &[P]) -> Result<()>
    where
        C: Communicator + ?Sized,
        P: Listed,
    {
        let mine = manifest_digest(params, self.bucket_bytes);
        let all = comm.all_gather(&mine)?;
        if all.iter().all(|d| d.as_slice() == mine.as_slice()) {
            return Ok(());
        }
        // Rare path: fetch the full manifests so every rank can say what differs.
        let texts = comm.all_gather(&manifest_text(params, self.bucket_bytes))?;
        let rank = comm.rank();
        let root_text = String::from_utf8_lossy(&texts[root]).into_owned();
        let (other, detail) = texts
            .iter()
            .enumerate()
            .filter(|(r, t)| *r != root && t.as_slice() != texts[root].as_slice())
            .map(|(r, t)| {
                (
                    r,
                    first_difference(root, &root_text, r, &String::from_utf8_lossy(t)),
                )
            })
            .next()
            .unwrap_or((root, "the manifests differ".into()));
        Err(Error::Mismatch {
            op: Op::WeightSync,
            rank,
            peer: Some(if rank == other { root } else { other }),
            detail,
        })
    }

    /// Root side: sends `params` to every other rank. The root is `comm.rank()`.
    pub fn send<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        params: &[Param<'_>],
    ) -> Result<SyncStats> {
        let start = Instant::now();
        let root = comm.rank();
        self.check_manifest(comm, root, params)?;
        let sizes: Vec<usize> = params.iter().map(|p| p.data.len()).collect();
        let plan = self.plan(&sizes);
        for bucket in &plan {
            let parts: Vec<&[u8]> = bucket
                .iter()
                .map(|(i, r)| &params[*i].data[r.clone()])
                .collect();
            comm.broadcast_send_parts(&parts)?;
        }
        Ok(SyncStats {
            params: params.len(),
            bytes: sizes.iter().sum::<usize>() as u64,
            buckets: plan.len(),
            elapsed: start.elapsed(),
        })
    }

    /// Receiver side: fills `params` from rank `root`.
    pub fn recv<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        root: usize,
        params: &mut [ParamMut<'_>],
    ) -> Result<SyncStats> {
        let start = Instant::now();
        if root == comm.rank() {
            return Err(Error::InvalidArgument {
                op: Op::WeightSync,
                detail: format!("rank {root} is the sync root: it must call send, not recv"),
            });
        }
        self.check_manifest(comm, root, params)?;
        let sizes: Vec<usize> = params.iter().map(|p| p.data.len()).collect();
        let plan = self.plan(&sizes);
        // Hand out disjoint sub-slices in plan order: the plan walks the bytes
        // front to back, so each piece is the front of what is left.
        let mut rest: VecDeque<&mut [u8]> = params.iter_mut().map(|p| &mut *p.data).collect();
        for bucket in &plan {
            let mut parts: Vec<&mut [u8]> = Vec::with_capacity(bucket.len());
            for (_, r) in bucket {
                while rest.front().is_some_and(|s| s.is_empty()) {
                    rest.pop_front();
                }
                let Some(front) = rest.pop_front() else {
                    break;
                };
                let (piece, tail) = front.split_at_mut(r.len());
                parts.push(piece);
                rest.push_front(tail);
            }
            comm.broadcast_recv_parts(&mut parts, root)?;
        }
        Ok(SyncStats {
            params: params.len(),
            bytes: sizes.iter().sum::<usize>() as u64,
            buckets: plan.len(),
            elapsed: start.elapsed(),
        })
    }
}

/// All-reduces many `f32` slices (e.g. one per gradient tensor) as if they were
/// one concatenated vector, packed into staging buckets of at most
/// `bucket_elems` elements: one collective call per bucket instead of one per
/// tensor. Every rank must pass slices with the same total length. Returns the
/// number of collective calls made.
pub fn all_reduce_f32_bucketed<C: Communicator + ?Sized>(
    comm: &mut C,
    parts: &mut [&mut [f32]],
    op: crate::ReduceOp,
    bucket_elems: usize,
) -> Result<usize> {
    if bucket_elems == 0 {
        return Err(Error::InvalidArgument {
            op: Op::AllReduce,
            detail: "bucket_elems must be at least 1".into(),
        });
    }
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut staging: Vec<f32> = Vec::with_capacity(bucket_elems.min(total));
    // (part, offset) of the next element not yet staged / not yet written back.
    let (mut pi, mut po) = (0usize, 0usize);
    let mut calls = 0;
    let mut done = 0;
    while done < total {
        staging.clear();
        let (start_pi, start_po) = (pi, po);
        while staging.len() < bucket_elems && pi < parts.len() {
            let take = (bucket_elems - staging.len()).min(parts[pi].len() - po);
            staging.extend_from_slice(&parts[pi][po..po + take]);
            po += take;
            if po == parts[pi].len() {
                pi += 1;
                po = 0;
            }
        }
        comm.all_reduce_f32(&mut staging, op)?;
        calls += 1;
        let (mut wi, mut wo, mut at) = (start_pi, start_po, 0);
        while at < staging.len() {
            let take = (staging.len() - at).min(parts[wi].len() - wo);
            parts[wi][wo..wo + take].copy_from_slice(&staging[at..at + take]);
            at += take;
            wo += take;
            if wo == parts[wi].len() {
                wi += 1;
                wo = 0;
            }
        }
        done += staging.len();
    }
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum;

    #[test]
    fn plan_covers_every_byte_once_in_order() {
        let sync = BucketedSync::new(10).unwrap();
        let sizes = [3, 0, 25, 1, 1, 0, 7];
        let plan = sync.plan(&sizes);
        let mut seen: Vec<(usize, usize)> = Vec::new();
        for (b, bucket) in plan.iter().enumerate() {
            let total: usize = bucket.iter().map(|(_, r)| r.len()).sum();
            if b + 1 < plan.len() {
                assert_eq!(total, 10, "bucket {b} not full");
            } else {
                assert!(total <= 10 && total > 0);
            }
            for (i, r) in bucket {
                assert!(!r.is_empty());
                for off in r.clone() {
                    seen.push((*i, off));
                }
            }
        }
        let expected: Vec<(usize, usize)> = sizes
            .iter()
            .enumerate()
            .flat_map(|(i, &s)| (0..s).map(move |o| (i, o)))
            .collect();
        assert_eq!(seen, expected);
        assert_eq!(plan.len(), 37usize.div_ceil(10));
        assert!(sync.plan(&[0, 0]).is_empty());
    }

    #[test]
    fn param_length_is_checked_against_shape() {
        let data = [0f32; 6];
        assert!(Param::f32("w", &[2, 3], &data).is_ok());
        let err = Param::f32("w", &[2, 4], &data).unwrap_err().to_string();
        assert!(
            err.contains("'w'") && err.contains("32") && err.contains("24"),
            "{err}"
        );
    }

    #[test]
    fn checksum_sees_names_shapes_dtypes_and_bytes() {
        let a = [1.0f32, 2.0, 3.0, 4.0];
        let base = checksum(&[Param::f32("w", &[4], &a).unwrap()]);
        assert_eq!(base, checksum(&[Param::f32("w", &[4], &a).unwrap()]));
        assert_ne!(base, checksum(&[Param::f32("v", &[4], &a).unwrap()]));
        assert_ne!(base, checksum(&[Param::f32("w", &[2, 2], &a).unwrap()]));
        let bytes = as_bytes(&a);
        assert_ne!(
            base,
            checksum(&[Param::new("w", &[4], DType::I32, bytes).unwrap()])
        );
        let b = [1.0f32, 2.0, 3.0, 4.000001];
        assert_ne!(base, checksum(&[Param::f32("w", &[4], &b).unwrap()]));
        // Moving bytes between parameters changes it too.
        let c = checksum(&[
            Param::f32("w", &[2], &a[..2]).unwrap(),
            Param::f32("w", &[2], &a[2..]).unwrap(),
        ]);
        assert_ne!(base, c);
    }

    #[test]
    fn first_difference_names_the_parameter() {
        let a = "2 parameters, bucket_bytes 8\n'x' f32 [2]\n'y' f32 [3]\n";
        let b = "2 parameters, bucket_bytes 8\n'x' f32 [2]\n'y' bf16 [3]\n";
        let d = first_difference(0, a, 1, b);
        assert!(d.contains("#1") && d.contains("'y' bf16 [3]"), "{d}");
        let c = "1 parameters, bucket_bytes 8\n'x' f32 [2]\n";
        assert!(first_difference(0, a, 2, c).contains("1 parameters"));
    }
}
