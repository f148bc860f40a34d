//! Reduce-scatter of one long `f32` vector that arrives in pieces (ZeRO stage 2's gradients:
//! one parameter's gradient after another), through a staging bucket of bounded size: the
//! whole vector never exists on any rank, and each rank keeps only the reduced values of its
//! own contiguous span of it.

use crate::error::{Error, Op, Result};
use crate::{Communicator, ReduceOp};

/// Feeds a vector, piece by piece, into bucketed reduce-scatters; this rank's span of the
/// reduced vector is added into `out`. Every rank must push the same total length (its own
/// values, in the same order) and the same `bounds`.
pub struct ReduceScatterStream<'a, C: Communicator + ?Sized> {
    comm: &'a mut C,
    /// Rank `r` owns elements `bounds[r]..bounds[r + 1]` of the whole vector.
    bounds: Vec<usize>,
    out: &'a mut [f32],
    staging: Vec<f32>,
    /// Offset in the whole vector of `staging[0]`.
    start: usize,
    bucket: usize,
    op: ReduceOp,
    calls: usize,
}

fn invalid(detail: String) -> Error {
    Error::InvalidArgument {
        op: Op::ReduceScatter,
        detail,
    }
}

impl<'a, C: Communicator + ?Sized> ReduceScatterStream<'a, C> {
    /// `bounds` has `world_size + 1` non-decreasing offsets from 0 to the vector's length;
    /// `out` is as long as this rank's span. Buckets hold at most `bucket_elems` values.
    pub fn new(
        comm: &'a mut C,
        bounds: Vec<usize>,
        out: &'a mut [f32],
        op: ReduceOp,
        bucket_elems: usize,
    ) -> Result<Self> {
        let world = comm.world_size();
        let rank = comm.rank();
        if bucket_elems == 0 {
            return Err(invalid("bucket_elems must be at least 1".into()));
        }
        if bounds.len() != world + 1 || bounds[0] != 0 || bounds.windows(2).any(|w| w[0] > w[1]) {
            return Err(invalid(format!(
                "span bounds {bounds:?} for a world of {world}: give {} non-decreasing offsets starting at 0",
                world + 1
            )));
        }
        let mine = bounds[rank + 1] - bounds[rank];
        if out.len() != mine {
            return Err(invalid(format!(
                "rank {rank} owns {mine} elements but its output holds {}",
                out.len()
            )));
        }
        Ok(Self {
            comm,
            bounds,
            out,
            staging: Vec::with_capacity(bucket_elems),
            start: 0,
            bucket: bucket_elems,
            op,
            calls: 0,
        })
    }

    fn total(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }

    /// Appends the next piece of the vector.
    pub fn push(&mut self, mut data: &[f32]) -> Result<()> {
        while !data.is_empty() {
            self.check_room(data.len())?;
            let take = (self.bucket - self.staging.len()).min(data.len());
            self.staging.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.staging.len() == self.bucket {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Appends `n` zeros (a piece this rank has no values for).
    pub fn push_zeros(&mut self, mut n: usize) -> Result<()> {
        while n > 0 {
            self.check_room(n)?;
            let take = (self.bucket - self.staging.len()).min(n);
            self.staging.resize(self.staging.len() + take, 0.0);
            n -= take;
            if self.staging.len() == self.bucket {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn check_room(&self, n: usize) -> Result<()> {
        let pushed = self.start + self.staging.len();
        if pushed + n > self.total() {
            return Err(invalid(format!(
                "{} elements pushed into a vector of {}",
                pushed + n,
                self.total()
            )));
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.staging.is_empty() {
            return Ok(());
        }
        let (lo, hi) = (self.start, self.start + self.staging.len());
        let cut = |r: usize| {
            let (a, b) = (self.bounds[r].max(lo), self.bounds[r + 1].min(hi));
            a..b.max(a)
        };
        let counts: Vec<usize> = (0..self.comm.world_size()).map(|r| cut(r).len()).collect();
        self.comm
            .reduce_scatter_f32(&mut self.staging, &counts, self.op)?;
        let me = self.comm.rank();
        let own = cut(me);
        if !own.is_empty() {
            let base = self.bounds[me];
            for (o, s) in self.out[own.start - base..own.end - base]
                .iter_mut()
                .zip(&self.staging[own.start - lo..own.end - lo])
            {
                *o += *s;
            }
        }
        self.calls += 1;
        self.start = hi;
        self.staging.clear();
        Ok(())
    }

    /// Reduces what is left; the vector must be complete. Returns the collective calls made.
    pub fn finish(mut self) -> Result<usize> {
        self.flush()?;
        if self.start != self.total() {
            return Err(invalid(format!(
                "only {} of the vector's {} elements were pushed",
                self.start,
                self.total()
            )));
        }
        Ok(self.calls)
    }
}
