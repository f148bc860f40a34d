//! What every trainable engine shares: its state ([`TrainState`]: model, optimizer, plan,
//! version, checkpoint I/O), the [`Train`] capability (prepare a request, then a
//! `micro_loss` per micro-batch), and the data-parallel update loop over them: epochs over
//! a rank's shard, mini-batches (one optimizer step each), micro-batches with gradient
//! accumulation, loss denominators and gradients all-reduced across the group so that N
//! ranks on N shards compute the update of one rank on the whole batch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rlhf_algo::LossAggMode;
use rlhf_collective::{Communicator, ReduceOp};
use rlhf_config::TrainSpec;
use rlhf_core::calls::{RoleCall, UpdateResponse};
use rlhf_core::RoleSlot;
use rlhf_model::{Gradients, LoadOptions, Model};

pub use crate::accumulate::all_reduce_grads;
use crate::accumulate::{accumulate, MiniBatch, Summed};
use crate::checkpoint::{self, RoleState};
use crate::error::{Ctx, Error, Result};
pub use crate::optim::Optim;

/// Who is computing, for error messages.
#[derive(Debug, Clone)]
pub struct Ident {
    pub role: rlhf_core::RoleKind,
    pub rank: usize,
}

impl std::fmt::Display for Ident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.role {
            rlhf_core::RoleKind::ActorRollout => {
                write!(f, "actor_rollout train rank {}", self.rank)
            }
            r => write!(f, "{r} rank {}", self.rank),
        }
    }
}

/// How one update call walks its shard.
#[derive(Debug, Clone)]
pub struct EpochPlan {
    pub epochs: usize,
    /// Rows of this rank per mini-batch (global mini-batch / ranks).
    pub mini_batch_rows: usize,
    pub micro_batch_rows: usize,
    pub shuffle: bool,
    pub seed: u64,
    pub step: u64,
    /// All-reduce the loss denominators across ranks (the contract). Off only to show in
    /// tests what goes wrong without it: each rank then assumes every rank has as many
    /// tokens as itself.
    pub sync_denominators: bool,
}

/// What a micro-batch forward returns.
pub struct MicroOut {
    /// The micro-batch loss aggregated over its own rows with the role's mode.
    pub loss: Tensor,
    /// Diagnostics, averaged over micro-batches weighted by their valid tokens.
    pub stats: Vec<(&'static str, f64)>,
}

/// The loss denominator of some rows under `mode`: valid tokens for token-mean,
/// sequences with at least one valid token for the seq-mean modes.
pub fn denominator(mask: &[f32], width: usize, mode: LossAggMode) -> f64 {
    match mode {
        LossAggMode::TokenMean => mask.iter().filter(|&&m| m != 0.0).count() as f64,
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenMean
        | LossAggMode::SeqMeanTokenSumNorm => mask
            .chunks(width.max(1))
            .filter(|row| row.iter().any(|&m| m != 0.0))
            .count() as f64,
    }
}

/// The factor a micro-batch loss is multiplied by: its own denominator over the global
/// mini-batch's, so that the scaled losses summed over micro-batches and ranks equal the
/// loss of the whole global mini-batch.
pub fn micro_scale(
    micro_mask: &[f32],
    width: usize,
    mode: LossAggMode,
    global: f64,
) -> Result<f64> {
    if global.is_nan() || global <= 0.0 {
        return Err(Error::internal(format!(
            "global loss denominator is {global}; it must be > 0"
        )));
    }
    Ok(denominator(micro_mask, width, mode) / global)
}

/// The shard permutation of one epoch: seeded from the job seed, the PPO step and the
/// epoch only, so every rank walks its shard in the same pattern.
pub fn epoch_order(rows: usize, shuffle: bool, seed: u64, step: u64, epoch: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..rows).collect();
    if shuffle {
        let mix = seed
            ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (epoch as u64 + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        let mut rng = rand::rngs::StdRng::seed_from_u64(mix);
        idx.shuffle(&mut rng);
    }
    idx
}

pub(crate) fn mean_into(
    acc: &mut BTreeMap<String, (f64, f64)>,
    name: &str,
    value: f64,
    weight: f64,
) {
    let e = acc.entry(name.to_string()).or_insert((0.0, 0.0));
    e.0 += value * weight;
    e.1 += weight;
}

/// Names of the per-step metrics of a role.
pub struct StepNames {
    pub grad_norm: &'static str,
    pub lr: &'static str,
    /// `(stat, name)`: also report the unbiased variance of `stat`'s per-mini-batch group
    /// means over the whole update as `name` (TRL's `val/ratio_var`).
    pub variance: Option<(&'static str, &'static str)>,
}

/// What a trainable engine's state holds besides the engine-specific loss settings.
pub struct TrainState {
    pub model: Arc<Model>,
    pub optim: Optim,
    pub who: Ident,
    pub settings: TrainSettings,
    /// The weights version: the driver's step of the last update (and sync).
    pub version: u64,
    /// Copied into checkpoints with the model.
    pub tokenizer_dir: Option<PathBuf>,
    /// How the model was loaded (a checkpoint is loaded the same way).
    pub load_opts: LoadOptions,
}

/// Training settings one trainable engine needs besides its model.
#[derive(Debug, Clone)]
pub struct TrainSettings {
    pub epochs: usize,
    pub mini_batch_rows: usize,
    pub micro_batch_rows: usize,
    pub shuffle: bool,
    pub seed: u64,
    /// See [`EpochPlan::sync_denominators`].
    pub sync_denominators: bool,
}

impl TrainSettings {
    pub fn from_spec(t: &TrainSpec, micro_batch_rows: usize, seed: u64) -> Self {
        Self {
            epochs: t.epochs,
            mini_batch_rows: t.mini_batch_rows,
            micro_batch_rows,
            shuffle: t.shuffle,
            seed,
            sync_denominators: true,
        }
    }

