//! The optimizer side of a trainable role: AdamW (whole, offloaded to host memory, or this
//! rank's share under ZeRO stages 1 and 2) and its learning-rate schedule, from the role's resolved
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
    /// the summed gradient (`crate::accumulate`).
    pub zero_stage: u32,
}

impl Optim {
    /// AdamW and the schedule from the role's training config; `steps_per_iter` optimizer
    /// steps happen per PPO step (epochs x mini-batches), so the schedule spans
    /// `train_iters * steps_per_iter` optimizer steps and the warm-up counts optimizer steps.
    /// With `training.zero_stage` 1 or 2 the AdamW state is this rank's share of the group's
    /// (`rank` of `world`, [`crate::zero`]).
    pub fn new(
        vars: Vec<(String, Var)>,
        t: &TrainingConfig,
        steps_per_iter: usize,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        let (rank, world) = if t.zero_stage >= 1 {
            (rank, world)
        } else {
            (0, 1)
        };
        let opt = AdamW::new_sharded(
            vars,
            AdamWConfig {
                lr: t.lr,
                beta1: t.adam_beta1,
                beta2: t.adam_beta2,
                eps: t.adam_eps,
                weight_decay: t.weight_decay,
                decay_1d: false,
                host_state: t.offload_optimizer,
            },
            rank,
            world,
        )?;
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
        let o = Optim::new(vars.clone(), &t, 1, 1, 2).unwrap();
        assert!(!o.opt.moments_on_host() && o.opt.shard().is_none());
        t.offload_optimizer = true;
        t.zero_stage = 1;
        let o = Optim::new(vars, &t, 1, 1, 2).unwrap();
        assert!(o.opt.moments_on_host());
        assert_eq!(o.opt.shard(), Some((1, 2)));
        assert_eq!(o.opt.owned_len(), 6);
    }
}
