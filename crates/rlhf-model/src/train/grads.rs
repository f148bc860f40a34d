//! Gradients by parameter name: the backward pass that collects them (checkpointed layers
//! included), their sum over micro-batches (in place where the layouts allow), the global
//! norm and clipping.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};

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
    pub(super) grads: BTreeMap<String, Tensor>,
}

impl Gradients {
    /// Gradients already gathered by name.
    pub fn from_map(grads: BTreeMap<String, Tensor>) -> Self {
        Self { grads }
    }

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

    /// Takes one parameter's gradient out (to flatten and drop gradients one at a time).
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.grads.remove(name)
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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