    fn plan(&self, step: u64) -> EpochPlan {
        EpochPlan {
            epochs: self.epochs,
            mini_batch_rows: self.mini_batch_rows,
            micro_batch_rows: self.micro_batch_rows,
            shuffle: self.shuffle,
            seed: self.seed,
            step,
            sync_denominators: self.sync_denominators,
        }
    }
}

impl TrainState {
    /// Loads the trainable model of `slot` from `dir` with AdamW and the schedule of `t`.
    pub fn load(
        slot: &RoleSlot,
        dir: &Path,
        load_opts: LoadOptions,
        t: &TrainSpec,
        micro_batch_rows: usize,
        seed: u64,
        tokenizer_dir: Option<PathBuf>,
    ) -> Result<Self> {
        let zero3 = t.optimizer.zero_stage >= 3;
        let (rank, world) = (slot.rank as usize, slot.world_size as usize);
        let mut pieces = None;
        let model = if zero3 {
            // ZeRO-3: each rank reads only its pieces of the parameters out of the files, so
            // neither the device nor host memory ever holds the whole model; the group's
            // communicator is lent to the model for each update, save and load
            // (`crate::zero::lend`).
            Model::load_zero3(dir, &load_opts, rank, world, t.optimizer.offload_params).with_ctx(
                || {
                    format!(
                        "{}: loading {} sharded (training.zero_stage 3)",
                        slot.label(),
                        dir.display()
                    )
                },
            )?
        } else {
            Model::load(dir, &load_opts)
                .with_ctx(|| format!("{}: loading {}", slot.label(), dir.display()))?
        };
        if zero3 {
            let z = model
                .zero3()
                .ok_or_else(|| Error::internal("the sharded model has no ZeRO-3 state"))?;
            let (held, total) = z.sizes()?;
            tracing::info!(
                "{}: parameters, gradients and AdamW state sharded (training.zero_stage 3), rank {rank} of {world}: {held} of {total} parameter elements",
                slot.label()
            );
            pieces = Some(z.trained_len()?);
        }
        let optim = Optim::new(
            model.vars(),
            &t.optimizer,
            t.steps_per_iter,
            (rank, world),
            pieces,
        )?;
        crate::mem::release_freed();
        if let (Some((rank, world)), None) = (optim.opt.shard(), pieces) {
            tracing::info!(
                "{}: AdamW state{} sharded (training.zero_stage {}), rank {rank} of {world}: {} of {} parameter elements",
                slot.label(),
                if optim.zero_stage >= 2 { " and summed gradients" } else { "" },
                optim.zero_stage,
                optim.opt.owned_len(),
                optim.opt.total_len()
            );
        }
        Ok(Self {
            model: Arc::new(model),
            optim,
            who: Ident {
                role: slot.kind,
                rank: slot.rank as usize,
            },
            settings: TrainSettings::from_spec(t, micro_batch_rows, seed),
            version: 0,
            tokenizer_dir,
            load_opts,
        })
    }

    pub fn checksum(&self) -> Result<u64> {
        crate::weights::weights_checksum(&self.model)
    }

