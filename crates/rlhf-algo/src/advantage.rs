//! Advantage estimators (verl `core_algos`), computed on host slices.
//!
//! Nothing here needs a gradient, and every estimator is a scan or a group
//! reduction: one pass over a contiguous `f32` buffer per row beats a chain of
//! tensor ops (PyTorch's GAE is a Python loop of small kernels over columns).
//! All outputs are zero outside the response mask, so padding never leaks.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::config::AlgorithmConfig;
use crate::error::{AlgoError, Result};
use crate::fused::split_rows;
use crate::masked::{host_whiten, row_sums, Terms};
use crate::names::{AdvEstimator, ScaleRewards};
use crate::validate::{
    check_2d, check_batch_vec, check_finite, check_mask_host, check_same_shape, find_non_finite,
    finite_probe, host_vec, HostSlice,
};

/// Advantages and returns, both `[batch, len]`.
#[derive(Debug, Clone)]
pub struct Advantages {
    /// Per-token advantages.
    pub advantages: Tensor,
    /// Per-token returns (critic targets for GAE).
    pub returns: Tensor,
}

/// A validated host view of a batch's mask (borrowed from a CPU tensor, no copy).
struct Batch<'a> {
    batch: usize,
    len: usize,
    mask: HostSlice<'a>,
    device: Device,
}

impl<'a> Batch<'a> {
    fn new(mask: &'a Tensor) -> Result<Self> {
        let (batch, len) = check_2d("response_mask", mask)?;
        let data = HostSlice::new(mask)?;
        check_mask_host("response_mask", &data, mask.dims())?;
        Ok(Self {
            batch,
            len,
            mask: data,
            device: mask.device().clone(),
        })
    }

    /// [`Batch::new`] and the sum of each row's masked `token_rewards` (checked as
    /// [`Batch::token`] does), in one pass over both: counted in lanes that vectorize, with
    /// the checks' own scans run only when something is off, to name it.
    fn scored(mask: &'a Tensor, token_rewards: &Tensor) -> Result<(Self, Vec<f64>)> {
        let (batch, len) = check_2d("response_mask", mask)?;
        let data = HostSlice::new(mask)?;
        let fits = token_rewards.dtype() == DType::F32 && token_rewards.dims() == mask.dims();
        if len == 0 || !fits {
            // the checks below name the fault
            let b = Self::new(mask)?;
            let r = b.token("token_rewards", token_rewards, mask)?;
            let scores = b.row_scores(&r);
            return Ok((b, scores));
        }
        let rewards = HostSlice::new(token_rewards)?;
        let (r, m): (&[f32], &[f32]) = (&rewards, &data);
        let parts = split_rows(batch, len, &mut [], |rows, _| {
            let span = rows.start * len..rows.end * len;
            score_rows(&r[span.clone()], &m[span], len)
        });
        let (mut scores, mut ones, mut other, mut probe) = (Vec::new(), 0.0, 0.0, 0.0);
        for (s, o, x, p) in parts {
            scores.extend(s);
            ones += o;
            other += x;
            probe += p;
        }
        if ones == 0.0 || other != 0.0 || probe != 0.0 {
            check_mask_host("response_mask", &data, mask.dims())?;
            find_non_finite("token_rewards", &rewards, token_rewards.dims())?;
        }
        drop(rewards);
        let b = Self {
            batch,
            len,
            mask: data,
            device: mask.device().clone(),
        };
        Ok((b, scores))
    }

    /// A checked host view of a token tensor of the batch.
    fn token<'t>(&self, name: &'static str, t: &'t Tensor, mask: &Tensor) -> Result<HostSlice<'t>> {
        check_same_shape(name, t, "response_mask", mask)?;
        let data = HostSlice::new(t)?;
        find_non_finite(name, &data, t.dims())?;
        Ok(data)
    }

