//! Training utilities: gradients by parameter name, accumulation over micro-batches, global-norm
//! clipping, AdamW with decoupled weight decay, and learning-rate schedules.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};

mod offload;
mod zero;

pub use zero::{partition, span as shard_span};

/// `acc + t`, or `t` when nothing was summed yet: how gradients pile up.
pub(crate) fn add_to(acc: Option<Tensor>, t: Tensor) -> candle_core::Result<Tensor> {
    match acc {
        Some(a) => a + t,
        None => Ok(t),
    }
}

/// `a += b` in place for f32 CPU tensors laid out the same way over the whole of their
/// storage (contiguous, or a transposed weight gradient): how micro-batch gradients pile up
/// without a new tensor per parameter. Any other case is an error, and the caller adds out
/// of place.
struct AddAssign;

impl candle_core::InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "grad-add-assign"
    }

    fn cpu_fwd(
        &self,
        s1: &mut candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage as S;
        let (S::F32(a), S::F32(b)) = (s1, s2) else {
            candle_core::bail!("grad-add-assign: f32 expected");
        };
        let n = l1.shape().elem_count();
        if l1.dims() != l2.dims()
            || l1.stride() != l2.stride()
            || l1.start_offset() != 0
            || l2.start_offset() != 0
            || a.len() != n
            || b.len() != n
        {
            candle_core::bail!("grad-add-assign: layouts differ");
        }
        for (x, y) in a.iter_mut().zip(b.iter()) {
            *x += *y;
        }
        Ok(())
    }
}

/// Gradients keyed by parameter name.
#[derive(Debug, Clone, Default)]
pub struct Gradients {
    grads: BTreeMap<String, Tensor>,
}

impl Gradients {
    /// Picks the gradients of `vars` out of a backward pass; parameters without one are absent.
    pub fn from_store(store: &GradStore, vars: &[(String, Var)]) -> Self {
        let grads = vars
            .iter()
            .filter_map(|(n, v)| store.get(v.as_tensor()).map(|g| (n.clone(), g.clone())))
            .collect();
        Self { grads }
    }

    /// Runs backward on `loss` and collects the gradients of `vars`, with those that
    /// checkpointed layers computed on the side (see [`crate::checkpoint`]). Models built with
    /// `gradient_checkpointing` must be differentiated through here (or [`GradAccumulator`]),
    /// not with a bare `loss.backward()`.
    pub fn backward(loss: &Tensor, vars: &[(String, Var)]) -> Result<Self> {
        // Anything a failed earlier backward left parked belongs to no loss: drop it.
        for (_, var) in vars {
            crate::checkpoint::take(var.as_tensor())?;
        }
        let store = loss.backward()?;
        let mut out = Self::from_store(&store, vars);
        for (name, var) in vars {
            if let Some(g) = crate::checkpoint::take(var.as_tensor())? {
                let sum = add_to(out.grads.remove(name), g)?;
                out.grads.insert(name.clone(), sum);
            }
        }
        Ok(out)
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.grads.get(name)
    }

    pub fn len(&self) -> usize {
        self.grads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.grads.iter()
    }

    /// Names of `vars` that received no gradient.
    pub fn missing(&self, vars: &[(String, Var)]) -> Vec<String> {
        vars.iter()
            .filter(|(n, _)| !self.grads.contains_key(n))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Fails naming the first parameter whose gradient has a NaN or an infinity.
    pub fn check_finite(&self) -> Result<()> {
        for (n, g) in &self.grads {
            let s = g.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
            let a = g
                .to_dtype(DType::F64)?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?;
            if !s.is_finite() || !a.is_finite() {
                return Err(Error::Gradient(format!(
                    "the gradient of {n} is not finite (NaN or inf)"
                )));
            }
        }
        Ok(())
    }

    /// L2 norm over all gradients.
    pub fn global_norm(&self) -> Result<f64> {
        let mut total = 0.0;
        for g in self.grads.values() {
            total += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        Ok(total.sqrt())
    }

    /// Multiplies every gradient by `factor`.
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        for g in self.grads.values_mut() {
            *g = (&*g * factor)?;
        }
        Ok(())
    }

    /// Scales gradients so that their global norm is at most `max_norm`; returns the norm
    /// before clipping (as torch's `clip_grad_norm_`).
    pub fn clip_global_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.global_norm()?;
        let f = Self::clip_factor(norm, max_norm);
        if f != 1.0 {
            self.scale(f)?;
        }
        Ok(norm)
    }

