//! One mini-batch's gradient, summed over micro-batches and over the data-parallel group:
//! whole on every rank (all-reduce, ZeRO stages 0 and 1), or only each rank's share of it
//! (a reduce-scatter per micro-batch, ZeRO stage 2; per layer during the backward, stage 3),
//! with its global norm either way. A bad
//! loss on one rank travels with the collectives, so the whole group fails together instead
//! of leaving the others waiting.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use rlhf_algo::LossAggMode;
use rlhf_collective::{all_reduce_f32_bucketed, Communicator, ReduceOp};
use rlhf_model::{Gradients, Model};

use crate::error::{Ctx, Error, Result};
use crate::train::{denominator, mean_into, micro_scale, Ident, Train};

/// Elements per gradient all-reduce call (16 MiB of f32).
const GRAD_BUCKET_ELEMS: usize = 4 << 20;

/// The rows of one mini-batch on this rank and how to weigh them.
pub(crate) struct MiniBatch<'a> {
    pub idx: &'a [usize],
    /// The shard's loss mask, `[rows, width]`.
    pub mask: &'a [f32],
    pub width: usize,
    pub micro_rows: usize,
    pub mode: LossAggMode,
    /// The group's loss denominator of this mini-batch.
    pub global: f64,
    pub who: &'a Ident,
    pub step: u64,
    /// Seed of this mini-batch's LoRA dropout masks (job seed, step, epoch, mini-batch and
    /// rank mixed): each micro-batch's pass adds its rows, so masks repeat on resume.
    pub dropout_seed: u64,
}

/// The group's summed gradient of a mini-batch.
pub(crate) enum Summed {
    /// All of it (ZeRO stages 0 and 1).
    Whole(Gradients),
    /// This rank's share ([`rlhf_model::AdamW::owned_span`]), ZeRO stage 2.
    Owned(Vec<f32>),
}

pub(crate) struct Accumulated {
    pub grads: Summed,
    /// Global L2 norm of the summed gradient.
    pub norm: f64,
    /// `(weighted sum, weight)` of this rank's micro-batch diagnostics.
    pub stats: BTreeMap<String, (f64, f64)>,
}

enum Micro {
    /// No valid token in these rows.
    Skip,
    Failed(Error),
    Grads(Gradients),
}

impl MiniBatch<'_> {
    fn non_finite(&self, tensor: String) -> Error {
        Error::NonFinite {
            tensor,
            role: self.who.role,
            rank: self.who.rank,
            step: self.step,
        }
    }

    /// The backward pass of `rows`, with their loss scaled to the mini-batch's share.
    fn micro<T: Train>(
        &self,
        engine: &T,
        model: &Model,
        vars: &[(String, Var)],
        batch: &T::Batch,
        rows: &[usize],
        stats: &mut BTreeMap<String, (f64, f64)>,
    ) -> Result<Micro> {
        let w = self.width;
        let m: Vec<f32> = rows
            .iter()
            .flat_map(|&r| self.mask[r * w..(r + 1) * w].iter().copied())
            .collect();
        let tokens = denominator(&m, w, LossAggMode::TokenMean);
        if tokens == 0.0 {
            return Ok(Micro::Skip);
        }
        let scale = micro_scale(&m, w, self.mode, self.global)?;
        // LoRA dropout for this forward and its backward (a checkpointed layer recomputed in
        // the backward draws the same masks); off again for any other use of the model.
        let mut seed = rlhf_types::Checksum::new();
        seed.update_u64(self.dropout_seed);
        for &r in rows {
            seed.update_u64(r as u64);
        }
        let _pass = model.dropout_pass(seed.finish());
        // ZeRO-3: the forward and the backward are one training pass of the sharded model.
        let z = model.zero3();
        if let Some(z) = z {
            z.begin_pass()?;
        }
        let out = match engine.micro_loss(model, batch, rows) {
            Ok(out) => out,
            Err(e) => {
                if let Some(z) = z {
                    z.abort_pass()?;
                }
                return Err(e);
            }
        };
        let loss_value = out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if !loss_value.is_finite() {
            if let Some(z) = z {
                // The group's passes must line up: finish this one (its gradients are not
                // used, the update fails on every rank).
                z.backward(&rlhf_model::zero3::zero_loss(&out.loss)?)?;
            }
            return Ok(Micro::Failed(self.non_finite("loss".into())));
        }
        // Scaling the loss rather than the gradients keeps one copy of them
        // (`Gradients::add` takes the micro-batch's tensors).
        let loss = if scale == 1.0 {
            out.loss
        } else {
            (out.loss * scale)?
        };
        let grads = match z {
            // The gradients stay with the model, reduce-scattered to each rank's pieces.
            Some(z) => {
                z.backward(&loss)?;
                Gradients::default()
            }
            None => Gradients::backward(&loss, vars)?,
        };
        for (k, v) in out.stats {
            mean_into(stats, k, v, tokens);
        }
        Ok(Micro::Grads(grads))
    }

    /// This rank's own failure first, then the count of other ranks that failed.
    fn check_failures(&self, failed: Option<Error>, others: usize) -> Result<()> {
        if let Some(e) = failed {
            return Err(e);
        }
        if others > 0 {
            return Err(self.non_finite(format!("loss on {others} other rank(s) of the group")));
        }
        Ok(())
    }
}