    fn tensor(&self, data: Vec<f32>) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            data,
            (self.batch, self.len),
            &self.device,
        )?)
    }

    fn groups(&self, group_ids: &[usize]) -> Result<Vec<usize>> {
        if group_ids.len() != self.batch {
            return Err(AlgoError::InvalidInput {
                input: "group_ids",
                reason: format!(
                    "has {} entries for a batch of {}; give one prompt index per row",
                    group_ids.len(),
                    self.batch
                ),
            });
        }
        // Dense group numbers keep the statistics in plain vectors.
        let mut dense = HashMap::new();
        Ok(group_ids
            .iter()
            .map(|g| {
                let n = dense.len();
                *dense.entry(*g).or_insert(n)
            })
            .collect())
    }

    /// Sum of the masked rewards of each row.
    fn row_scores(&self, rewards: &[f32]) -> Vec<f64> {
        rewards
            .chunks_exact(self.len)
            .zip(self.mask.chunks_exact(self.len))
            .map(|(r, m)| r.iter().zip(m).map(|(&r, &m)| (r * m) as f64).sum())
            .collect()
    }

    /// `value[i]` broadcast over row `i`'s valid tokens.
    fn broadcast_rows(&self, per_row: &[f64]) -> Vec<f32> {
        let (len, mask): (usize, &[f32]) = (self.len, &self.mask);
        let mut out = vec![0f32; self.batch * len];
        split_rows(self.batch, len, &mut out, |rows, part| {
            let m = &mask[rows.start * len..rows.end * len];
            for ((o, m), &v) in part
                .chunks_exact_mut(len)
                .zip(m.chunks_exact(len))
                .zip(&per_row[rows])
            {
                let v = v as f32;
                for (o, &m) in o.iter_mut().zip(m) {
                    *o = v * m;
                }
            }
        });
        out
    }
}

/// Each row's masked sum of `rewards`, with the mask's sum and a sum that is 0 only when every
/// mask value is 0 or 1, and the rewards' finiteness probe (NaN if one is not finite): one
/// pass over both.
fn score_rows(rewards: &[f32], mask: &[f32], len: usize) -> (Vec<f64>, f64, f64, f64) {
    // Plain arithmetic: for a 0/1 mask `r * m` is the masked reward, `m` counts the ones and
    // `|m - m^2|` is 0 (positive for any other value, NaN included).
    struct ScoreTerms;
    impl Terms<2, 4> for ScoreTerms {
        #[inline(always)]
        fn terms(&self, [r, m]: [f32; 2]) -> [f32; 4] {
            [r * m, m, (m - m * m).abs(), finite_probe(r)]
        }
    }
    let mut totals = [0f64; 4];
    let mut scores = Vec::with_capacity(rewards.len() / len.max(1));
    for (r, m) in rewards.chunks_exact(len).zip(mask.chunks_exact(len)) {
        let row = row_sums([r, m], &ScoreTerms);
        for (t, x) in totals.iter_mut().zip(&row) {
            *t += x;
        }
        scores.push(row[0]);
    }
    (scores, totals[1], totals[2], totals[3])
}

/// Per-group mean and unbiased std (torch.std) of `scores`; a group of one
/// gets mean 0 and std 1, as in verl.
fn group_stats(scores: &[f64], groups: &[usize]) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    let n_groups = groups.iter().max().map_or(0, |g| g + 1);
    let mut count = vec![0usize; n_groups];
    let mut sum = vec![0f64; n_groups];
    for (&s, &g) in scores.iter().zip(groups) {
        count[g] += 1;
        sum[g] += s;
    }
    let mean: Vec<f64> = (0..n_groups)
        .map(|g| {
            if count[g] > 1 {
                sum[g] / count[g] as f64
            } else {
                0.0
            }
        })
        .collect();
    let mut ss = vec![0f64; n_groups];
    for (&s, &g) in scores.iter().zip(groups) {
        ss[g] += (s - mean[g]).powi(2);
    }
    let std = (0..n_groups)
        .map(|g| {
            if count[g] > 1 {
                (ss[g] / (count[g] - 1) as f64).sqrt()
            } else {
                1.0
            }
        })
        .collect();
    (mean, std, count)
}

fn check_discount(key: &'static str, v: f64) -> Result<()> {
    crate::validate::check_unit_interval(key, v)
}

