//! ZeRO stages 1 and 2 across a trained role's data-parallel group (`training.zero_stage`;
//! stage 3 shards the model itself, `rlhf_model::zero3`, and borrows the group here, [`lend`]):
//! each rank's AdamW holds the moments of its contiguous share of the flattened parameters
//! (`rlhf_model::partition`) and steps that share; the group then all-gathers the stepped
//! shares so every rank holds the whole updated model again. Stage 1 steps from the usual
//! all-reduced gradient; stage 2 reduce-scatters each micro-batch's gradient, so a rank only
//! ever keeps its share of the summed gradient ([`scatter_grads`]). A checkpoint keeps the
//! shares apart: each rank writes its own (`crate::checkpoint`).

use candle_core::DType;
use rlhf_collective::{as_bytes, Communicator, ReduceOp, ReduceScatterStream};
use rlhf_model::{partition, shard_span, AdamW, Gradients, Model};

use crate::error::{Ctx, Error, Result};

/// Runs `f` with the group's communicator: as it is, or (ZeRO stage 3) lent to `model` for
/// the span of `f`, which then reaches the group through the model's turn-taking handle.
pub fn lend<R>(
    model: &Model,
    comm: &mut dyn Communicator,
    f: impl FnOnce(&mut dyn Communicator) -> Result<R>,
) -> Result<R> {
    match model.zero3() {
        Some(z) => z.lend(comm, f)?,
        None => f(comm),
    }
}

/// A ZeRO-3 model's inference call (log-probs, values, scores) on one rank of its group.
/// Every model call gathers from the whole group, so every rank must make the same number
/// of them, while the driver hands the ranks different numbers of rows. The ranks first
/// agree on the most calls any of them plans (`planned`: its rows over its micro-batch),
/// then each runs `f` with the group lent and makes up the difference with idle calls, also
/// after `f` failed before its first call (a refused request), so that no rank is left
/// waiting in a collective. A model that is not sharded just runs `f`.
///
/// Every inference call makes the same collectives per model call (the edges, then each
/// layer), so two such calls that reach the ranks of a group in different orders (the driver
/// may send two at once) still pair up: each pairing agrees on its own count, and each rank
/// computes its own rows with the same gathered weights.
pub fn lockstep<R>(
    model: &Model,
    comm: &mut dyn Communicator,
    planned: usize,
    what: &str,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let Some(z) = model.zero3() else {
        return f();
    };
    z.lend(comm, |c| {
        let mut most = [planned as f64];
        c.all_reduce_f64(&mut most, ReduceOp::Max)
            .with_ctx(|| format!("{what}: agreeing on the model calls of the group (ZeRO-3)"))?;
        let total = most[0] as usize;
        let before = z.calls();
        let out = f();
        let made = z.calls() - before;
        if made > total {
            return Err(Error::internal(format!(
                "{what}: made {made} ZeRO-3 model calls, the group agreed on {total}"
            )));
        }
        for _ in made..total {
            if let Err(e) = model.zero3_idle_forward() {
                let idle = format!("{what}: an idle ZeRO-3 call keeping the group in step");
                // A call that failed halfway (out of device memory, say) leaves the group out
                // of step: its own error is the one to report.
                return Err(match out {
                    Err(first) => first.context(format!("{idle} failed too: {e}")),
                    Ok(_) => Error::from(e).context(idle),
                });
            }
        }
        out
    })?
}

/// A rank's `f32` values as an all-gather returns them.
fn floats(bytes: &[u8], what: &str) -> Result<Vec<f32>> {
    // `as_bytes` sends the native order, which is little-endian on every target we build for.
    rlhf_types::f32s_from_le_bytes(bytes).ok_or_else(|| {
        Error::internal(format!(
            "a rank sent {} bytes of {what}, not whole f32 values",
            bytes.len()
        ))
    })
}

/// Values per reduce-scatter call (16 MiB of f32): the most of the gradient that exists on a
/// rank as one flat vector.
const SCATTER_BUCKET_ELEMS: usize = 4 << 20;