    /// The factor global-norm clipping scales gradients of norm `norm` by (1 when they are
    /// within `max_norm`): hand it to [`AdamW::step_scaled`] to clip without rewriting
    /// every gradient.
    pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
        if norm.is_finite() && norm > max_norm {
            max_norm / (norm + 1e-6)
        } else {
            1.0
        }
    }

    /// Adds `other` into these gradients, taking its tensors: the first addition copies
    /// nothing. Scale the loss before backward rather than the gradients after it, and no
    /// second copy of every gradient exists at any point.
    pub fn add(&mut self, other: Gradients) -> Result<()> {
        for (n, g) in other.grads {
            let sum = match self.grads.remove(&n) {
                // f32 on the CPU with one layout: summed into the running tensor itself.
                Some(acc) if acc.inplace_op2(&g, &AddAssign).is_ok() => acc,
                acc => add_to(acc, g)?,
            };
            self.grads.insert(n, sum);
        }
        Ok(())
    }
}

/// Sums gradients over micro-batches: call [`GradAccumulator::backward`] once per micro-batch
/// with `scale = 1 / micro_batches` (or the token share), then [`GradAccumulator::take`].
pub struct GradAccumulator {
    vars: Vec<(String, Var)>,
    sum: Gradients,
    micro_batches: usize,
}

impl GradAccumulator {
    pub fn new(vars: Vec<(String, Var)>) -> Self {
        Self {
            vars,
            sum: Gradients::default(),
            micro_batches: 0,
        }
    }

    /// Backward on one micro-batch loss; its gradients are added times `scale`.
    pub fn backward(&mut self, loss: &Tensor, scale: f64) -> Result<()> {
        // The loss is scaled, not the gradients: no second copy of them (Gradients::add).
        let g = if scale == 1.0 {
            Gradients::backward(loss, &self.vars)?
        } else {
            Gradients::backward(&(loss * scale)?, &self.vars)?
        };
        self.sum.add(g)?;
        self.micro_batches += 1;
        Ok(())
    }

    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The accumulated gradients; the accumulator starts over.
    pub fn take(&mut self) -> Gradients {
        self.micro_batches = 0;
        std::mem::take(&mut self.sum)
    }
}

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
enum Moments {
    Host { m: Vec<f32>, v: Vec<f32> },
    Device { m: Tensor, v: Tensor },
}

struct Slot {
    name: String,
    var: Var,
    moments: Moments,
    decay: bool,
    /// The elements of the flattened parameter this optimizer steps (all of them, unless the
    /// state is sharded across data-parallel ranks: `zero_stage`); the moments cover only
    /// these.
    owned: std::ops::Range<usize>,
}

/// Scalars of one AdamW step.
#[derive(Clone, Copy)]
struct StepScalars {
    lr: f32,
    beta1: f32,
    beta2: f32,
    /// `1 - beta` taken in f64 before rounding: `1 - (0.999 as f32)` is 1.3e-5 away from
    /// 0.001, which scaled every step by 6e-6 against PyTorch (that computes it in f64).
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    eps: f32,
    decay_factor: f32,
    inv_bc1: f32,
    inv_sqrt_bc2: f32,
    /// Gradient multiplier (global-norm clipping), 1 for none.
    grad_scale: f32,
}

fn host_update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: StepScalars) {
    for (((pi, &gi), mi), vi) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let gi = gi * k.grad_scale;
        *mi = k.beta1 * *mi + k.one_minus_beta1 * gi;
        *vi = k.beta2 * *vi + k.one_minus_beta2 * gi * gi;
        let denom = vi.sqrt() * k.inv_sqrt_bc2 + k.eps;
        *pi = *pi * k.decay_factor - k.lr * k.inv_bc1 * *mi / denom;
    }
}

/// One parameter's host step written straight into its storage (an f32 parameter on the
/// CPU with an f32 gradient): no copy of the parameter or its gradient is made, where the
/// general path copies both out and the result back in.
struct InPlaceStep<'a> {
    moments: std::cell::RefCell<(&'a mut [f32], &'a mut [f32])>,
    owned: std::ops::Range<usize>,
    k: StepScalars,
}

