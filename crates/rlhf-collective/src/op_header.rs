//! The 32-byte header every NCCL op all-gathers before its payload, so ranks that disagree
//! on a call fail with [`Error::Mismatch`] naming both sides instead of corrupting data or
//! hanging. Why a module of its own: NCCL moves raw device memory and checks nothing, so the
//! header must carry everything that makes two calls compatible (op, sequence number, root,
//! reduction, element type and element counts: an f32 and an f64 all-reduce of equal bytes
//! must not pass), and its encoding is pure and tested without a GPU.
//!
//! Layout (little-endian): `[0]` op, `[1]` reduction (0 = none), `[2]` element type,
//! `[3]` flags (bit 0: this rank's buffer holds a NaN; bit 1: this rank could not stage the
//! op's device buffers), `[4..8]` root, `[8..16]` sequence
//! number, `[16..24]` element count, `[24..32]` digest of the reduce-scatter segment counts
//! (0 otherwise).

#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use crate::error::{Error, Op, Result};
use crate::ReduceOp;

/// Bytes in an encoded [`OpHeader`].
pub(crate) const HDR_LEN: usize = 32;

const FLAG_NAN: u8 = 1;
const FLAG_UNSTAGED: u8 = 2;

/// The element type of an op's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ElemType {
    /// Raw bytes (broadcast, all_gather, barrier).
    U8,
    F32,
    F64,
}

impl ElemType {
    fn wire_id(self) -> u8 {
        match self {
            ElemType::U8 => 1,
            ElemType::F32 => 2,
            ElemType::F64 => 3,
        }
    }

    fn from_wire_id(id: u8) -> Option<Self> {
        Some(match id {
            1 => ElemType::U8,
            2 => ElemType::F32,
            3 => ElemType::F64,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            ElemType::U8 => "u8",
            ElemType::F32 => "f32",
            ElemType::F64 => "f64",
        }
    }
}

/// Whether ranks must agree on the element count (all_gather contributions may differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counts {
    Equal,
    MayDiffer,
}

/// One rank's description of the op it is about to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpHeader {
    pub op: Op,
    pub red: Option<ReduceOp>,
    pub elem: ElemType,
    pub root: u32,
    pub seq: u64,
    /// Elements (not bytes) in this rank's buffer.
    pub count: u64,
    /// [`counts_digest`] of a reduce-scatter's segment counts; 0 for other ops.
    pub counts_digest: u64,
    /// This rank's buffer holds a NaN (a Max all-reduce then propagates it, see
    /// [`crate::ReduceOp::Max`]).
    pub has_nan: bool,
    /// This rank could not allocate the op's device buffers (they are allocated before the
    /// header is exchanged): every rank then fails the op at once, naming it, instead of
    /// the others waiting inside the collective until their timeout.
    pub unstaged: bool,
}

