//! Off-policy correction for async rollout, and the rollout-vs-trainer log-prob gap.
//!
//! An async batch was sampled by an older policy (the behaviour policy, log-probs `b`) than
//! the one the trainers hold when its step starts (the proximal policy, the recomputed
//! `old` log-probs). We follow decoupled PPO (AReaL): the clipped ratio stays
//! `pi_theta / pi_old`, so the trust region sits around the trainers' current weights and
//! staleness does not shrink the step, and each token's loss is multiplied by the
//! importance weight `w = pi_old / pi_behaviour = exp(old - b)`, truncated at `is_cap` as in
//! truncated importance sampling (verl's TIS) to bound its variance.
//!
//! Because `w >= 0` commutes with the surrogate's `min`/`max` (and the dual clip's), the
//! weighted token loss `w * l(A)` equals `l(w * A)`: the driver scales the advantages, and
//! the trainers' loss, clip fractions and gradients need no new input (`tests` checks it).

use crate::error::{AlgoError, Result};

/// Truncated importance weights of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportanceWeights {
    /// `min(w, cap)` per token; 1 outside the mask.
    pub truncated: Vec<f32>,
    /// Mean of `w` over valid tokens, before truncation (1 with no valid token).
    pub mean: f64,
    /// Largest `w` over valid tokens, before truncation.
    pub max: f64,
}

fn same_len(what: &'static str, a: usize, b: usize) -> Result<()> {
    if a != b {
        return Err(AlgoError::InvalidInput {
            input: what,
            reason: format!("has {a} elements, the response mask {b}"),
        });
    }
    Ok(())
}

/// `w = exp(old - behaviour)` on tokens where `mask > 0.5`, truncated at `cap`.
pub fn importance_weights(
    old: &[f32],
    behaviour: &[f32],
    mask: &[f32],
    cap: f64,
) -> Result<ImportanceWeights> {
    same_len("old_log_probs", old.len(), mask.len())?;
    same_len("behaviour_log_probs", behaviour.len(), mask.len())?;
    if !(cap.is_finite() && cap >= 1.0) {
        return Err(AlgoError::InvalidInput {
            input: "is_cap",
            reason: format!("must be >= 1, got {cap}"),
        });
    }
    let (mut sum, mut max, mut n) = (0.0f64, 0.0f64, 0usize);
    let truncated = old
        .iter()
        .zip(behaviour)
        .zip(mask)
        .map(|((&o, &b), &m)| {
            if m <= 0.5 {
                return 1.0;
            }
            // Clamped like the PPO ratio: a log-ratio beyond 20 is a broken input anyway.
            let w = f64::from(o - b).clamp(-20.0, 20.0).exp();
            sum += w;
            max = max.max(w);
            n += 1;
            w.min(cap) as f32
        })
        .collect();
    Ok(ImportanceWeights {
        truncated,
        mean: if n == 0 { 1.0 } else { sum / n as f64 },
        max: if n == 0 { 1.0 } else { max },
    })
}

/// Mean and max of `|a - b|` over tokens where `mask > 0.5`; `None` with no valid token.
pub fn log_prob_gap(a: &[f32], b: &[f32], mask: &[f32]) -> Result<Option<(f64, f64)>> {
    same_len("log_probs", a.len(), mask.len())?;
    same_len("log_probs", b.len(), mask.len())?;
    let (mut sum, mut max, mut n) = (0.0f64, 0.0f64, 0usize);
    for ((&x, &y), &m) in a.iter().zip(b).zip(mask) {
        if m > 0.5 {
            let d = f64::from((x - y).abs());
            sum += d;
            max = max.max(d);
            n += 1;
        }
    }
    Ok((n > 0).then(|| (sum / n as f64, max)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::PgParams;
    use crate::loss::policy_terms_ops;
    use candle_core::{Device, Tensor};

    #[test]
    fn weights_truncate_and_skip_padding() {
        let old = [-1.0f32, -1.0, -2.0, -0.5];
        let beh = [-1.0f32, -2.0, -1.0, -9.0];
        let mask = [1.0f32, 1.0, 1.0, 0.0];
        let w = importance_weights(&old, &beh, &mask, 2.0).unwrap();
        let e = std::f64::consts::E;
        assert_eq!(w.truncated, vec![1.0, 2.0, (1.0 / e) as f32, 1.0]);
        assert!(
            (w.mean - (1.0 + e + 1.0 / e) / 3.0).abs() < 1e-6,
            "{}",
            w.mean
        );
        assert!((w.max - e).abs() < 1e-6);
        assert!(importance_weights(&old, &beh, &mask, 0.5).is_err());
        assert!(importance_weights(&old[..3], &beh, &mask, 2.0).is_err());

        let gap = log_prob_gap(&old, &beh, &mask).unwrap().unwrap();
        assert!((gap.0 - 2.0 / 3.0).abs() < 1e-9 && (gap.1 - 1.0).abs() < 1e-9);
        assert_eq!(log_prob_gap(&old, &beh, &[0.0; 4]).unwrap(), None);
    }

    /// The surrogate with advantages `w * A` is `w` times the surrogate with `A`, token by
    /// token, with and without the dual clip, clipped or not: scaling the advantages is
    /// the weighted loss.
    #[test]
    fn scaled_advantages_are_the_weighted_loss() {
        let d = Device::Cpu;
        let old = [-1.0f32, -1.0, -1.0, -1.0, -2.0, -0.3];
        let lp = [-0.5f32, -1.6, -1.0, -0.2, -2.5, -0.3];
        let adv = [1.0f32, -2.0, 0.5, -1.0, 3.0, -0.7];
        let w = [0.3f32, 2.0, 1.0, 1.7, 0.05, 1.2];
        let t = |v: &[f32]| Tensor::from_slice(v, (2, 3), &d).unwrap();
        let mask = t(&[1.0; 6]);
        let wa: Vec<f32> = adv.iter().zip(&w).map(|(a, w)| a * w).collect();
        for dual in [None, Some(3.0f32)] {
            let p = PgParams {
                lo: 0.8,
                hi: 1.2,
                dual,
            };
            let (plain, _) = policy_terms_ops(&t(&old), &t(&lp), &t(&adv), &mask, 6, p).unwrap();
            let (scaled, _) = policy_terms_ops(&t(&old), &t(&lp), &t(&wa), &mask, 6, p).unwrap();
            let plain: Vec<f32> = plain.flatten_all().unwrap().to_vec1().unwrap();
            let scaled: Vec<f32> = scaled.flatten_all().unwrap().to_vec1().unwrap();
            for i in 0..6 {
                let want = w[i] * plain[i];
                assert!(
                    (scaled[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "token {i} dual {dual:?}: {} vs {want}",
                    scaled[i]
                );
            }
        }
    }
}
