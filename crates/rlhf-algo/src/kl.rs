//! KL estimators and KL coefficient controllers.

use candle_core::{Tensor, D};
use serde::{Deserialize, Serialize};

use crate::config::KlCtrlConfig;
use crate::error::{AlgoError, Result};
use crate::names::{KlCtrlType, KlPenalty};
use crate::validate::{check_f32, check_finite, check_same_shape, clamp};

/// Per-token KL estimate between the policy and the reference policy.
///
/// For `kl`, `abs`, `mse` and `low_var_kl`, `logp` and `ref_logp` are the
/// sampled tokens' log-probabilities, `[batch, len]`, and the result has the same
/// shape. For `full`, they are full log-distributions `[batch, len, vocab]`
/// (log-softmax outputs) and the result is `sum_v p(v) (log p(v) - log q(v))`,
/// `[batch, len]`. Built from differentiable ops: usable as a loss w.r.t. `logp`.
/// No mask is applied; callers mask the result.
pub fn kl_penalty(logp: &Tensor, ref_logp: &Tensor, penalty: KlPenalty) -> Result<Tensor> {
    check_f32("logp", logp)?;
    check_same_shape("ref_logp", ref_logp, "logp", logp)?;
    let want_rank = if penalty == KlPenalty::Full { 3 } else { 2 };
    if logp.rank() != want_rank {
        return Err(AlgoError::BadRank {
            tensor: "logp",
            expected: if want_rank == 3 {
                "[batch, len, vocab] log-distributions for the `full` KL penalty"
            } else {
                "a 2-D tensor [batch, response_len]"
            },
            got: logp.dims().to_vec(),
        });
    }
    check_finite("logp", logp)?;
    check_finite("ref_logp", ref_logp)?;
    kl_penalty_unchecked(logp, ref_logp, penalty)
}

pub(crate) fn kl_penalty_unchecked(
    logp: &Tensor,
    ref_logp: &Tensor,
    penalty: KlPenalty,
) -> Result<Tensor> {
    let out = match penalty {
        KlPenalty::Kl => logp.sub(ref_logp)?,
        KlPenalty::Abs => logp.sub(ref_logp)?.abs()?,
        KlPenalty::Mse => logp.sub(ref_logp)?.sqr()?.affine(0.5, 0.0)?,
        KlPenalty::LowVarKl => {
            // verl clamps both the log-ratio and the result: exp(20) is still finite in
            // f32 and a single bad token cannot dominate the loss.
            let kl = clamp(&ref_logp.sub(logp)?, -20.0, 20.0)?;
            let kld = kl.exp()?.sub(&kl)?.affine(1.0, -1.0)?;
            clamp(&kld, -10.0, 10.0)?
        }
        KlPenalty::Full => {
            let p = logp.exp()?;
            p.mul(&logp.sub(ref_logp)?)?.sum(D::Minus1)?
        }
    };
    Ok(out)
}

/// One token of [`kl_penalty`] on the host, with the same f32 operation order
/// as the tensor version; `None` for `full`, which needs whole distributions.
#[inline]
pub(crate) fn kl_elem(lp: f32, rf: f32, penalty: KlPenalty) -> Option<f32> {
    Some(match penalty {
        KlPenalty::Kl => lp - rf,
        KlPenalty::Abs => (lp - rf).abs(),
        KlPenalty::Mse => (lp - rf) * (lp - rf) * 0.5,
        KlPenalty::LowVarKl => {
            let kl = (rf - lp).clamp(-20.0, 20.0);
            ((kl.exp() - kl) - 1.0).clamp(-10.0, 10.0)
        }
        KlPenalty::Full => return None,
    })
}

/// KL coefficient controller. Serializable so a checkpoint can restore it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KlController {
    /// Constant coefficient.
    Fixed {
        /// The coefficient.
        value: f64,
    },
    /// Proportional controller of Ziegler et al. (2019), as in TRL / verl:
    /// `value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`.
    Adaptive {
        /// The current coefficient.
        value: f64,
        /// The KL to steer towards.
        target: f64,
        /// Samples over which the error is corrected.
        horizon: f64,
    },
}

impl KlController {
    /// Builds the controller a config asks for.
    pub fn from_config(cfg: &KlCtrlConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(match cfg.kind {
            KlCtrlType::Fixed => KlController::Fixed { value: cfg.kl_coef },
            KlCtrlType::Adaptive => KlController::Adaptive {
                value: cfg.kl_coef,
                target: cfg.target_kl,
                horizon: cfg.horizon,
            },
        })
    }