    /// Copies the checkpoint out; [`checkpoint::Image::write`] writes it.
    /// The checkpoint image, copied out for a writer thread: with a sharded optimizer
    /// (`zero_stage` 1 or 2) this rank's shard, and the weights on rank 0 only.
    /// With `dir` (the checkpoint part it will be written to), a ZeRO-3 model's rank 0
    /// writes the weights beside it as the group gathers them ([`crate::spill`]).
    pub fn capture_checkpoint(&self, dir: Option<&Path>) -> Result<checkpoint::Image> {
        let state = RoleState {
            role: self.who.role,
            scheduler_step: self.optim.steps() as u64,
            weights_version: self.version,
        };
        checkpoint::capture(
            &self.model,
            &self.optim,
            state,
            self.tokenizer_dir.as_deref(),
            dir,
        )
    }

    /// Restores the checkpoint in `dir` and answers the whole model's checksum, the one the
    /// save recorded (a ZeRO-3 model gathers for it: see [`TrainState::load_checkpoint_in`]).
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64> {
        let s = checkpoint::load(&self.model, &mut self.optim, dir, &self.load_opts)?;
        self.version = s.weights_version;
        match self.model.zero3() {
            Some(z) => Ok(z.gathered_checksum()?),
            None => self.checksum(),
        }
    }

    /// [`TrainState::capture_checkpoint`] with the data-parallel group's communicator, which a
    /// ZeRO-3 model borrows to gather its weights (every rank of the group calls this).
    pub fn capture_checkpoint_in(
        &self,
        comm: &mut dyn Communicator,
        dir: Option<&Path>,
    ) -> Result<checkpoint::Image> {
        crate::zero::lend(&self.model, comm, |_| self.capture_checkpoint(dir))
    }

    /// [`TrainState::load_checkpoint`] with the data-parallel group's communicator: a ZeRO-3
    /// model keeps its pieces of the loaded weights and answers the whole model's checksum,
    /// the one the save recorded (every rank of the group calls this).
    pub fn load_checkpoint_in(&mut self, dir: &Path, comm: &mut dyn Communicator) -> Result<u64> {
        let model = self.model.clone();
        crate::zero::lend(&model, comm, |_| self.load_checkpoint(dir))
    }
}

/// A request checked and moved to the device, ready for micro-batches.
pub struct Prepared<B> {
    pub batch: B,
    /// The shard's loss mask on the host, `[rows, width]`.
    pub mask: Vec<f32>,
    pub width: usize,
    pub step: u64,
}

/// A trainable engine: it prepares its update request once, then computes the loss of any
/// rows of it; [`update`] does the rest (epochs, accumulation, collectives, the optimizer).
pub trait Train {
    /// The typed update call.
    type Request: RoleCall<Response = UpdateResponse>;
    /// The request's tensors on the device.
    type Batch;
    /// Metric names of the optimizer step.
    const NAMES: StepNames;

