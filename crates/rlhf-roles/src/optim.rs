//! The optimizer side of a trainable role: AdamW (whole, offloaded to host memory, or this
//! rank's share under ZeRO stages 1 to 3) and its learning-rate schedule, from the role's resolved
//! `training` section.

use candle_core::Var;
use rlhf_config::{LrDecayStyle, TrainingConfig};
use rlhf_model::{AdamW, AdamWConfig, LrSchedule, LrScheduler};

use crate::error::Result;

/// The optimizer side of a trainable role.
pub struct Optim {
    pub opt: AdamW,
    pub sched: LrScheduler,
    pub clip_grad: f64,
    /// `training.zero_stage`: with a sharded `opt`, 2 also keeps only this rank's share of
    /// the summed gradient (`crate::accumulate`); 3 also shards the model's parameters, and
    /// `opt` steps this rank's pieces of them.
    pub zero_stage: u32,
}

impl Optim {
    /// AdamW and the schedule from the role's training config; `steps_per_iter` optimizer
    /// steps happen per PPO step (epochs x mini-batches), so the schedule spans
    /// `train_iters * steps_per_iter` optimizer steps and the warm-up counts optimizer steps.
    /// With `training.zero_stage` 1 or 2 the AdamW state is this rank's share of the group's
    /// (`rank` of `world`, [`crate::zero`]). With 3, `pieces` is the whole parameters' element
    /// count and `vars` are this rank's pieces of them (a sharded model's variables).
    pub fn new(
        vars: Vec<(String, Var)>,
        t: &TrainingConfig,
        steps_per_iter: usize,
        (rank, world): (usize, usize),
        pieces: Option<usize>,
    ) -> Result<Self> {
        let cfg = AdamWConfig {
            lr: t.lr,
            beta1: t.adam_beta1,
            beta2: t.adam_beta2,
            eps: t.adam_eps,
            weight_decay: t.weight_decay,
            decay_1d: false,
            host_state: t.offload_optimizer,
        };
        let opt = match pieces {
            Some(total) => AdamW::new_pieces(vars, cfg, rank, world, total)?,
            None if t.zero_stage >= 1 => AdamW::new_sharded(vars, cfg, rank, world)?,
            None => AdamW::new(vars, cfg)?,
        };
        let schedule = match t.lr_decay_style {
            LrDecayStyle::Constant => LrSchedule::Constant,
            LrDecayStyle::Linear => LrSchedule::Linear,
            LrDecayStyle::Cosine => LrSchedule::Cosine {
                min_lr_ratio: if t.lr > 0.0 { t.min_lr / t.lr } else { 0.0 },
            },
        };
        let total = (t.train_iters as usize).saturating_mul(steps_per_iter.max(1));
        let sched = LrScheduler::new(t.lr, t.lr_warmup_iters as usize, total, schedule);
        Ok(Self {
            opt,
            sched,
            clip_grad: t.clip_grad,
            zero_stage: t.zero_stage,
        })
    }

    /// Optimizer steps taken (the scheduler position).
    pub fn steps(&self) -> usize {
        self.opt.steps()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// `training.offload_optimizer` and `training.zero_stage` reach AdamW: moments in host
    /// memory for parameters that would keep them beside them (f64 here, a GPU in use), and
    /// a share of them per rank.
    #[test]
    fn optimizer_keys_reach_adamw() {
        let var = Var::from_tensor(
            &candle_core::Tensor::zeros((4, 3), DType::F64, &candle_core::Device::Cpu).unwrap(),
        )
        .unwrap();
        let vars = vec![("w".to_string(), var)];
        let mut t = TrainingConfig::default();
        let o = Optim::new(vars.clone(), &t, 1, (1, 2), None).unwrap();
        assert!(!o.opt.moments_on_host() && o.opt.shard().is_none());
        t.offload_optimizer = true;
        t.zero_stage = 1;
        let o = Optim::new(vars, &t, 1, (1, 2), None).unwrap();
        assert!(o.opt.moments_on_host());
        assert_eq!(o.opt.shard(), Some((1, 2)));
        assert_eq!(o.opt.owned_len(), 6);
    }
}