    /// The current KL coefficient.
    pub fn value(&self) -> f64 {
        match self {
            KlController::Fixed { value } | KlController::Adaptive { value, .. } => *value,
        }
    }

    /// Updates the coefficient after a step that measured `current_kl` over
    /// `n_steps` samples (TRL passes the batch size).
    pub fn update(&mut self, current_kl: f64, n_steps: usize) -> Result<()> {
        if !current_kl.is_finite() {
            return Err(AlgoError::InvalidInput {
                input: "current_kl",
                reason: format!("KL controller got a non-finite KL ({current_kl})"),
            });
        }
        if let KlController::Adaptive {
            value,
            target,
            horizon,
        } = self
        {
            let err = (current_kl / *target - 1.0).clamp(-0.2, 0.2);
            *value *= 1.0 + err * n_steps as f64 / *horizon;
        }
        Ok(())
    }
}

/// Log-softmax over the last dimension from differentiable ops (candle's fused
/// softmax has no backward pass).
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    check_f32("logits", logits)?;
    log_softmax_unchecked(logits)
}

pub(crate) fn log_softmax_unchecked(logits: &Tensor) -> Result<Tensor> {
    // The max is a constant shift: detaching it keeps the graph small and the
    // gradient exact.
    let max = logits.detach().max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// Token entropy `[batch, len]` of categorical distributions given by logits
/// `[batch, len, vocab]`, from differentiable ops.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    check_f32("logits", logits)?;
    if logits.rank() != 3 {
        return Err(AlgoError::BadRank {
            tensor: "logits",
            expected: "a 3-D tensor [batch, len, vocab]",
            got: logits.dims().to_vec(),
        });
    }
    check_finite("logits", logits)?;
    let logp = log_softmax_unchecked(logits)?;
    Ok(logp.exp()?.mul(&logp)?.sum(D::Minus1)?.neg()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn estimators_on_known_values() {
        let dev = Device::Cpu;
        let lp = Tensor::new(&[[-1.0f32, -2.0]], &dev).unwrap();
        let rf = Tensor::new(&[[-1.5f32, -1.0]], &dev).unwrap();
        let get = |p| kl_penalty(&lp, &rf, p).unwrap().to_vec2::<f32>().unwrap()[0].clone();
        assert_eq!(get(KlPenalty::Kl), vec![0.5, -1.0]);
        assert_eq!(get(KlPenalty::Abs), vec![0.5, 1.0]);
        assert_eq!(get(KlPenalty::Mse), vec![0.125, 0.5]);
        let k3 = get(KlPenalty::LowVarKl);
        let want = |d: f32| d.exp() - d - 1.0;
        assert!((k3[0] - want(-0.5)).abs() < 1e-6 && (k3[1] - want(1.0)).abs() < 1e-6);
    }

    #[test]
    fn full_kl_of_identical_distributions_is_zero() {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[[[0.1f32, 2.0, -1.0], [0.0, 0.0, 0.0]]], &dev).unwrap();
        let lp = log_softmax(&logits).unwrap();
        let kl = kl_penalty(&lp, &lp, KlPenalty::Full).unwrap();
        assert_eq!(kl.dims(), &[1, 2]);
        for v in kl.flatten_all().unwrap().to_vec1::<f32>().unwrap() {
            assert!(v.abs() < 1e-6);
        }
        let err = kl_penalty(&lp, &lp, KlPenalty::Kl).unwrap_err().to_string();
        assert!(err.contains("logp: expected a 2-D tensor"), "{err}");
    }

    #[test]
    fn entropy_of_uniform_is_log_vocab() {
        let logits = Tensor::zeros((2, 3, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
        let h = entropy_from_logits(&logits)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for row in h {
            for v in row {
                assert!((v - 5f32.ln()).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn adaptive_controller_moves_towards_target() {
        let cfg = KlCtrlConfig {
            kind: KlCtrlType::Adaptive,
            kl_coef: 0.2,
            target_kl: 6.0,
            horizon: 10000.0,
        };
        let mut c = KlController::from_config(&cfg).unwrap();
        c.update(12.0, 256).unwrap(); // error clipped to +0.2
        assert!((c.value() - 0.2 * (1.0 + 0.2 * 256.0 / 10000.0)).abs() < 1e-12);
        let v = c.value();
        c.update(5.4, 100).unwrap(); // error -0.1
        assert!((c.value() - v * (1.0 - 0.1 * 100.0 / 10000.0)).abs() < 1e-12);
        let mut f = KlController::from_config(&KlCtrlConfig::default()).unwrap();
        f.update(100.0, 10).unwrap();
        assert_eq!(f.value(), 0.05);
        assert!(f.update(f64::NAN, 1).is_err());
    }
}