    fn state(&self) -> &TrainState;
    fn state_mut(&mut self) -> &mut TrainState;
    fn agg_mode(&self) -> LossAggMode;
    /// Checks the request (shapes, finiteness at valid positions) and moves it to the device.
    fn prepare(&self, req: &Self::Request) -> Result<Prepared<Self::Batch>>;
    /// The loss of `rows` of the prepared batch, aggregated over those rows, with stats.
    fn micro_loss(&self, model: &Model, batch: &Self::Batch, rows: &[usize]) -> Result<MicroOut>;
}

/// One update call of a trainable engine. A request this rank refuses (bad shape, NaN input)
/// fails the whole group's call instead of leaving the other ranks in a collective.
pub fn update<T: Train>(
    engine: &mut T,
    comm: &mut dyn Communicator,
    req: &T::Request,
) -> Result<UpdateResponse> {
    let who = engine.state().who.clone();
    let call = T::Request::CALL.name();
    let prepared = match engine.prepare(req) {
        Ok(p) => p,
        Err(e) => {
            return Err(abort_update(comm, e)).with_ctx(|| format!("{who} {call}"));
        }
    };
    let metrics = crate::zero::lend(&engine.state().model.clone(), comm, |c| {
        run_update(engine, c, &prepared)
    })
    .with_ctx(|| format!("{who} {call}"));
    let step = prepared.step;
    drop(prepared);
    crate::mem::release_freed();
    let metrics = metrics?;
    engine.state_mut().version = step;
    Ok(UpdateResponse { metrics })
}

/// Runs the epochs of one update call over a prepared shard.
pub fn run_update<T: Train>(
    engine: &mut T,
    comm: &mut dyn Communicator,
    prepared: &Prepared<T::Batch>,
) -> Result<BTreeMap<String, f64>> {
    let (mask, width) = (&prepared.mask[..], prepared.width);
    let model = engine.state().model.clone();
    let who = engine.state().who.clone();
    let plan = engine.state().settings.plan(prepared.step);
    let mode = engine.agg_mode();
    let names = &T::NAMES;
    let rows = mask.len() / width.max(1);
    if plan.mini_batch_rows == 0 || plan.micro_batch_rows == 0 || plan.epochs == 0 {
        return Err(Error::invalid(format!(
            "{} rank {}: mini-batch rows ({}), micro-batch rows ({}) and epochs ({}) must be > 0",
            who.role, who.rank, plan.mini_batch_rows, plan.micro_batch_rows, plan.epochs
        )));
    }
    // Every rank must make the same number of collective calls: agree on the number of
    // mini-batches; a rank with fewer rows joins the extra ones with empty mini-batches.
    let local_mbs = rows.div_ceil(plan.mini_batch_rows);
    let mut n = [local_mbs as f64, 0.0];
    comm.all_reduce_f64(&mut n, ReduceOp::Max)
        .ctx("agreeing on the number of mini-batches")?;
    if n[1] > 0.0 {
        return Err(Error::invalid(format!(
            "{} rank {}: another rank of the group refused its shard (see that rank's error)",
            who.role, who.rank
        )));
    }
    let n_mbs = n[0] as usize;
    let vars = model.vars();
    let mut metrics: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut spread: Vec<f64> = Vec::new();
    for epoch in 0..plan.epochs {
        let order = epoch_order(rows, plan.shuffle, plan.seed, plan.step, epoch);
        for mb in 0..n_mbs {
            let start = (mb * plan.mini_batch_rows).min(rows);
            let end = ((mb + 1) * plan.mini_batch_rows).min(rows);
            let idx = &order[start..end];
            let mb_mask: Vec<f32> = idx
                .iter()
                .flat_map(|&r| mask[r * width..(r + 1) * width].iter().copied())
                .collect();
            let local = denominator(&mb_mask, width, mode);
            let global = if plan.sync_denominators {
                let mut d = [local];
                comm.all_reduce_f64(&mut d, ReduceOp::Sum)
                    .ctx("all-reducing the loss denominators")?;
                d[0]
            } else {
                local * comm.world_size() as f64
            };
            if global <= 0.0 {
                // No valid token on any rank: nothing to learn from this mini-batch.
                continue;
            }
            let acc = accumulate(
                &*engine,
                &model,
                &vars,
                comm,
                &prepared.batch,
                &MiniBatch {
                    idx,
                    mask,
                    width,
                    micro_rows: plan.micro_batch_rows,
                    mode,
                    global,
                    who: &who,
                    step: plan.step,
                    dropout_seed: {
                        let mut h = rlhf_types::Checksum::new();
                        for v in [
                            plan.seed,
                            plan.step,
                            epoch as u64,
                            mb as u64,
                            who.rank as u64,
                        ] {
                            h.update_u64(v);
                        }
                        h.finish()
                    },
                },
            )?;
            let norm = acc.norm;
            let optim = &mut engine.state_mut().optim;
            // Clipping scales the gradients inside the step: no rewritten copy of them.
            let clip = if optim.clip_grad > 0.0 {
                Gradients::clip_factor(norm, optim.clip_grad)
            } else {
                1.0
            };
            let lr = optim.sched.lr_at(optim.opt.steps());
            optim.opt.set_learning_rate(lr);
            match &acc.grads {
                Summed::Whole(g) => optim.opt.step_scaled(g, clip)?,
                Summed::Owned(g) => optim.opt.step_owned(g, clip)?,
            }
            drop(acc.grads);
            if optim.opt.shard().is_some() && optim.zero_stage < 3 {
                crate::zero::exchange_params(comm, &mut optim.opt)?;
            }
            // Every rank reports the mini-batch's token-weighted metrics over the whole group,
            // so the numbers do not depend on how the batch was split across ranks.
            let mb_stats = if comm.world_size() > 1 {
                merge_stats(comm, &acc.stats)?
            } else {
                acc.stats
            };
            for (k, (sum, w)) in mb_stats {
                if w > 0.0 {
                    if names.variance.is_some_and(|(stat, _)| stat == k) {
                        spread.push(sum / w);
                    }
                    mean_into(&mut metrics, &k, sum / w, 1.0);
                }
            }
            mean_into(&mut metrics, names.grad_norm, norm, 1.0);
            mean_into(&mut metrics, names.lr, lr, 1.0);
        }
    }
    let mut out: BTreeMap<String, f64> = metrics
        .into_iter()
        .map(|(k, (s, w))| (k, if w > 0.0 { s / w } else { 0.0 }))
        .collect();
    if let (Some((_, name)), true) = (names.variance, spread.len() >= 2) {
        let n = spread.len() as f64;
        let mean = spread.iter().sum::<f64>() / n;
        let ss: f64 = spread.iter().map(|x| (x - mean) * (x - mean)).sum();
        out.insert(name.to_string(), ss / (n - 1.0));
    }
    Ok(out)
}

/// Sums `(weighted sum, weight)` metric pairs over the group (ranks may lack keys).
fn merge_stats(
    comm: &mut dyn Communicator,
    mine: &BTreeMap<String, (f64, f64)>,
) -> Result<BTreeMap<String, (f64, f64)>> {
    let bytes = serde_json::to_vec(mine)
        .map_err(|e| Error::internal(format!("encoding update metrics: {e}")))?;
    let all = comm
        .all_gather(&bytes)
        .ctx("gathering the update metrics of the group")?;
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for b in all {
        let m: BTreeMap<String, (f64, f64)> = serde_json::from_slice(&b)
            .map_err(|e| Error::internal(format!("decoding a rank's update metrics: {e}")))?;
        for (k, (sum, w)) in m {
            let e = out.entry(k).or_insert((0.0, 0.0));
            e.0 += sum;
            e.1 += w;
        }
    }
    Ok(out)
}

/// Fails an update call collectively: makes the first collective of [`run_update`] with a
/// failure flag, so the other ranks of the group stop too instead of waiting for this one.
pub fn abort_update(comm: &mut dyn Communicator, error: Error) -> Error {
    let mut n = [0.0, 1.0];
    if comm.world_size() > 1 {
        if let Err(e) = comm.all_reduce_f64(&mut n, ReduceOp::Max) {
            tracing::warn!("telling the group about a failed update: {e}");
        }
    }
    error
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks with unequal token counts: scaling by the all-reduced denominator makes
    /// the summed micro-batch losses equal the global token mean; assuming every rank has
    /// as many tokens as this one (no all-reduce) does not.
    #[test]
    fn denominator_all_reduce_is_what_makes_ranks_add_up() {
        let width = 4;
        // rank 0: rows with 4 and 1 valid tokens; rank 1: rows with 2 and 0.
        let m0 = [1., 1., 1., 1., 1., 0., 0., 0.];
        let m1 = [1., 1., 0., 0., 0., 0., 0., 0.];
        let l0 = [1., 2., 3., 4., 5., 0., 0., 0.];
        let l1 = [6., 7., 0., 0., 0., 0., 0., 0.];
        let masked_mean = |l: &[f64], m: &[f32]| {
            let n: f64 = m.iter().map(|&x| x as f64).sum();
            l.iter().zip(m).map(|(a, &b)| a * b as f64).sum::<f64>() / n
        };
        let want = (1. + 2. + 3. + 4. + 5. + 6. + 7.) / 7.0;
        let d0 = denominator(&m0, width, LossAggMode::TokenMean);
        let d1 = denominator(&m1, width, LossAggMode::TokenMean);
        assert_eq!((d0, d1), (5.0, 2.0));
        let global = d0 + d1;
        let got = masked_mean(&l0, &m0)
            * micro_scale(&m0, width, LossAggMode::TokenMean, global).unwrap()
            + masked_mean(&l1, &m1)
                * micro_scale(&m1, width, LossAggMode::TokenMean, global).unwrap();
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        // Without the all-reduce each rank guesses global = local * world size.
        let naive = masked_mean(&l0, &m0)
            * micro_scale(&m0, width, LossAggMode::TokenMean, d0 * 2.0).unwrap()
            + masked_mean(&l1, &m1)
                * micro_scale(&m1, width, LossAggMode::TokenMean, d1 * 2.0).unwrap();
        assert!((naive - want).abs() > 0.1, "{naive} vs {want}");
        // seq-mean counts sequences with tokens: 2 on rank 0, 1 on rank 1.
        assert_eq!(denominator(&m0, width, LossAggMode::SeqMeanTokenMean), 2.0);
        assert_eq!(denominator(&m1, width, LossAggMode::SeqMeanTokenSum), 1.0);
        assert!(micro_scale(&m0, width, LossAggMode::TokenMean, 0.0).is_err());
    }

    #[test]
    fn epoch_order_depends_on_step_and_epoch_not_rank() {
        let a = epoch_order(16, true, 7, 3, 0);
        assert_eq!(a, epoch_order(16, true, 7, 3, 0));
        assert_ne!(a, epoch_order(16, true, 7, 3, 1));
        assert_ne!(a, epoch_order(16, true, 7, 4, 0));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..16).collect::<Vec<_>>());
        assert_eq!(epoch_order(5, false, 7, 3, 0), vec![0, 1, 2, 3, 4]);
    }
}