/// A digest of a reduce-scatter's per-rank segment counts (FNV-1a over their 8-byte
/// encodings): ranks that split the buffer differently disagree on it.
pub(crate) fn counts_digest(counts: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in counts {
        for b in (*c as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn reduce_from_wire_id(id: u8) -> Option<Option<ReduceOp>> {
    Some(match id {
        0 => None,
        1 => Some(ReduceOp::Sum),
        2 => Some(ReduceOp::Avg),
        3 => Some(ReduceOp::Max),
        _ => return None,
    })
}

impl OpHeader {
    pub(crate) fn encode(&self) -> [u8; HDR_LEN] {
        let mut h = [0u8; HDR_LEN];
        h[0] = self.op.wire_id();
        h[1] = self.red.map_or(0, ReduceOp::wire_id);
        h[2] = self.elem.wire_id();
        h[3] = (if self.has_nan { FLAG_NAN } else { 0 })
            | (if self.unstaged { FLAG_UNSTAGED } else { 0 });
        h[4..8].copy_from_slice(&self.root.to_le_bytes());
        h[8..16].copy_from_slice(&self.seq.to_le_bytes());
        h[16..24].copy_from_slice(&self.count.to_le_bytes());
        h[24..32].copy_from_slice(&self.counts_digest.to_le_bytes());
        h
    }

    /// The header rank `peer` sent, or why it is not one this build writes.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        if b.len() != HDR_LEN {
            return Err(format!(
                "a header of {} bytes (expected {HDR_LEN})",
                b.len()
            ));
        }
        let u64_at = |at: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(a)
        };
        let op = Op::from_wire_id(b[0]).ok_or_else(|| format!("an unknown op id {}", b[0]))?;
        let red =
            reduce_from_wire_id(b[1]).ok_or_else(|| format!("an unknown reduction id {}", b[1]))?;
        let elem = ElemType::from_wire_id(b[2])
            .ok_or_else(|| format!("an unknown element type id {}", b[2]))?;
        let mut root = [0u8; 4];
        root.copy_from_slice(&b[4..8]);
        Ok(Self {
            op,
            red,
            elem,
            root: u32::from_le_bytes(root),
            seq: u64_at(8),
            count: u64_at(16),
            counts_digest: u64_at(24),
            has_nan: b[3] & FLAG_NAN != 0,
            unstaged: b[3] & FLAG_UNSTAGED != 0,
        })
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "{} #{} of {} {} values",
            self.op,
            self.seq,
            self.count,
            self.elem.name()
        );
        if let Some(r) = self.red {
            s.push_str(&format!(", {r:?}"));
        }
        if self.op == Op::Broadcast {
            s.push_str(&format!(", root {}", self.root));
        }
        if self.op == Op::ReduceScatter {
            s.push_str(&format!(
                ", segment counts digest {:016x}",
                self.counts_digest
            ));
        }
        s
    }

    /// Whether `theirs` (from rank `peer`) is the same call as `self` (this rank, `rank`);
    /// the error names both calls.
    pub(crate) fn check(
        &self,
        theirs: &OpHeader,
        counts: Counts,
        rank: usize,
        peer: usize,
    ) -> Result<()> {
        let same = self.op == theirs.op
            && self.red == theirs.red
            && self.elem == theirs.elem
            && self.root == theirs.root
            && self.seq == theirs.seq
            && self.counts_digest == theirs.counts_digest
            && (counts == Counts::MayDiffer || self.count == theirs.count);
        if same {
            return Ok(());
        }
        Err(Error::Mismatch {
            op: self.op,
            rank,
            peer: Some(peer),
            detail: format!(
                "rank {rank} called {} but rank {peer} called {}; every rank must issue the \
                 same collective calls with the same element type and counts",
                self.describe(),
                theirs.describe()
            ),
        })
    }

    /// Checks this rank's header against every rank's (`all`, `HDR_LEN` bytes each, in
    /// rank order); returns whether any rank flagged a NaN. Ranks that could not stage the
    /// op fail it on every rank, named.
    pub(crate) fn check_all(&self, all: &[u8], counts: Counts, rank: usize) -> Result<bool> {
        let mut any_nan = false;
        let mut unstaged = Vec::new();
        for (peer, b) in all.chunks(HDR_LEN).enumerate() {
            let theirs = OpHeader::decode(b).map_err(|why| Error::Mismatch {
                op: self.op,
                rank,
                peer: Some(peer),
                detail: format!(
                    "rank {peer} sent {why} while rank {rank} called {}: a rank of another \
                     build, or a corrupt header",
                    self.describe()
                ),
            })?;
            self.check(&theirs, counts, rank, peer)?;
            any_nan |= theirs.has_nan;
            if theirs.unstaged {
                unstaged.push(peer.to_string());
            }
        }
        if !unstaged.is_empty() {
            return Err(Error::Unavailable {
                backend: "nccl",
                reason: format!(
                    "{} #{} failed on every rank: rank(s) {} could not allocate its device \
                     buffers (out of GPU memory; see that rank's log); lower the bucket or \
                     micro-batch size, or check the estimate of `rlhf-head check \
                     --comm-backend nccl`",
                    self.op,
                    self.seq,
                    unstaged.join(", ")
                ),
            });
        }
        Ok(any_nan)
    }
}

/// The floats a collective reduces, with what the NaN contract of [`ReduceOp::Max`] needs.
pub(crate) trait Float: Copy {
    const ELEM: ElemType;
    const NAN: Self;
    fn is_nan(self) -> bool;
}

