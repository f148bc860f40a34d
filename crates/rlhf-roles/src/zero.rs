//! ZeRO stage 1 across a trained role's data-parallel group (`training.zero_stage: 1`): each
//! rank's AdamW holds the moments of its contiguous share of the flattened parameters
//! (`rlhf_model::partition`), steps that share after the usual gradient all-reduce, and the
//! group all-gathers the stepped shares so every rank holds the whole updated model again.
//! A checkpoint keeps the shares apart: each rank writes its own (`crate::checkpoint`).

use rlhf_collective::{as_bytes, Communicator};
use rlhf_model::AdamW;

use crate::error::{Ctx, Error, Result};

/// The ranks' `f32` vectors (as an all-gather returns them) joined in rank order.
fn join(parts: Vec<Vec<u8>>, want: usize, what: &str) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(want);
    for p in parts {
        if p.len() % 4 != 0 {
            return Err(Error::internal(format!(
                "a rank sent {} bytes of {what}, not whole f32 values",
                p.len()
            )));
        }
        out.extend(
            p.chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        );
    }
    if out.len() != want {
        return Err(Error::internal(format!(
            "the group's {what} add up to {} values, the model has {want}; the ranks disagree on the parameters",
            out.len()
        )));
    }
    Ok(out)
}

/// After a sharded step: every rank's stepped share to every rank, so all hold the whole
/// updated model.
pub fn exchange_params(comm: &mut dyn Communicator, opt: &mut AdamW) -> Result<()> {
    let mine = opt.owned_params()?;
    let all = comm
        .all_gather(as_bytes(&mine))
        .ctx("exchanging the stepped parameter shares (training.zero_stage 1)")?;
    let flat = join(all, opt.total_len(), "stepped parameters")?;
    Ok(opt.set_params_from_flat(&flat)?)
}
