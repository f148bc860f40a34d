//! What RL with verifiable rewards does to a batch between scoring and the advantages (DAPO,
//! arXiv 2503.14476): which groups carry a signal (dynamic sampling), the soft penalty for
//! responses that run into the length limit (overlong shaping), and which responses the
//! policy loss leaves out (TRL's `mask_truncated_completions`). Host-side functions over
//! plain slices: the driver applies them to a step's rows before anything is trained.

use crate::config::OverlongBufferConfig;
use crate::error::{AlgoError, Result};

/// Per group of `group_size` consecutive rows: whether `metric` differs within it (a
/// population std above zero, as verl's DAPO filter). A group of one row is informative.
pub fn informative_groups(metric: &[f32], group_size: usize) -> Result<Vec<bool>> {
    if group_size == 0 || !metric.len().is_multiple_of(group_size) {
        return Err(AlgoError::InvalidInput {
            input: "dynamic sampling metric",
            reason: format!(
                "{} rows do not split into groups of {group_size} (actor_rollout.num_samples_per_step)",
                metric.len()
            ),
        });
    }
    if let Some(i) = metric.iter().position(|x| !x.is_finite()) {
        return Err(AlgoError::NonFinite {
            tensor: "dynamic sampling metric",
            kind: if metric[i].is_nan() {
                "NaN"
            } else {
                "infinity"
            },
            index: vec![i],
        });
    }
    Ok(metric
        .chunks(group_size)
        .map(|g| g.len() == 1 || g.iter().any(|&x| x != g[0]))
        .collect())
}

/// DAPO's overlong penalty (`<= 0`) of a response of `len` tokens under a limit of
/// `max_len`: 0 up to `max_len - cfg.len`, then falling linearly to `-penalty_factor` at
/// `max_len` (and staying there beyond). 0 when shaping is off.
pub fn overlong_penalty(len: usize, max_len: usize, cfg: &OverlongBufferConfig) -> f64 {
    if !cfg.enable || cfg.len == 0 {
        return 0.0;
    }
    let buffer = f64::from(cfg.len);
    let expected = max_len as f64 - buffer;
    let exceed = len as f64 - expected;
    (-exceed / buffer * cfg.penalty_factor).clamp(-cfg.penalty_factor, 0.0)
}

/// Zeroes the loss mask (`[rows, width]`, row-major) of every row without EOS: TRL's
/// `mask_truncated_completions`. Returns how many rows were masked.
pub fn mask_truncated(mask: &mut [f32], width: usize, has_eos: &[bool]) -> Result<usize> {
    if mask.len() != has_eos.len() * width {
        return Err(AlgoError::InvalidInput {
            input: "response_mask",
            reason: format!(
                "{} values, expected {} rows x {width}",
                mask.len(),
                has_eos.len()
            ),
        });
    }
    let mut n = 0;
    for (row, &eos) in mask.chunks_mut(width.max(1)).zip(has_eos) {
        if !eos {
            row.fill(0.0);
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_with_equal_metric_are_uninformative() {
        let m = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5];
        assert_eq!(
            informative_groups(&m, 2).unwrap(),
            vec![false, true, false, false]
        );
        assert_eq!(informative_groups(&m, 4).unwrap(), vec![true, true]);
        assert_eq!(informative_groups(&m[..3], 1).unwrap(), vec![true; 3]);
        assert!(informative_groups(&m, 3).is_err());
        assert!(informative_groups(&[1.0, f32::NAN], 2).is_err());
    }

    #[test]
    fn overlong_penalty_is_dapos_ramp() {
        let cfg = OverlongBufferConfig {
            enable: true,
            len: 4,
            penalty_factor: 0.5,
        };
        let p: Vec<f64> = (10..=17).map(|l| overlong_penalty(l, 16, &cfg)).collect();
        assert_eq!(p, vec![0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]);
        let off = OverlongBufferConfig {
            enable: false,
            ..cfg
        };
        assert_eq!(overlong_penalty(16, 16, &off), 0.0);
    }

    #[test]
    fn dapo_settings_are_refused_by_key() {
        use crate::config::{AlgorithmConfig, DynamicSamplingConfig};
        use crate::names::AdvEstimator;
        let mut cfg = AlgorithmConfig {
            adv_estimator: AdvEstimator::Grpo,
            dynamic_sampling: DynamicSamplingConfig {
                enable: true,
                ..DynamicSamplingConfig::default()
            },
            ..AlgorithmConfig::default()
        };
        cfg.validate().unwrap();
        cfg.adv_estimator = AdvEstimator::Gae;
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("algorithm.dynamic_sampling.enable") && e.contains("adv_estimator grpo"),
            "{e}"
        );
        cfg.adv_estimator = AdvEstimator::Rloo;
        cfg.overlong_buffer.enable = true;
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("algorithm.overlong_buffer.len"), "{e}");
        cfg.overlong_buffer.len = 4;
        cfg.overlong_buffer.penalty_factor = -1.0;
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("algorithm.overlong_buffer.penalty_factor"),
            "{e}"
        );
    }

    #[test]
    fn truncated_rows_leave_the_loss() {
        let mut m = vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
        assert_eq!(mask_truncated(&mut m, 3, &[true, false]).unwrap(), 1);
        assert_eq!(m, vec![1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        assert!(mask_truncated(&mut m, 4, &[true, false]).is_err());
    }
}