impl Float for f32 {
    const ELEM: ElemType = ElemType::F32;
    const NAN: Self = f32::NAN;
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl Float for f64 {
    const ELEM: ElemType = ElemType::F64;
    const NAN: Self = f64::NAN;
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// 1 where `buf` holds a NaN, else 0. Max-reduced over the ranks (as `u8`), it marks every
/// element that is NaN on some rank.
pub(crate) fn nan_mask<T: Float>(buf: &[T]) -> Vec<u8> {
    buf.iter().map(|v| u8::from(v.is_nan())).collect()
}

/// Puts back the NaN a backend's Max dropped (NCCL's Max of NaN and x is x): NaN wherever
/// the reduced `mask` is set.
pub(crate) fn apply_nan_mask<T: Float>(buf: &mut [T], mask: &[u8]) {
    for (v, &m) in buf.iter_mut().zip(mask) {
        if m != 0 {
            *v = T::NAN;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn all_reduce(elem: ElemType, count: u64) -> OpHeader {
        OpHeader {
            op: Op::AllReduce,
            red: Some(ReduceOp::Sum),
            elem,
            root: 0,
            seq: 5,
            count,
            counts_digest: 0,
            has_nan: false,
            unstaged: false,
        }
    }

    #[test]
    fn a_header_roundtrips_through_its_bytes() {
        let h = OpHeader {
            op: Op::ReduceScatter,
            red: Some(ReduceOp::Max),
            elem: ElemType::F64,
            root: 3,
            seq: u64::MAX - 1,
            count: 1 << 40,
            counts_digest: counts_digest(&[3, 0, 5]),
            has_nan: true,
            unstaged: true,
        };
        assert_eq!(OpHeader::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[2] = 9;
        assert!(OpHeader::decode(&bad)
            .unwrap_err()
            .contains("element type id 9"));
        assert!(OpHeader::decode(&bad[..31])
            .unwrap_err()
            .contains("31 bytes"));
    }

    /// An f32 all-reduce of 4 values and an f64 one of 2 are 16 bytes each: refused,
    /// naming both sides.
    #[test]
    fn equal_bytes_of_different_types_are_a_mismatch_naming_both_sides() {
        let mine = all_reduce(ElemType::F32, 4);
        let theirs = all_reduce(ElemType::F64, 2);
        let mut all = mine.encode().to_vec();
        all.extend(theirs.encode());
        let e = mine.check_all(&all, Counts::Equal, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch);
        assert_eq!(e.peer(), Some(1));
        let msg = e.to_string();
        assert!(
            msg.contains("rank 0 called all_reduce #5 of 4 f32 values"),
            "{msg}"
        );
        assert!(
            msg.contains("rank 1 called all_reduce #5 of 2 f64 values"),
            "{msg}"
        );
    }

    #[test]
    fn unequal_counts_are_refused_where_counts_must_match() {
        let mine = all_reduce(ElemType::F32, 4);
        let theirs = all_reduce(ElemType::F32, 5);
        let e = mine.check(&theirs, Counts::Equal, 1, 2).unwrap_err();
        assert!(e.to_string().contains("of 5 f32 values"), "{e}");
        // all_gather contributions may differ in length.
        let g = |count| OpHeader {
            op: Op::AllGather,
            red: None,
            elem: ElemType::U8,
            count,
            ..mine
        };
        assert!(g(4).check(&g(9), Counts::MayDiffer, 0, 1).is_ok());
    }

    #[test]
    fn reduce_scatter_segments_split_differently_are_refused() {
        let rs = |counts: &[usize]| OpHeader {
            op: Op::ReduceScatter,
            counts_digest: counts_digest(counts),
            count: counts.iter().sum::<usize>() as u64,
            ..all_reduce(ElemType::F32, 0)
        };
        assert!(rs(&[3, 5]).check(&rs(&[3, 5]), Counts::Equal, 0, 1).is_ok());
        let e = rs(&[3, 5])
            .check(&rs(&[5, 3]), Counts::Equal, 0, 1)
            .unwrap_err();
        assert!(e.to_string().contains("segment counts digest"), "{e}");
    }

    #[test]
    fn a_nan_flag_from_any_rank_is_reported_and_does_not_mismatch() {
        let mine = all_reduce(ElemType::F32, 4);
        let theirs = OpHeader {
            has_nan: true,
            ..mine
        };
        let mut all = mine.encode().to_vec();
        assert!(!mine.check_all(&all, Counts::Equal, 0).unwrap());
        all.extend(theirs.encode());
        assert!(mine.check_all(&all, Counts::Equal, 0).unwrap());
    }

    #[test]
    fn a_foreign_header_is_a_mismatch_naming_the_peer() {
        let mine = all_reduce(ElemType::F32, 4);
        let mut all = mine.encode().to_vec();
        all.extend([0xffu8; HDR_LEN]);
        let e = mine.check_all(&all, Counts::Equal, 0).unwrap_err();
        assert_eq!(e.peer(), Some(1));
        assert!(e.to_string().contains("unknown op id 255"), "{e}");
    }

    /// NCCL's Max drops NaN (fmax semantics); the mask, Max-reduced over the ranks and
    /// applied afterwards, gives what the TCP and shared-memory backends give.
    #[test]
    fn the_nan_mask_restores_what_an_fmax_reduction_dropped() {
        let ranks = [
            vec![1.0f32, f32::NAN, 3.0, -1.0],
            vec![2.0, 0.5, f32::NAN, -2.0],
            vec![0.0, 0.0, 1.0, f32::NAN],
        ];
        let mut reduced: Vec<f32> = (0..4)
            .map(|i| ranks.iter().map(|r| r[i]).fold(f32::NEG_INFINITY, f32::max))
            .collect();
        assert!(
            !reduced.iter().any(|v| v.is_nan()),
            "f32::max drops NaN as fmax does"
        );
        let mask = ranks
            .iter()
            .map(|r| nan_mask(r))
            .reduce(|a, b| a.iter().zip(&b).map(|(x, y)| *x.max(y)).collect())
            .unwrap();
        apply_nan_mask(&mut reduced, &mask);
        assert_eq!(reduced[0], 2.0);
        assert!(reduced[1..].iter().all(|v| v.is_nan()), "{reduced:?}");
    }

    /// A rank whose device allocation failed still sends its header, flagged: every rank
    /// fails the op at once naming it, instead of the others waiting in the collective.
    #[test]
    fn a_rank_that_could_not_stage_fails_the_op_on_every_rank() {
        let mine = all_reduce(ElemType::F32, 4);
        let oom = OpHeader {
            unstaged: true,
            ..mine
        };
        let mut all = mine.encode().to_vec();
        all.extend(mine.encode());
        all.extend(oom.encode());
        let e = mine.check_all(&all, Counts::Equal, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        let msg = e.to_string();
        assert!(msg.contains("rank(s) 2 could not allocate"), "{msg}");
        assert!(msg.contains("all_reduce #5"), "{msg}");
    }
}
