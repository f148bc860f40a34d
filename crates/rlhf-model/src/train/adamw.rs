//! AdamW with decoupled weight decay, as PyTorch computes it: moments in f32, stepped in one
//! fused host loop for f32 parameters on the CPU (in place, no copies) or where the state is
//! offloaded, with tensor ops elsewhere; optionally only this rank's share of the
//! parameters (ZeRO stages 1 and 2, `super::zero`), stepped from whole gradients or from
//! this rank's share of them.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var};

use super::step::{step_slot, Grad, StepScalars};
use super::zero::{self, partition};
use super::Gradients;
use crate::error::{Error, Result};

/// AdamW hyper-parameters (torch defaults except weight decay).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Apply weight decay to 1-D parameters (biases, norm weights) too.
    pub decay_1d: bool,
    /// Keep the moments in host memory and step there (`training.offload_optimizer`): the
    /// accelerator keeps only the parameters; each step brings the gradient to the host and
    /// the updated parameter back. f32 parameters on the CPU are stepped so anyway.
    pub host_state: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decay_1d: false,
            host_state: false,
        }
    }
}

/// First and second moments: plain vectors for f32 parameters on CPU (updated in one fused
/// loop), tensors elsewhere.
pub(super) enum Moments {
    Host { m: Vec<f32>, v: Vec<f32> },
    Device { m: Tensor, v: Tensor },
}

pub(super) struct Slot {
    pub(super) name: String,
    pub(super) var: Var,
    pub(super) moments: Moments,
    pub(super) decay: bool,
    /// The elements of the flattened parameter this optimizer steps (all of them, unless the
    /// state is sharded across data-parallel ranks: `zero_stage`); the moments cover only
    /// these.
    pub(super) owned: std::ops::Range<usize>,
}