/// Generalized Advantage Estimation (verl `compute_gae_advantage_return`,
/// without its final whitening). Masked positions are skipped: the value and
/// the running advantage carry over them, so a hole in the mask (e.g. tool
/// output inside a response) is transparent. Returns are `advantages + values`.
pub fn gae(
    token_rewards: &Tensor,
    values: &Tensor,
    response_mask: &Tensor,
    gamma: f64,
    lam: f64,
) -> Result<Advantages> {
    check_discount("gamma", gamma)?;
    check_discount("lam", lam)?;
    let b = Batch::new(response_mask)?;
    let r = b.token("token_rewards", token_rewards, response_mask)?;
    let v = b.token("values", values, response_mask)?;
    let (adv, ret) = gae_host(&r, &v, &b.mask, b.len, gamma as f32, lam as f32);
    Ok(Advantages {
        advantages: b.tensor(adv)?,
        returns: b.tensor(ret)?,
    })
}

/// GAE over flat row-major buffers of rows of length `len`.
pub(crate) fn gae_host(
    rewards: &[f32],
    values: &[f32],
    mask: &[f32],
    len: usize,
    gamma: f32,
    lam: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut adv = vec![0f32; rewards.len()];
    let mut ret = vec![0f32; rewards.len()];
    let gl = gamma * lam;
    let rows = rewards
        .chunks_exact(len)
        .zip(values.chunks_exact(len))
        .zip(mask.chunks_exact(len))
        .zip(adv.chunks_exact_mut(len).zip(ret.chunks_exact_mut(len)));
    for (((r, v), m), (a, rt)) in rows {
        let mut next_value = 0f32;
        let mut last = 0f32;
        for t in (0..len).rev() {
            if m[t] != 0.0 {
                let delta = r[t] + gamma * next_value - v[t];
                last = delta + gl * last;
                next_value = v[t];
                a[t] = last;
                rt[t] = last + v[t];
            }
        }
    }
    (adv, ret)
}

/// The shape the group-baseline estimators share: each row's score (sum of its
/// token rewards) judged against its group's `(mean, std, count)` by `per_row`,
/// broadcast over the row's tokens, optionally whitened over the batch.
/// Returns equal advantages.
fn group_outcome(
    token_rewards: &Tensor,
    response_mask: &Tensor,
    group_ids: &[usize],
    whiten: bool,
    per_row: impl Fn(f64, f64, f64, usize) -> f64,
) -> Result<Advantages> {
    let (b, scores) = Batch::scored(response_mask, token_rewards)?;
    let groups = b.groups(group_ids)?;
    let (mean, std, count) = group_stats(&scores, &groups);
    let per: Vec<f64> = scores
        .iter()
        .zip(&groups)
        .map(|(&s, &g)| per_row(s, mean[g], std[g], count[g]))
        .collect();
    let mut adv = b.broadcast_rows(&per);
    if whiten {
        host_whiten(&mut adv, &b.mask, true)?;
    }
    // one buffer for both: tensors are immutable
    let adv = b.tensor(adv)?;
    Ok(Advantages {
        advantages: adv.clone(),
        returns: adv,
    })
}

/// GRPO outcome advantage (verl `compute_grpo_outcome_advantage`): each row's
/// score (sum of its token rewards) minus its group's mean, divided by the
/// group's std plus `eps` when `norm_by_std`; broadcast over the row's tokens.
/// `group_ids[i]` is the prompt row `i` was sampled from. Returns equal advantages.
pub fn grpo_outcome_advantage(
    token_rewards: &Tensor,
    response_mask: &Tensor,
    group_ids: &[usize],
    norm_by_std: bool,
    eps: f64,
) -> Result<Advantages> {
    let scale = if norm_by_std {
        ScaleRewards::Group
    } else {
        ScaleRewards::None
    };
    grpo_scaled_advantage(token_rewards, response_mask, group_ids, scale, eps)
}

