//! The ring collectives of the TCP backend: all-reduce (reduce-scatter then all-gather
//! around the ring, `2 (n - 1) / n` of the buffer sent per rank) and the reduce-scatter
//! half on its own, plus the element types they combine. Split from `mod.rs`, which keeps
//! the links, the headers, broadcast and gather.

use std::ops::Range;

use super::frame::{read_exact, Ctx, Header};
use super::{duplex, Link, TcpCommunicator};
use crate::error::{Op, Result};
use crate::{as_bytes, as_bytes_mut, Plain, ReduceOp};

impl TcpCommunicator {
    pub(super) fn all_reduce_impl<T: Elem>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let seq = self.begin(Op::AllReduce)?;
        let r = self.all_reduce_inner(buf, op, seq);
        self.finish(r)
    }

    fn all_reduce_inner<T: Elem>(&mut self, buf: &mut [T], op: ReduceOp, seq: u64) -> Result<()> {
        let n = self.world;
        let rank = self.rank;
        let config = self.config.clone();
        let ctx = Ctx {
            op: Op::AllReduce,
            rank,
            config: &config,
        };
        self.exchange_headers(
            &ctx,
            Header {
                op: Op::AllReduce.wire_id(),
                aux: op.wire_id() | (T::DTYPE_ID << 4),
                root: 0,
                seq,
                len: std::mem::size_of_val(buf) as u64,
            },
        )?;
        let Some((next, prev)) = &self.links else {
            return Ok(());
        };
        let scratch: &mut [T] = cast_scratch(&mut self.scratch);
        let len = buf.len();
        let seg = |i: usize| (i * len / n)..((i + 1) * len / n);
        for s in 0..n - 1 {
            let send_i = (rank + n - s) % n;
            let recv_i = (rank + 2 * n - s - 1) % n;
            let (send, recv) = split_pair(buf, seg(send_i), seg(recv_i));
            duplex(&ctx, next, prev, as_bytes(send), |ctx| {
                recv_reduce(ctx, prev, recv, op, scratch)
            })?;
        }
        if op == ReduceOp::Avg {
            T::divide(&mut buf[seg((rank + 1) % n)], n);
        }
        for s in 0..n - 1 {
            let send_i = (rank + 1 + n - s) % n;
            let recv_i = (rank + n - s) % n;
            let (send, recv) = split_pair(buf, seg(send_i), seg(recv_i));
            duplex(&ctx, next, prev, as_bytes(send), |ctx| {
                read_exact(ctx, prev, as_bytes_mut(recv))
            })?;
        }
        Ok(())
    }

    pub(super) fn reduce_scatter_impl(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        crate::check_counts(buf.len(), counts, self.world)?;
        let seq = self.begin(Op::ReduceScatter)?;
        let r = self.reduce_scatter_inner(buf, counts, op, seq);
        self.finish(r)
    }

    /// The reduce-scatter half of the ring all-reduce, with segment `r` ending on rank `r`:
    /// in step `s` rank `r` sends segment `(r - s - 1) mod n` and receives and reduces
    /// segment `(r - s - 2) mod n`, so after `n - 1` steps its own segment has passed every
    /// rank.
    fn reduce_scatter_inner(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
        seq: u64,
    ) -> Result<()> {
        let n = self.world;
        let rank = self.rank;
        let config = self.config.clone();
        let ctx = Ctx {
            op: Op::ReduceScatter,
            rank,
            config: &config,
        };
        // The counts travel as a digest in the root field, so ranks that cut the buffer
        // differently fail at once instead of reading each other's segments wrong.
        let mut h = rlhf_types::Checksum::new();
        for &c in counts {
            h.update_u64(c as u64);
        }
        self.exchange_headers(
            &ctx,
            Header {
                op: Op::ReduceScatter.wire_id(),
                aux: op.wire_id() | (<f32 as Elem>::DTYPE_ID << 4),
                root: h.finish() as u32,
                seq,
                len: std::mem::size_of_val(buf) as u64,
            },
        )?;
        let Some((next, prev)) = &self.links else {
            return Ok(());
        };
        let scratch: &mut [f32] = cast_scratch(&mut self.scratch);
        let mut offs = Vec::with_capacity(n + 1);
        offs.push(0usize);
        for &c in counts {
            offs.push(offs[offs.len() - 1] + c);
        }
        let seg = |i: usize| offs[i]..offs[i + 1];
        for s in 0..n - 1 {
            let send_i = (rank + 2 * n - s - 1) % n;
            let recv_i = (rank + 2 * n - s - 2) % n;
            let (send, recv) = split_pair(buf, seg(send_i), seg(recv_i));
            duplex(&ctx, next, prev, as_bytes(send), |ctx| {
                recv_reduce(ctx, prev, recv, op, scratch)
            })?;
        }
        if op == ReduceOp::Avg {
            f32::divide(&mut buf[seg(rank)], n);
        }
        Ok(())
    }
}

/// Numbers all-reduce can combine.
pub(crate) trait Elem: Plain + PartialOrd {
    const DTYPE_ID: u8;
    fn reduce(dst: &mut [Self], src: &[Self], op: ReduceOp);
    fn divide(dst: &mut [Self], n: usize);
}

macro_rules! elem {
    ($t:ty, $id:expr) => {
        impl Elem for $t {
            const DTYPE_ID: u8 = $id;
            fn reduce(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d += *s;
                        }
                    }
                    ReduceOp::Max => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            // NaN wins, so a NaN on any rank is never hidden.
                            if s.is_nan() || *s > *d {
                                *d = *s;
                            }
                        }
                    }
                }
            }
            fn divide(dst: &mut [Self], n: usize) {
                let n = n as $t;
                for d in dst {
                    *d /= n;
                }
            }
        }
    };
}
elem!(f32, 1);
elem!(f64, 2);

/// Views the u64 scratch buffer as `T`s.
fn cast_scratch<T: Plain>(s: &mut [u64]) -> &mut [T] {
    let bytes = std::mem::size_of_val(s);
    let n = bytes / std::mem::size_of::<T>();
    // SAFETY: `T: Plain` is a primitive number of size ≤ 8 whose alignment divides
    // u64's, every bit pattern is a valid `T`, and `n * size_of::<T>() <= bytes`.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<T>(), n) }
}

/// Two disjoint sub-slices: `a` shared, `b` mutable.
pub(super) fn split_pair<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn recv_reduce<T: Elem>(
    ctx: &Ctx<'_>,
    link: &Link,
    dst: &mut [T],
    op: ReduceOp,
    scratch: &mut [T],
) -> Result<()> {
    for d in dst.chunks_mut(scratch.len().max(1)) {
        let s = &mut scratch[..d.len()];
        read_exact(ctx, link, as_bytes_mut(s))?;
        T::reduce(d, s, op);
    }
    Ok(())
}