impl candle_core::InplaceOp2 for InPlaceStep<'_> {
    fn name(&self) -> &'static str {
        "adamw-host-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage as S;
        let (S::F32(p), S::F32(g)) = (s1, s2) else {
            candle_core::bail!("adamw-host-step: f32 parameter and gradient expected");
        };
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("adamw-host-step: contiguous parameter and gradient expected");
        };
        let (p, g) = (&mut p[p0..p1], &g[g0..g1]);
        let mut mv = self.moments.borrow_mut();
        let (m, v) = &mut *mv;
        let r = self.owned.clone();
        host_update(&mut p[r.clone()], &g[r], m, v, self.k);
        Ok(())
    }
}

/// AdamW with decoupled weight decay (Loshchilov & Hutter), moments kept in f32.
pub struct AdamW {
    slots: Vec<Slot>,
    cfg: AdamWConfig,
    step: usize,
    /// `(rank, world)` when the state is sharded ([`AdamW::new_sharded`]).
    shard: Option<(usize, usize)>,
    /// The elements of the flattened parameters (laid end to end) this optimizer owns.
    span: std::ops::Range<usize>,
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
        // Moments offloaded while the device generated come back first.
        self.reload()?;
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg.clone();
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for s in self.slots.iter_mut() {
            let Some(g) = grads.get(&s.name) else {
                continue;
            };
            if s.owned.is_empty() {
                continue;
            }
            let decay = if s.decay { c.weight_decay } else { 0.0 };
            let (a, b) = (s.owned.start, s.owned.end);
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
            match &mut s.moments {
                Moments::Host { m, v }
                    if s.var.device().is_cpu()
                        && s.var.dtype() == DType::F32
                        && g.device().is_cpu() =>
                {
                    // Straight into the parameter's storage: no copies.
                    let g = g.to_dtype(DType::F32)?.contiguous()?;
                    let op = InPlaceStep {
                        moments: std::cell::RefCell::new((m.as_mut_slice(), v.as_mut_slice())),
                        owned: a..b,
                        k,
                    };
                    s.var.as_tensor().inplace_op2(&g, &op)?;
                }
                Moments::Host { m, v } => {
                    // f32 on the host whatever the parameter's dtype and device (a no-op for
                    // f32 on the CPU).
                    let mut p = s
                        .var
                        .as_tensor()
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    host_update(&mut p[a..b], &g[a..b], m, v, k);
                    let shape = s.var.shape().clone();
                    let p = Tensor::from_vec(p, shape, &candle_core::Device::Cpu)?;
                    s.var
                        .set(&p.to_dtype(s.var.dtype())?.to_device(s.var.device())?)?;
                }
                Moments::Device { m, v } => {
                    let n = s.var.elem_count();
                    let g = g.to_dtype(DType::F32)?.flatten_all()?.narrow(0, a, b - a)?;
                    let g = if grad_scale == 1.0 {
                        g
                    } else {
                        (g * grad_scale)?
                    };
                    *m = ((&*m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
                    *v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
                    let all = s.var.as_tensor().detach().flatten_all()?;
                    let p = all.narrow(0, a, b - a)?.to_dtype(DType::F32)?;
                    let p = if decay != 0.0 {
                        (p * (1.0 - c.lr * decay))?
                    } else {
                        p
                    };
                    let denom = ((v.sqrt()? / bc2.sqrt())? + c.eps)?;
                    let update = ((&*m / denom)? * (c.lr / bc1))?;
                    let mine = (p - update)?.to_dtype(s.var.dtype())?;
                    let flat = if b - a == n {
                        mine
                    } else {
                        Tensor::cat(
                            &[&all.narrow(0, 0, a)?, &mine, &all.narrow(0, b, n - b)?],
                            0,
                        )?
                    };
                    s.var.set(&flat.reshape(s.var.shape())?)?;
                }
            }
        }
        Ok(())
    }

    /// Optimizer state as named tensors (`exp_avg.NAME`, `exp_avg_sq.NAME`) plus the step
    /// count, for checkpoints. A snapshot: host moments are copied, and device moments are
    /// replaced by every step, never written in place.
    pub fn state(&self) -> Result<(Vec<(String, Tensor)>, usize)> {
        if let Some((rank, world)) = self.shard {
            return Err(Error::InvalidArgument(format!(
                "this optimizer holds rank {rank}'s share of {world}; its group gathers the whole state (AdamW::owned_moments, AdamW::state_from_flat)"
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

/// Shape of the learning-rate curve after warmup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    Constant,
    /// Linear decay to 0 at `total_steps`.
    Linear,
    /// Half-cosine decay to `min_lr_ratio * lr` at `total_steps`.
    Cosine {
        min_lr_ratio: f64,
    },
}

/// Learning rate per step: linear warmup from 0 over `warmup_steps`, then the schedule
/// (transformers' `get_*_schedule_with_warmup` conventions).
#[derive(Debug, Clone, PartialEq)]
pub struct LrScheduler {
    pub base_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub schedule: LrSchedule,
}

impl LrScheduler {
    pub fn new(
        base_lr: f64,
        warmup_steps: usize,
        total_steps: usize,
        schedule: LrSchedule,
    ) -> Self {
        Self {
            base_lr,
            warmup_steps,
            total_steps,
            schedule,
        }
    }

    /// Learning rate for (0-based) `step`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.base_lr * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        let factor = match self.schedule {
            LrSchedule::Constant => 1.0,
            LrSchedule::Linear => (1.0 - progress).max(0.0),
            LrSchedule::Cosine { min_lr_ratio } => {
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                min_lr_ratio + (1.0 - min_lr_ratio) * cos
            }
        };
        self.base_lr * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedules_follow_transformers_conventions() {
        let lin = LrScheduler::new(1.0, 10, 110, LrSchedule::Linear);
        assert_eq!(lin.lr_at(0), 0.0);
        assert!((lin.lr_at(5) - 0.5).abs() < 1e-12);
        assert_eq!(lin.lr_at(10), 1.0);
        assert!((lin.lr_at(60) - 0.5).abs() < 1e-12);
        assert_eq!(lin.lr_at(110), 0.0);
        let cos = LrScheduler::new(2.0, 0, 100, LrSchedule::Cosine { min_lr_ratio: 0.1 });
        assert!((cos.lr_at(0) - 2.0).abs() < 1e-12);
        assert!((cos.lr_at(50) - 2.0 * (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert!((cos.lr_at(100) - 0.2).abs() < 1e-12);
        let c = LrScheduler::new(3.0, 2, 10, LrSchedule::Constant);
        assert_eq!(c.lr_at(1), 1.5);
        assert_eq!(c.lr_at(9), 3.0);
    }

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

    #[test]
    fn clipping_returns_norm_and_bounds_it() -> Result<()> {
        let mut g = Gradients::default();
        g.grads
            .insert("a".into(), Tensor::new(&[3.0f32], &Device::Cpu)?);
        g.grads
            .insert("b".into(), Tensor::new(&[4.0f32], &Device::Cpu)?);
        let norm = g.clip_global_norm(1.0)?;
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((g.global_norm()? - 1.0).abs() < 1e-5);
        let before = g.global_norm()?;
        assert!((g.clip_global_norm(10.0)? - before).abs() < 1e-12);
        assert!((g.global_norm()? - before).abs() < 1e-12);
        Ok(())
    }

    #[test]
    fn accumulation_equals_full_batch_gradient() -> Result<()> {
        let w = Var::from_tensor(&Tensor::new(&[0.5f32, -1.5], &Device::Cpu)?)?;
        let vars = vec![("w".to_string(), w.clone())];
        let xs = [[1.0f32, 2.0], [3.0, -1.0], [0.5, 0.5], [-2.0, 1.0]];
        let loss_of = |rows: &[[f32; 2]]| -> Result<Tensor> {
            let flat: Vec<f32> = rows.iter().flatten().copied().collect();
            let x = Tensor::from_vec(flat, (rows.len(), 2), &Device::Cpu)?;
            Ok(x.broadcast_mul(w.as_tensor())?.sum(1)?.sqr()?.mean_all()?)
        };
        let full = Gradients::backward(&loss_of(&xs)?, &vars)?;
        let mut acc = GradAccumulator::new(vars.clone());
        acc.backward(&loss_of(&xs[..2])?, 0.5)?;
        acc.backward(&loss_of(&xs[2..])?, 0.5)?;
        assert_eq!(acc.micro_batches(), 2);
        let summed = acc.take();
        let a = full.get("w").unwrap().to_vec1::<f32>()?;
        let b = summed.get("w").unwrap().to_vec1::<f32>()?;
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
        assert_eq!(acc.micro_batches(), 0);
        Ok(())
    }
}