/// GRPO outcome advantage with TRL's `scale_rewards`: each row's score minus its
/// group's mean, divided by `std + eps` where the std is the group's (`group`), that of
/// every score in the batch (`batch`, unbiased as `torch.std`; 1 for a batch of one), or
/// not divided at all (`none`). TRL uses `eps = 1e-4`.
pub fn grpo_scaled_advantage(
    token_rewards: &Tensor,
    response_mask: &Tensor,
    group_ids: &[usize],
    scale: ScaleRewards,
    eps: f64,
) -> Result<Advantages> {
    let batch_std = match scale {
        ScaleRewards::Batch => {
            let (_, scores) = Batch::scored(response_mask, token_rewards)?;
            let (_, std, _) = group_stats(&scores, &vec![0; scores.len()]);
            std[0]
        }
        ScaleRewards::Group | ScaleRewards::None => 1.0,
    };
    group_outcome(
        token_rewards,
        response_mask,
        group_ids,
        false,
        |s, mean, std, _| match scale {
            ScaleRewards::Group => (s - mean) / (std + eps),
            ScaleRewards::Batch => (s - mean) / (batch_std + eps),
            ScaleRewards::None => s - mean,
        },
    )
}

/// RLOO outcome advantage (verl `compute_rloo_outcome_advantage`): with `n`
/// responses in the group, `score * n/(n-1) - mean * n/(n-1)`, i.e. the score
/// minus the mean of the other responses; a group of one keeps its score.
pub fn rloo_outcome_advantage(
    token_rewards: &Tensor,
    response_mask: &Tensor,
    group_ids: &[usize],
) -> Result<Advantages> {
    group_outcome(
        token_rewards,
        response_mask,
        group_ids,
        false,
        |s, mean, _, count| {
            let n = count as f64;
            if count > 1 {
                (s - mean) * n / (n - 1.0)
            } else {
                s
            }
        },
    )
}

/// REINFORCE++ (verl `compute_reinforce_plus_plus_outcome_advantage`): the
/// discounted return-to-go of the token rewards, carried unchanged over masked
/// positions (verl >= 0.9), then whitened over the batch. Returns are the un-whitened returns-to-go.
pub fn reinforce_plus_plus_advantage(
    token_rewards: &Tensor,
    response_mask: &Tensor,
    gamma: f64,
) -> Result<Advantages> {
    check_discount("gamma", gamma)?;
    let b = Batch::new(response_mask)?;
    let r = b.token("token_rewards", token_rewards, response_mask)?;
    let mut ret = vec![0f32; r.len()];
    let g = gamma as f32;
    for ((rr, m), out) in r
        .chunks_exact(b.len)
        .zip(b.mask.chunks_exact(b.len))
        .zip(ret.chunks_exact_mut(b.len))
    {
        let mut running = 0f32;
        for t in (0..b.len).rev() {
            if m[t] != 0.0 {
                running = rr[t] + g * running;
                out[t] = running;
            }
        }
    }
    let mut adv = ret.clone();
    host_whiten(&mut adv, &b.mask, true)?;
    Ok(Advantages {
        advantages: b.tensor(adv)?,
        returns: b.tensor(ret)?,
    })
}

/// REINFORCE++ with baseline (verl
/// `compute_reinforce_plus_plus_baseline_outcome_advantage`): score minus the
/// group mean (zero baseline for a group of one), broadcast over the row, then
/// whitened over the batch. Returns equal advantages.
pub fn reinforce_plus_plus_baseline_advantage(
    token_rewards: &Tensor,
    response_mask: &Tensor,
    group_ids: &[usize],
) -> Result<Advantages> {
    group_outcome(
        token_rewards,
        response_mask,
        group_ids,
        true,
        |s, mean, _, _| s - mean,
    )
}