/// Sums the mini-batch's gradient over micro-batches and the group: whole, or (ZeRO stage 2,
/// `shard`ed optimizer) this rank's share only.
pub(crate) fn accumulate<T: Train>(
    engine: &T,
    model: &Model,
    vars: &[(String, Var)],
    comm: &mut dyn Communicator,
    batch: &T::Batch,
    mb: &MiniBatch<'_>,
) -> Result<Accumulated> {
    let optim = &engine.state().optim;
    if model.zero3().is_some() {
        return accumulate_zero3(engine, model, vars, comm, batch, mb);
    }
    if optim.zero_stage >= 2 && optim.opt.shard().is_some() {
        return accumulate_owned(engine, model, vars, comm, batch, mb);
    }
    let mut grads = Gradients::default();
    let mut stats = BTreeMap::new();
    let mut failed = None;
    for rows in mb.idx.chunks(mb.micro_rows) {
        match mb.micro(engine, model, vars, batch, rows, &mut stats)? {
            Micro::Skip => {}
            Micro::Failed(e) => {
                failed = Some(e);
                break;
            }
            Micro::Grads(g) => grads.add(g)?,
        }
    }
    let (grads, failures) = all_reduce_grads(&grads, vars, comm, failed.is_some())?;
    mb.check_failures(failed, failures)?;
    let norm = grads.global_norm()?;
    if !norm.is_finite() {
        let which = grads
            .check_finite()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "gradient norm".into());
        return Err(mb.non_finite(format!("gradient ({which})")));
    }
    Ok(Accumulated {
        grads: Summed::Whole(grads),
        norm,
        stats,
    })
}

/// `(weighted sum, weight)` of diagnostics, by name.
type Stats = BTreeMap<String, (f64, f64)>;

/// One micro-batch of a sharded stage on this rank.
enum Turn {
    /// Its backward ran: these gradients (ZeRO-3: none, they stayed with the model).
    Ran(Gradients),
    /// Its loss was not finite (a ZeRO-3 pass still ran, with a zero loss).
    Failed,
    /// Nothing ran: a rank with fewer rows, no valid token, or a failure before it.
    Idle,
}

/// The micro-batches of a sharded stage (2 or 3), whose every micro-batch is a collective:
/// the ranks agree on their number first, and `each` gets every one of them. Returns the
/// diagnostics and this rank's failure.
#[allow(clippy::too_many_arguments)]
fn sharded_micro_batches<T: Train>(
    engine: &T,
    model: &Model,
    vars: &[(String, Var)],
    comm: &mut dyn Communicator,
    batch: &T::Batch,
    mb: &MiniBatch<'_>,
    stage: u32,
    mut each: impl FnMut(&mut dyn Communicator, Turn) -> Result<()>,
) -> Result<(Stats, Option<Error>)> {
    let chunks: Vec<&[usize]> = mb.idx.chunks(mb.micro_rows).collect();
    let mut n = [chunks.len() as f64];
    comm.all_reduce_f64(&mut n, ReduceOp::Max).with_ctx(|| {
        format!("agreeing on the number of micro-batches (training.zero_stage {stage})")
    })?;
    let mut stats = BTreeMap::new();
    let mut failed = None;
    for k in 0..n[0] as usize {
        let turn = match chunks.get(k) {
            Some(rows) if failed.is_none() => {
                match mb.micro(engine, model, vars, batch, rows, &mut stats)? {
                    Micro::Skip => Turn::Idle,
                    Micro::Failed(e) => {
                        failed = Some(e);
                        Turn::Failed
                    }
                    Micro::Grads(g) => Turn::Ran(g),
                }
            }
            _ => Turn::Idle,
        };
        each(comm, turn)?;
    }
    Ok((stats, failed))
}

/// The global norm of a sharded gradient from each rank's sum of `squares`, with the group's
/// failures (this rank's first); a norm that is not finite names `first_bad`'s parameter.
fn sharded_norm(
    comm: &mut dyn Communicator,
    mb: &MiniBatch<'_>,
    stage: u32,
    squares: f64,
    failed: Option<Error>,
    first_bad: impl FnOnce() -> Result<Option<String>>,
) -> Result<f64> {
    let mine = u8::from(failed.is_some());
    let mut sums = [squares, f64::from(mine)];
    comm.all_reduce_f64(&mut sums, ReduceOp::Sum)
        .with_ctx(|| format!("all-reducing the gradient norm (training.zero_stage {stage})"))?;
    mb.check_failures(failed, sums[1].round() as usize - usize::from(mine))?;
    let norm = sums[0].sqrt();
    if !norm.is_finite() {
        let which = first_bad()?
            .map(|n| format!("the gradient of {n} is not finite (NaN or inf)"))
            .unwrap_or_else(|| "gradient norm, not finite on another rank's share".into());
        return Err(mb.non_finite(format!("gradient ({which})")));
    }
    Ok(norm)
}