/// AdamW with decoupled weight decay (Loshchilov & Hutter), moments kept in f32.
pub struct AdamW {
    pub(super) slots: Vec<Slot>,
    pub(super) cfg: AdamWConfig,
    pub(super) step: usize,
    /// `(rank, world)` when the state is sharded ([`AdamW::new_sharded`]).
    pub(super) shard: Option<(usize, usize)>,
    /// The elements of the flattened parameters (laid end to end) this optimizer owns.
    pub(super) span: std::ops::Range<usize>,
    /// Over a ZeRO-3 model's pieces: the elements of the whole parameters.
    pub(super) whole: Option<usize>,
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        Self::new_sharded(vars, cfg, 0, 1)
    }

    /// AdamW whose state covers only this rank's share of the parameters (ZeRO stage 1):
    /// the flattened parameters, end to end, cut into `world` contiguous ranges of equal
    /// size ([`partition`]); rank `rank` keeps the moments of its range and steps only those
    /// elements. The group then exchanges the stepped ranges (`crate`'s caller does, with its
    /// communicator). `world` 1 is the ordinary optimizer.
    pub fn new_sharded(
        vars: Vec<(String, Var)>,
        cfg: AdamWConfig,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        let vars: Vec<(String, Var)> = vars
            .into_iter()
            .filter(|(_, v)| v.dtype().is_float())
            .collect();
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "cannot shard an optimizer as rank {rank} of {world}"
            )));
        }
        let sizes: Vec<usize> = vars.iter().map(|(_, v)| v.elem_count()).collect();
        let ranges = partition(&sizes, rank, world);
        let span = zero::span(sizes.iter().sum(), rank, world);
        let mut slots = Vec::with_capacity(vars.len());
        for ((name, var), owned) in vars.into_iter().zip(ranges) {
            let n = owned.len();
            let host = var.device().is_cpu() && var.dtype() == DType::F32;
            let moments = if host || cfg.host_state {
                Moments::Host {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                }
            } else {
                let m = Tensor::zeros(n, DType::F32, var.device())?;
                Moments::Device { v: m.clone(), m }
            };
            let decay = cfg.decay_1d || var.rank() > 1;
            slots.push(Slot {
                name,
                var,
                moments,
                decay,
                owned,
            });
        }
        Ok(Self {
            slots,
            cfg,
            step: 0,
            shard: (world > 1).then_some((rank, world)),
            span,
            whole: None,
        })
    }

    /// Whether every parameter's moments live in host memory (f32 on the CPU, or
    /// [`AdamWConfig::host_state`]).
    pub fn moments_on_host(&self) -> bool {
        self.slots
            .iter()
            .all(|s| matches!(s.moments, Moments::Host { .. }))
    }

    /// `(rank, world)` of a sharded optimizer, `None` for one holding every parameter's state.
    pub fn shard(&self) -> Option<(usize, usize)> {
        self.shard
    }

    pub fn learning_rate(&self) -> f64 {
        self.cfg.lr
    }

    pub fn set_learning_rate(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    /// Number of steps taken.
    pub fn steps(&self) -> usize {
        self.step
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// One update; parameters without a gradient are left alone (their moments do not move).
    pub fn step(&mut self, grads: &Gradients) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    /// [`AdamW::step`] on `grad_scale` times the gradients (global-norm clipping without a
    /// second copy of them, see [`Gradients::clip_factor`]).
    pub fn step_scaled(&mut self, grads: &Gradients, grad_scale: f64) -> Result<()> {
        self.step_with(grad_scale, |s, _| Ok(grads.get(&s.name).map(Grad::Full)))
    }

    /// [`AdamW::step_scaled`] on gradients given for this optimizer's elements only
    /// ([`AdamW::owned_span`], parameter after parameter): what ZeRO stage 2's
    /// reduce-scatter leaves on a rank, so no rank ever holds the whole reduced gradient.
    /// Every owned element has a gradient (zeros where a parameter got none).
    pub fn step_owned(&mut self, grads: &[f32], grad_scale: f64) -> Result<()> {
        if grads.len() != self.owned_len() {
            return Err(Error::InvalidArgument(format!(
                "{} gradient values for the {} elements this optimizer owns",
                grads.len(),
                self.owned_len()
            )));
        }
        self.step_with(grad_scale, |s, off| {
            Ok(Some(Grad::Owned(&grads[off..off + s.owned.len()])))
        })
    }

    /// One step; `grad_of(slot, offset of its owned elements among all owned ones)` gives
    /// each parameter's gradient, or `None` to leave it alone.
    fn step_with<'g>(
        &mut self,
        grad_scale: f64,
        mut grad_of: impl FnMut(&Slot, usize) -> Result<Option<Grad<'g>>>,
    ) -> Result<()> {
        // Moments offloaded while the device generated come back first.
        self.reload()?;
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg.clone();
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let mut off = 0;
        for s in self.slots.iter_mut() {
            let at = off;
            off += s.owned.len();
            let Some(g) = grad_of(s, at)? else {
                continue;
            };
            if s.owned.is_empty() {
                continue;
            }
            let decay = if s.decay { c.weight_decay } else { 0.0 };
            let k = StepScalars {
                lr: c.lr as f32,
                beta1: c.beta1 as f32,
                beta2: c.beta2 as f32,
                one_minus_beta1: (1.0 - c.beta1) as f32,
                one_minus_beta2: (1.0 - c.beta2) as f32,
                eps: c.eps as f32,
                decay_factor: (1.0 - c.lr * decay) as f32,
                inv_bc1: (1.0 / bc1) as f32,
                inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
                grad_scale: grad_scale as f32,
            };
            step_slot(s, g, k, &c, decay, (bc1, bc2), grad_scale)?;
        }
        Ok(())
    }

    /// Optimizer state as named tensors (`exp_avg.NAME`, `exp_avg_sq.NAME`) plus the step
    /// count, for checkpoints. A snapshot: host moments are copied, and device moments are
    /// replaced by every step, never written in place.
    pub fn state(&self) -> Result<(Vec<(String, Tensor)>, usize)> {
        if let Some((rank, world)) = self.shard {
            return Err(Error::InvalidArgument(format!(
                "this optimizer holds rank {rank}'s share of {world}; its group saves the shares (AdamW::owned_moments) and loads them back (AdamW::load_owned_moments)"
            )));
        }
        let mut out = Vec::with_capacity(self.slots.len() * 2);
        for s in &self.slots {
            let (m, v) = match &s.moments {
                // Host moments stay on the host (no copy to the accelerator for a save).
                Moments::Host { m, v } => (
                    Tensor::from_vec(m.clone(), s.var.shape(), &candle_core::Device::Cpu)?,
                    Tensor::from_vec(v.clone(), s.var.shape(), &candle_core::Device::Cpu)?,
                ),
                Moments::Device { m, v } => (m.reshape(s.var.shape())?, v.reshape(s.var.shape())?),
            };
            out.push((format!("exp_avg.{}", s.name), m));
            out.push((format!("exp_avg_sq.{}", s.name), v));
        }
        Ok((out, self.step))
    }

    /// Writes the optimizer state (moments and step) to a safetensors file, for resuming.
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        let (tensors, step) = self.state()?;
        Self::write_state(&tensors, step, path)
    }

    /// Writes a state taken by [`AdamW::state`] (a copy: it can be written by another thread
    /// while this optimizer steps on), in [`AdamW::save`]'s format.
    pub fn write_state(
        tensors: &[(String, Tensor)],
        step: usize,
        path: &std::path::Path,
    ) -> Result<()> {
        crate::weights::save_safetensors_with_metadata(
            tensors,
            &[
                ("step", step.to_string()),
                ("optimizer", "adamw".to_string()),
            ],
            path,
        )
    }

    /// Restores a state written by [`AdamW::save`]; every parameter must be present with its
    /// shape.
    pub fn load(&mut self, path: &std::path::Path) -> Result<()> {
        let device = self
            .slots
            .first()
            .map(|s| s.var.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let (tensors, meta) = crate::weights::load_safetensors(path, &device)?;
        let step = meta
            .get("step")
            .and_then(|s| s.parse::<usize>().ok())
            .ok_or_else(|| Error::Json {
                path: path.to_path_buf(),
                message: "no step in the metadata: not an optimizer state written by AdamW::save"
                    .to_string(),
            })?;
        self.load_state(&tensors, step)
    }

    /// Restores a state produced by [`AdamW::state`].
    pub fn load_state(&mut self, tensors: &[(String, Tensor)], step: usize) -> Result<()> {
        let map: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        for s in self.slots.iter_mut() {
            let get = |prefix: &str| -> Result<Tensor> {
                let key = format!("{prefix}.{}", s.name);
                let t = map.get(key.as_str()).ok_or_else(|| Error::MissingTensor {
                    name: key.clone(),
                    location: "the optimizer state".to_string(),
                })?;
                if t.dims() != s.var.dims() {
                    return Err(Error::ShapeMismatch {
                        name: key,
                        expected: s.var.dims().to_vec(),
                        found: t.dims().to_vec(),
                    });
                }
                let (a, n) = (s.owned.start, s.owned.len());
                Ok(t.to_dtype(DType::F32)?
                    .flatten_all()?
                    .narrow(0, a, n)?
                    .to_device(s.var.device())?)
            };
            let (m, v) = (get("exp_avg")?, get("exp_avg_sq")?);
            s.moments = match s.moments {
                Moments::Host { .. } => Moments::Host {
                    m: m.flatten_all()?.to_vec1::<f32>()?,
                    v: v.flatten_all()?.to_vec1::<f32>()?,
                },
                Moments::Device { .. } => Moments::Device { m, v },
            };
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_matches_hand_computed_steps() -> Result<()> {
        // f32 uses the fused host loop, f64 the tensor path, and f64 with host_state
        // (`training.offload_optimizer`) the host loop through f32 and back.
        for (dtype, host) in [(DType::F32, false), (DType::F64, false), (DType::F64, true)] {
            adamw_case(dtype, host)?;
        }
        Ok(())
    }

    #[test]
    fn adamw_first_step_moves_each_weight_by_exactly_lr() -> Result<()> {
        // After one step m_hat = g and v_hat = g^2, so with eps ~ 0 every weight moves by lr
        // against its gradient's sign. With `1 - beta2` rounded in f32 the step came out
        // 6.4e-6 too large; PyTorch's is exact to f32 rounding (~1e-7).
        let var = Var::from_tensor(&Tensor::new(&[[0.0f32, 0.0, 0.0]], &Device::Cpu)?)?;
        let cfg = AdamWConfig {
            lr: 1.0,
            eps: 1e-30,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(vec![("w".into(), var.clone())], cfg)?;
        let mut grads = Gradients::default();
        grads.grads.insert(
            "w".into(),
            Tensor::new(&[[0.5f32, -3.0, 1e-3]], &Device::Cpu)?,
        );
        opt.step(&grads)?;
        let got = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        for (g, want) in got.iter().zip([-1.0f32, 1.0, -1.0]) {
            assert!((g - want).abs() < 1e-6, "{got:?}");
        }
        Ok(())
    }

    fn adamw_case(dtype: DType, host_state: bool) -> Result<()> {
        // Scalar reference computed by hand from the torch.optim.AdamW update rule.
        let var = Var::from_tensor(
            &Tensor::new(&[1.0f32, -2.0], &Device::Cpu)?
                .reshape((1, 2))?
                .to_dtype(dtype)?,
        )?;
        let cfg = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.5,
            host_state,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(vec![("w".into(), var.clone())], cfg.clone())?;
        assert_eq!(opt.moments_on_host(), dtype == DType::F32 || host_state);
        let mut p = [1.0f64, -2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for t in 1..=3 {
            let g = [0.5 * t as f64, -1.0];
            let mut grads = Gradients::default();
            grads.grads.insert(
                "w".into(),
                Tensor::new(&[g[0] as f32, g[1] as f32], &Device::Cpu)?
                    .reshape((1, 2))?
                    .to_dtype(dtype)?,
            );
            opt.step(&grads)?;
            for i in 0..2 {
                p[i] *= 1.0 - cfg.lr * cfg.weight_decay;
                m[i] = 0.9 * m[i] + 0.1 * g[i];
                v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i];
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let vh = v[i] / (1.0 - 0.999f64.powi(t));
                p[i] -= cfg.lr * mh / (vh.sqrt() + cfg.eps);
            }
        }
        let got = var
            .as_tensor()
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        for i in 0..2 {
            assert!((got[i] - p[i]).abs() < 1e-5, "{dtype:?}: {got:?} vs {p:?}");
        }
        // The state round-trips through a file.
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let file = dir.path().join("optim.safetensors");
        opt.save(&file)?;
        let twin = Var::from_tensor(&var.as_tensor().copy()?)?;
        let mut restored = AdamW::new(vec![("w".into(), twin.clone())], cfg.clone())?;
        restored.load(&file)?;
        assert_eq!(restored.steps(), 3);
        // Resuming continues exactly: one more identical step on both.
        let mut g = Gradients::default();
        g.grads.insert(
            "w".into(),
            Tensor::new(&[0.3f32, 0.7], &Device::Cpu)?
                .reshape((1, 2))?
                .to_dtype(dtype)?,
        );
        let mut cont = AdamW::new(vec![("w".into(), var.clone())], cfg.clone())?;
        cont.load(&file)?;
        cont.step(&g)?;
        restored.step(&g)?;
        let d = (var.as_tensor() - twin.as_tensor())?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        assert_eq!(d, 0.0);
        let missing = AdamW::new(vec![("other".into(), var.clone())], cfg.clone())?.load(&file);
        assert!(missing.unwrap_err().to_string().contains("exp_avg.other"));
        // The state round-trips through named tensors.
        let (state, steps) = opt.state()?;
        assert_eq!(steps, 3);
        let mut again = AdamW::new(vec![("w".into(), var.clone())], cfg)?;
        again.load_state(&state, steps)?;
        let (state2, _) = again.state()?;
        for ((n1, t1), (n2, t2)) in state.iter().zip(&state2) {
            assert_eq!(n1, n2);
            let d = (t1 - t2)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(d, 0.0);
        }
        Ok(())
    }
}