/// ReMax (verl `compute_remax_outcome_advantage`): undiscounted return-to-go
/// minus the `[batch]` score of the greedy baseline response.
pub fn remax_advantage(
    token_rewards: &Tensor,
    baseline_scores: &Tensor,
    response_mask: &Tensor,
) -> Result<Advantages> {
    let b = Batch::new(response_mask)?;
    let r = b.token("token_rewards", token_rewards, response_mask)?;
    check_batch_vec("baseline_scores", baseline_scores, b.batch)?;
    check_finite("baseline_scores", baseline_scores)?;
    let base = baseline_scores.to_vec1::<f32>()?;
    let mut ret = vec![0f32; r.len()];
    let mut adv = vec![0f32; r.len()];
    for (i, ((rr, m), (out, a))) in r
        .chunks_exact(b.len)
        .zip(b.mask.chunks_exact(b.len))
        .zip(ret.chunks_exact_mut(b.len).zip(adv.chunks_exact_mut(b.len)))
        .enumerate()
    {
        let mut running = 0f32;
        for t in (0..b.len).rev() {
            if m[t] != 0.0 {
                running += rr[t];
                out[t] = running;
                a[t] = running - base[i];
            }
        }
    }
    Ok(Advantages {
        advantages: b.tensor(adv)?,
        returns: b.tensor(ret)?,
    })
}

/// Inputs of [`compute_advantage`]; which optional ones are needed depends on
/// the estimator (an error names a missing one).
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    /// `[batch, len]` per-token rewards (from [`crate::compute_token_rewards`]).
    pub token_rewards: &'a Tensor,
    /// `[batch, len]` 1.0 on response tokens, right-padded with 0.0.
    pub response_mask: &'a Tensor,
    /// `[batch, len]` critic values at rollout time (`gae`).
    pub values: Option<&'a Tensor>,
    /// `[batch, len]` where GAE runs when it differs from the response mask
    /// ([`crate::TokenRewards::value_mask`] with TRL's score placement); advantages are
    /// still whitened over, and kept on, the response mask.
    pub value_mask: Option<&'a Tensor>,
    /// Prompt index of each row (`grpo`, `rloo`, `reinforce_plus_plus_baseline`).
    pub group_ids: Option<&'a [usize]>,
    /// `[batch]` greedy-baseline scores (`remax`).
    pub baseline_scores: Option<&'a Tensor>,
}

fn missing(input: &'static str, est: AdvEstimator) -> AlgoError {
    AlgoError::InvalidInput {
        input,
        reason: format!("the `{est}` advantage estimator needs it"),
    }
}