/// ZeRO stage 2: every micro-batch's gradient is reduce-scattered as soon as it exists and
/// only this rank's share is kept, so no rank holds a summed whole gradient; a rank without
/// the micro-batch sends zeros.
fn accumulate_owned<T: Train>(
    engine: &T,
    model: &Model,
    vars: &[(String, Var)],
    comm: &mut dyn Communicator,
    batch: &T::Batch,
    mb: &MiniBatch<'_>,
) -> Result<Accumulated> {
    let opt = &engine.state().optim.opt;
    let mut shard = vec![0f32; opt.owned_len()];
    let (stats, failed) =
        sharded_micro_batches(engine, model, vars, comm, batch, mb, 2, |comm, turn| {
            let grads = match turn {
                Turn::Ran(g) => Some(g),
                Turn::Failed | Turn::Idle => None,
            };
            crate::zero::scatter_grads(comm, opt, grads, &mut shard)
        })?;
    let squares: f64 = shard.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let norm = sharded_norm(comm, mb, 2, squares, failed, || {
        Ok(shard
            .iter()
            .position(|x| !x.is_finite())
            .and_then(|i| opt.owned_name_at(i))
            .map(str::to_string))
    })?;
    Ok(Accumulated {
        grads: Summed::Owned(shard),
        norm,
        stats,
    })
}

/// ZeRO stage 3: every micro-batch is a training pass of the sharded model, whose backward
/// reduce-scatters each layer's gradients as it goes, so a rank only ever holds its pieces of
/// the summed gradient (and one layer's whole gradients at a time). A rank without the
/// micro-batch (or with no valid token in it) joins the others' pass with an idle one.
fn accumulate_zero3<T: Train>(
    engine: &T,
    model: &Model,
    vars: &[(String, Var)],
    comm: &mut dyn Communicator,
    batch: &T::Batch,
    mb: &MiniBatch<'_>,
) -> Result<Accumulated> {
    let z = model
        .zero3()
        .ok_or_else(|| Error::internal("ZeRO-3 accumulation on a model that is not sharded"))?;
    // What a failed update left behind belongs to no step.
    z.clear_grads()?;
    // A pass that ran left its gradients with the model; the others are idle passes.
    let (stats, failed) = sharded_micro_batches(
        engine,
        model,
        vars,
        comm,
        batch,
        mb,
        3,
        |_, turn| match turn {
            Turn::Ran(_) | Turn::Failed => Ok(()),
            Turn::Idle => Ok(model.zero3_idle_pass()?),
        },
    )?;
    let norm = sharded_norm(comm, mb, 3, z.local_grad_squares()?, failed, || {
        Ok(z.non_finite_grad()?)
    })?;
    Ok(Accumulated {
        grads: Summed::Whole(z.take_grads()?),
        norm,
        stats,
    })
}

/// Sums gradients over the group. Parameters without a gradient on a rank count as zeros,
/// so every rank (and a single rank) steps the same parameter set. `failed` travels along:
/// the second value is the number of ranks that reported a failure.
pub fn all_reduce_grads(
    grads: &Gradients,
    vars: &[(String, Var)],
    comm: &mut dyn Communicator,
    failed: bool,
) -> Result<(Gradients, usize)> {
    if comm.world_size() <= 1 {
        // Nothing to sum: the gradients stay where they are (on a GPU, no round trip through
        // host memory every step).
        let mut store = GradStore::default();
        for (name, var) in vars {
            let g = match grads.get(name) {
                Some(g) => g.to_dtype(var.dtype())?,
                None => var.zeros_like()?,
            };
            store.insert(var.as_tensor(), g);
        }
        return Ok((Gradients::from_store(&store, vars), 0));
    }
    let mut host: Vec<Vec<f32>> = Vec::with_capacity(vars.len());
    for (name, var) in vars {
        match grads.get(name) {
            Some(g) => host.push(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => host.push(vec![0.0; var.elem_count()]),
        }
    }
    let mut flag = [f32::from(u8::from(failed))];
    if comm.world_size() > 1 {
        let mut parts: Vec<&mut [f32]> = host.iter_mut().map(|v| v.as_mut_slice()).collect();
        parts.push(&mut flag);
        all_reduce_f32_bucketed(comm, &mut parts, ReduceOp::Sum, GRAD_BUCKET_ELEMS)
            .ctx("all-reducing gradients")?;
    }
    let failures = flag[0].round() as usize - usize::from(failed);
    let mut store = GradStore::default();
    for ((_, var), v) in vars.iter().zip(host) {
        let t = Tensor::from_vec(v, var.shape(), var.device())?.to_dtype(var.dtype())?;
        store.insert(var.as_tensor(), t);
    }
    Ok((Gradients::from_store(&store, vars), failures))
}