/// ZeRO stage 2: sums one micro-batch's gradients over the group and adds this rank's share
/// ([`AdamW::owned_span`]) into `shard`. Each parameter's gradient is flattened and dropped
/// in turn, so besides the backward's own tensors a rank holds one bucket and its share.
/// `None` (a rank with no rows, or one that failed) and parameters without a gradient count
/// as zeros, so every rank makes the same calls.
pub fn scatter_grads(
    comm: &mut dyn Communicator,
    opt: &AdamW,
    grads: Option<Gradients>,
    shard: &mut [f32],
) -> Result<()> {
    let world = comm.world_size();
    let total = opt.total_len();
    let mut bounds: Vec<usize> = (0..world)
        .map(|r| shard_span(total, r, world).start)
        .collect();
    bounds.push(total);
    let mut grads = grads.unwrap_or_default();
    let what = "reduce-scattering gradients (training.zero_stage 2)";
    let mut s = ReduceScatterStream::new(comm, bounds, shard, ReduceOp::Sum, SCATTER_BUCKET_ELEMS)
        .ctx(what)?;
    for (name, n) in opt.param_sizes() {
        match grads.remove(name) {
            Some(g) => {
                let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                if g.len() != n {
                    return Err(Error::internal(format!(
                        "the gradient of {name} has {} values, the parameter {n}",
                        g.len()
                    )));
                }
                s.push(&g).ctx(what)?;
            }
            None => s.push_zeros(n).ctx(what)?,
        }
    }
    s.finish().ctx(what)?;
    Ok(())
}

/// Parameter values per all-gather of the exchange after a step (16 MiB of f32, or one
/// larger parameter): the most of the model that exists twice on a rank at once.
const EXCHANGE_BUCKET_ELEMS: usize = 4 << 20;

/// After a sharded step: every rank's stepped share to every rank, so all hold the whole
/// updated model. Whole parameters go in buckets: each rank sends its share of a bucket's
/// parameters, and each parameter is rebuilt from the ranks' pieces and set, so besides the
/// model a rank holds one bucket, not a second copy of all the weights.
pub fn exchange_params(comm: &mut dyn Communicator, opt: &mut AdamW) -> Result<()> {
    let world = comm.world_size();
    let sizes: Vec<usize> = opt.param_sizes().map(|(_, n)| n).collect();
    let pieces: Vec<Vec<std::ops::Range<usize>>> =
        (0..world).map(|r| partition(&sizes, r, world)).collect();
    let what = "stepped parameter shares";
    let mut i = 0;
    while i < sizes.len() {
        let mut j = i + 1;
        let mut n = sizes[i];
        while j < sizes.len() && n + sizes[j] <= EXCHANGE_BUCKET_ELEMS {
            n += sizes[j];
            j += 1;
        }
        let mine = opt.owned_values(i..j)?;
        let all = comm
            .all_gather(as_bytes(&mine))
            .ctx("exchanging the stepped parameter shares (training.zero_stage 1 or 2)")?;
        drop(mine);
        let all: Vec<Vec<f32>> = all.iter().map(|b| floats(b, what)).collect::<Result<_>>()?;
        let mut at = vec![0usize; world];
        for k in i..j {
            let mut full = Vec::with_capacity(sizes[k]);
            for (r, vals) in all.iter().enumerate() {
                let len = pieces[r][k].len();
                let got = vals.get(at[r]..at[r] + len).ok_or_else(|| {
                    Error::internal(format!(
                        "rank {r} sent {} {what} for parameters {i}..{j}, fewer than its shares; the ranks disagree on the parameters",
                        vals.len()
                    ))
                })?;
                full.extend_from_slice(got);
                at[r] += len;
            }
            opt.set_param_values(k, full)?;
        }
        if let Some(r) = (0..world).find(|&r| at[r] != all[r].len()) {
            return Err(Error::internal(format!(
                "rank {r} sent {} {what} for parameters {i}..{j}, its shares are {}; the ranks disagree on the parameters",
                all[r].len(),
                at[r]
            )));
        }
        i = j;
    }
    Ok(())
}