/// Runs the estimator `cfg.adv_estimator`. For `gae`, advantages are whitened
/// over the mask when `cfg.whiten_advantages` (as TRL and verl do).
pub fn compute_advantage(
    inputs: &AdvantageInputs<'_>,
    cfg: &AlgorithmConfig,
) -> Result<Advantages> {
    cfg.validate()?;
    let est = cfg.adv_estimator;
    let r = inputs.token_rewards;
    let m = inputs.response_mask;
    let groups = || inputs.group_ids.ok_or_else(|| missing("group_ids", est));
    match est {
        AdvEstimator::Gae => {
            let values = inputs.values.ok_or_else(|| missing("values", est))?;
            let out = gae(
                r,
                values,
                inputs.value_mask.unwrap_or(m),
                cfg.gamma,
                cfg.lam,
            )?;
            let mask = host_vec(m)?;
            let mut adv = host_vec(&out.advantages)?;
            if cfg.whiten_advantages {
                host_whiten(&mut adv, &mask, true)?;
            } else {
                // TRL: `advantages = masked_fill(advantages, padding_mask, 0)`.
                for (a, &k) in adv.iter_mut().zip(&mask) {
                    if k == 0.0 {
                        *a = 0.0;
                    }
                }
            }
            Ok(Advantages {
                advantages: Tensor::from_vec(adv, m.dims(), m.device())?,
                returns: out.returns,
            })
        }
        AdvEstimator::Grpo => {
            grpo_scaled_advantage(r, m, groups()?, cfg.grpo_scale(), cfg.grpo_epsilon)
        }
        AdvEstimator::Rloo => rloo_outcome_advantage(r, m, groups()?),
        AdvEstimator::ReinforcePlusPlus => reinforce_plus_plus_advantage(r, m, cfg.gamma),
        AdvEstimator::ReinforcePlusPlusBaseline => {
            reinforce_plus_plus_baseline_advantage(r, m, groups()?)
        }
        AdvEstimator::Remax => {
            let base = inputs
                .baseline_scores
                .ok_or_else(|| missing("baseline_scores", est))?;
            remax_advantage(r, base, m)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t2(data: &[f32], b: usize, l: usize) -> Tensor {
        Tensor::from_vec(data.to_vec(), (b, l), &Device::Cpu).unwrap()
    }

    #[test]
    fn gae_single_step() {
        // One token: advantage = r - V.
        let r = t2(&[1.0, 0.0], 1, 2);
        let v = t2(&[0.25, 99.0], 1, 2);
        let m = t2(&[1.0, 0.0], 1, 2);
        let out = gae(&r, &v, &m, 1.0, 0.95).unwrap();
        assert_eq!(
            out.advantages.to_vec2::<f32>().unwrap(),
            vec![vec![0.75, 0.0]]
        );
        assert_eq!(out.returns.to_vec2::<f32>().unwrap(), vec![vec![1.0, 0.0]]);
    }

    #[test]
    fn grpo_groups() {
        let r = t2(&[1.0, 0.0, 3.0, 0.0, 5.0, 0.0], 3, 2);
        let m = t2(&[1.0, 1.0, 1.0, 0.0, 1.0, 0.0], 3, 2);
        let out = grpo_outcome_advantage(&r, &m, &[7, 7, 9], false, 1e-6).unwrap();
        let a = out.advantages.to_vec2::<f32>().unwrap();
        assert_eq!(a, vec![vec![-1.0, -1.0], vec![1.0, 0.0], vec![5.0, 0.0]]);
        let err = grpo_outcome_advantage(&r, &m, &[1, 2], true, 1e-6).unwrap_err();
        assert!(err
            .to_string()
            .contains("group_ids: has 2 entries for a batch of 3"));
    }

    #[test]
    fn large_batches_split_across_threads_match_a_plain_computation() {
        // rows of odd length, long enough for the row passes to run in parallel parts
        let (b, l) = (8usize, 20_011usize);
        let mut mask = vec![0f32; b * l];
        let mut rewards = vec![0f32; b * l];
        for i in 0..b {
            let len = l / 3 + i * 1_777;
            for t in 0..l {
                let x = ((i * l + t) as u32).wrapping_mul(2_654_435_761) >> 8;
                rewards[i * l + t] = (x as f32 / (1u32 << 24) as f32 - 0.5) * 1e-3;
            }
            mask[i * l..i * l + len].fill(1.0);
            rewards[i * l + len - 1] = i as f32 * 0.7 - 2.0;
        }
        let groups = [0, 0, 0, 1, 1, 1, 2, 2];
        let out =
            grpo_outcome_advantage(&t2(&rewards, b, l), &t2(&mask, b, l), &groups, true, 1e-6)
                .unwrap();
        let got = out
            .advantages
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let scores: Vec<f64> = (0..b)
            .map(|i| {
                (0..l)
                    .map(|t| f64::from(rewards[i * l + t] * mask[i * l + t]))
                    .sum()
            })
            .collect();
        for i in 0..b {
            let members: Vec<f64> = (0..b)
                .filter(|&j| groups[j] == groups[i])
                .map(|j| scores[j])
                .collect();
            let n = members.len() as f64;
            let mean = members.iter().sum::<f64>() / n;
            let std = (members.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
            let want = ((scores[i] - mean) / (std + 1e-6)) as f32;
            for t in 0..l {
                let w = want * mask[i * l + t];
                let g = got[i * l + t];
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "[{i}, {t}]: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn dispatch_names_missing_input() {
        let r = t2(&[1.0, 0.0], 1, 2);
        let m = t2(&[1.0, 1.0], 1, 2);
        let inputs = AdvantageInputs {
            token_rewards: &r,
            response_mask: &m,
            values: None,
            value_mask: None,
            group_ids: None,
            baseline_scores: None,
        };
        let err = compute_advantage(&inputs, &AlgorithmConfig::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "values: the `gae` advantage estimator needs it"
        );
    }
}
