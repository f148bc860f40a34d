#!/usr/bin/env python3
"""Reference numbers for crates/rlhf-algo (PPO math), written to
crates/rlhf-algo/tests/fixtures/reference.json.

Run from anywhere: `python3 scripts/algo_reference.py [--out PATH]`. When torch or
trl are missing, the script creates (or reuses) the virtual environment $VENV
(default .venv-ref at the repository root), installs torch, numpy and trl there,
and re-runs itself with that interpreter.

Sources of the formulas
-----------------------
* TRL >= 1.x no longer ships PPOTrainer nor its `masked_mean` / `masked_var` /
  `masked_whiten` helpers (trl 1.16 was checked: only `entropy_from_logits` and
  `selective_log_softmax` remain in `trl.trainer.utils`). Those two are imported
  and used below. The PPO loop formulas (per-token rewards, missing-EOS
  penalty, whitening, clipped losses, approxkl and the `objective/*`, `policy/*`,
  `loss/*`, `val/*` metrics) are transcribed from the last TRL PPOTrainer
  (`trl/experimental/ppo/ppo_trainer.py`, `PPOTrainer.train`), each cited below.
* verl's `core_algos` is not importable without ray, wandb, tensordict and
  hydra (`pip install verl` pulls a cluster stack), so its formulas are
  transcribed from verl 0.9.1 `verl/trainer/ppo/core_algos.py` and
  `verl/utils/torch_functional.py`, each function cited by name.

Conventions (the Rust crate's): token tensors are [batch, response_len];
responses are right-padded; `response_mask` is 1 on response tokens (EOS
included) and 0 on padding; the sequence score is placed on the last valid
response token (TRL places it on the token after EOS; see field notes). Every
computation runs in float64 on float32-representable inputs; the Rust side
computes in f32 and compares with a tolerance of 1e-5 (relative above 1).
Positions outside the mask hold large finite garbage so that the tests also
check that padding never changes a result; outputs are compared on the mask
only, and the Rust crate defines them as zero outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "crates" / "rlhf-algo" / "tests" / "fixtures" / "reference.json"


def ensure_env() -> None:
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import trl  # noqa: F401

        return
    except ImportError:
        pass
    venv = Path(os.environ.get("VENV", ROOT / ".venv-ref"))
    py = venv / "bin" / "python"
    # A venv's python is usually a symlink to the base interpreter, so compare prefixes.
    if Path(sys.prefix).resolve() == venv.resolve():
        sys.exit(f"torch/trl still missing in {venv}; install them with {venv}/bin/pip install torch numpy trl")
    if not py.exists():
        print(f"creating virtual environment {venv}", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    probe = subprocess.run([str(py), "-c", "import numpy, torch, trl"], capture_output=True)
    if probe.returncode != 0:
        print(f"installing torch, numpy, trl into {venv}", file=sys.stderr)
        subprocess.check_call([str(venv / "bin" / "pip"), "install", "--quiet", "torch", "numpy", "trl"])
    os.execv(str(py), [str(py), str(Path(__file__).resolve())] + sys.argv[1:])


ensure_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from trl.trainer.utils import entropy_from_logits, selective_log_softmax  # noqa: E402

torch.set_default_dtype(torch.float64)
SEED = 20240611
B, T, V = 8, 12, 7
LENGTHS = [12, 5, 9, 12, 1, 7, 12, 3]
# Rows shorter than T stopped on EOS; of the full-length rows, row 3 happens to end
# exactly on EOS and rows 0 and 6 were truncated without one.
HAS_EOS = [False, True, True, True, True, True, False, True]
GROUP_IDS = [0, 0, 0, 1, 1, 1, 2, 3]  # groups 2 and 3 hold a single response


# ---------------------------------------------------------------- helpers


def f32(x: torch.Tensor) -> torch.Tensor:
    """Round to float32 and back: the inputs must be exactly representable in f32."""
    return x.to(torch.float32).to(torch.float64)


def out(x) -> list | float:
    """9 significant digits: enough to round-trip f32 and to compare at 1e-5."""
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return [float(f"{v:.9g}") for v in x.detach().reshape(-1).tolist()]
    if isinstance(x, torch.Tensor):
        x = x.detach().item()
    return float(f"{float(x):.9g}")


# verl/utils/torch_functional.py: masked_sum, masked_mean, masked_var, masked_whiten
# (TRL's PPOTrainer had the same three, without the 1e-8 in masked_mean.)
def masked_sum(values, mask, axis=None):
    return torch.where(mask.bool(), values, 0.0).mul(mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        assert n > 1
        variance = variance * n / (n - 1)
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


# verl core_algos.kl_penalty / kl_penalty_forward (TRL's k1 and k3 in PPOTrainer.train)
def kl_penalty(logprob, ref_logprob, kind):
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(kl.exp() - kl - 1, min=-10, max=10)
    if kind == "full":
        # verl raises NotImplementedError here; the exact KL of the two full
        # distributions is sum_v p(v) (log p(v) - log q(v)) over the vocabulary.
        return (logprob.exp() * (logprob - ref_logprob)).sum(-1)
    raise ValueError(kind)


# TRL PPOTrainer.train, steps 3-5 ("Filter completion", "compute rewards",
# "whiten rewards"), with the score on the last valid token instead of the
# token after EOS; reward clipping as OpenRLHF / old TRL `score_clip`.
def token_rewards(scores, logp, ref_logp, mask, has_eos, kl_coef, cfg):
    scores = scores.clone()
    if cfg.get("missing_eos_penalty") is not None:
        scores[~has_eos] -= cfg["missing_eos_penalty"]
    if cfg.get("reward_clip") is not None:
        scores = scores.clamp(-cfg["reward_clip"], cfg["reward_clip"])
    kl = kl_penalty(logp, ref_logp, cfg.get("kl_penalty", "kl")) * mask
    coef = kl_coef if cfg.get("use_kl_in_reward", True) else 0.0
    non_score_reward = -coef * kl
    rewards = non_score_reward.clone()
    last = mask.sum(1).long() - 1  # right padding: last valid index
    rewards[torch.arange(B), last] += scores
    if cfg.get("whiten_rewards", False):
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    return rewards, kl, non_score_reward, scores


# verl core_algos.compute_gae_advantage_return (returns the raw advantages too)
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    raw = torch.stack(advantages_reversed[::-1], dim=1)
    returns = raw + values
    return masked_whiten(raw, response_mask), returns, raw


def _groups(scores, index):
    groups = {}
    for i in range(len(index)):
        groups.setdefault(index[i], []).append(scores[i])
    return groups


# verl core_algos.compute_grpo_outcome_advantage
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo):
    scores = token_level_rewards.sum(dim=-1)
    id2mean, id2std = {}, {}
    for idx, members in _groups(scores, index).items():
        if len(members) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            st = torch.stack(members)
            id2mean[idx], id2std[idx] = st.mean(), st.std()
    scores = scores.clone()
    for i in range(len(index)):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# verl core_algos.compute_rloo_outcome_advantage
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    groups = _groups(scores, index)
    id2mean = {k: (torch.tensor(0.0) if len(v) == 1 else torch.stack(v).mean()) for k, v in groups.items()}
    scores = scores.clone()
    for i in range(len(index)):
        n = len(groups[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# verl core_algos.compute_reinforce_plus_plus_outcome_advantage (0.9.1: the running
# return is carried unchanged over masked positions)
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = new_running_return * response_mask[:, t]
        running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


# verl core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    groups = _groups(scores, index)
    id2mean = {k: (torch.tensor(0.0) if len(v) == 1 else torch.stack(v).mean()) for k, v in groups.items()}
    scores = scores.clone()
    for i in range(len(index)):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    scores = masked_whiten(scores, response_mask) * response_mask
    return scores, scores


# verl core_algos.compute_remax_outcome_advantage
def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


# verl core_algos.agg_loss (dp_size 1, local normalisation)
def agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    seq_tokens = loss_mask.sum(dim=-1)
    seq_losses = (loss_mat * loss_mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (seq_tokens + 1e-8)
    elif loss_agg_mode != "seq-mean-token-sum":
        raise ValueError(loss_agg_mode)
    seq_mask = (seq_tokens > 0).double()
    return masked_sum(seq_losses, seq_mask) / seq_mask.sum()


# verl core_algos.compute_policy_loss_vanilla; with clip_ratio_c None the dual clip
# is skipped, which is TRL PPOTrainer.train's pg_loss. approxkl is TRL's
# 0.5 * logprobs_diff**2, averaged over the mask here (TRL averages over padding
# too, where its INVALID_LOGPROB trick makes the difference zero).
def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg):
    clip = cfg.get("clip_ratio", 0.2)
    low = cfg.get("clip_ratio_low") if cfg.get("clip_ratio_low") is not None else clip
    high = cfg.get("clip_ratio_high") if cfg.get("clip_ratio_high") is not None else clip
    clip_ratio_c = cfg.get("clip_ratio_c", 3.0)
    mode = cfg.get("loss_agg_mode", "token-mean")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).double(), response_mask)
    if clip_ratio_c is not None:
        pg_losses3 = -advantages * clip_ratio_c
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_clipfrac_lower = masked_mean(
            torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).double(), response_mask
        )
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_clipfrac_lower = torch.tensor(0.0)
        pg_losses = clip_pg_losses1
    pg_loss = agg_loss(pg_losses, response_mask, mode)
    logprobs_diff = log_prob - old_log_prob
    approxkl = masked_mean(0.5 * logprobs_diff**2, response_mask)
    ratio_mean = masked_mean(ratio, response_mask)
    return pg_loss, pg_clipfrac, pg_clipfrac_lower, approxkl, ppo_kl, ratio_mean


# verl core_algos.compute_value_loss (= TRL PPOTrainer.train's vf_loss)
def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).double(), response_mask)
    return vf_loss, vf_clipfrac


# verl core_algos.AdaptiveKLController / FixedKLController (Ziegler et al. 2019)
class AdaptiveKLController:
    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current_kl, n_steps):
        pass


# ---------------------------------------------------------------- data


def make_batch(g: torch.Generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    mask = torch.zeros(B, T)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    pad = 1 - mask
    garbage = lambda: f32(40.0 * randn(B, T)) * pad  # noqa: E731
    logits = f32(2.0 * randn(B, T, V))
    ref_logits = f32(logits + 0.5 * randn(B, T, V))
    tokens = torch.randint(0, V, (B, T), generator=g)
    # rollout log-probs of sampled tokens, through TRL's selective_log_softmax
    logp = f32(selective_log_softmax(logits, tokens)) * mask + garbage()
    ref_logp = f32(selective_log_softmax(ref_logits, tokens)) * mask + garbage()
    # a few large policy moves so that the dual clip (ratio > clip_ratio_c) fires
    spikes = 1.6 * (torch.rand(B, T, generator=g) < 0.15).double()
    new_logp = f32(logp + 0.25 * randn(B, T) + spikes) * mask + garbage()
    new_logp2 = f32(logp + 0.1 * randn(B, T)) * mask + garbage()
    values = f32(randn(B, T)) * mask + garbage()
    vpreds = f32(values + 0.3 * randn(B, T)) * mask + garbage()
    vpreds2 = f32(values + 0.1 * randn(B, T)) * mask + garbage()
    scores = f32(2.0 * randn(B))
    baseline_scores = f32(randn(B))
    return dict(
        mask=mask, logits=logits, ref_logits=ref_logits, tokens=tokens, logp=logp, ref_logp=ref_logp,
        new_logp=new_logp, new_logp2=new_logp2, values=values, vpreds=vpreds, vpreds2=vpreds2,
        scores=scores, baseline_scores=baseline_scores,
        has_eos=torch.tensor(HAS_EOS),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(SEED)
    d = make_batch(g)
    mask, has_eos = d["mask"], d["has_eos"]
    # TRL's k3 (PPOTrainer.train: `(logr.exp() - 1) - logr`) equals verl's
    # low_var_kl wherever verl's clamps are inactive.
    logr = d["ref_logp"] - d["logp"]
    trl_k3 = ((logr.exp() - 1) - logr) * mask
    assert torch.allclose(trl_k3, kl_penalty(d["logp"], d["ref_logp"], "k3") * mask)

    ref: dict = {
        "meta": {
            "generator": "scripts/algo_reference.py",
            "torch": torch.__version__,
            "trl": trl.__version__,
            "verl_formulas": "transcribed from verl 0.9.1 core_algos",
            "seed": SEED,
            "convention": "[batch, len] row-major flat lists; right-padded responses; "
            "score on the last valid token; outputs compared on the mask",
        },
        "batch": {
            "batch": B, "len": T, "vocab": V,
            "response_mask": out(mask), "has_eos": HAS_EOS, "group_ids": GROUP_IDS,
            **{k: out(d[k]) for k in [
                "logp", "ref_logp", "new_logp", "new_logp2", "values", "vpreds", "vpreds2",
                "scores", "baseline_scores", "logits", "ref_logits"]},
        },
    }

    # KL estimators
    lp_full = torch.log_softmax(d["logits"], -1)
    ref_full = torch.log_softmax(d["ref_logits"], -1)
    ref["kl_penalty"] = {k: out(kl_penalty(d["logp"], d["ref_logp"], k) * mask) for k in ["kl", "abs", "mse", "low_var_kl"]}
    ref["kl_penalty"]["full"] = out(kl_penalty(lp_full, ref_full, "full"))

    # per-token rewards
    reward_cases = [
        ({}, 0.05),
        ({"kl_penalty": "low_var_kl", "missing_eos_penalty": 1.0, "reward_clip": 2.5, "whiten_rewards": True}, 0.1),
        ({"kl_penalty": "abs", "use_kl_in_reward": False, "missing_eos_penalty": 0.5}, 0.2),
        ({"kl_penalty": "mse", "reward_clip": 1.0}, 0.3),
    ]
    ref["token_rewards"] = []
    rewards0 = None
    for cfg, coef in reward_cases:
        r, kl, nsr, sc = token_rewards(d["scores"], d["logp"], d["ref_logp"], mask, has_eos, coef, cfg)
        if rewards0 is None:
            rewards0, kl0, nsr0, sc0 = r, kl, nsr, sc
        ref["token_rewards"].append({
            "config": cfg, "kl_coef": coef,
            "rewards": out(r), "kl": out(kl), "non_score_reward": out(nsr), "scores": out(sc),
        })

    # advantages, all on the rewards of reward case 0 (padding filled with garbage so
    # the estimators must ignore it)
    R = rewards0 * mask + f32(40.0 * torch.randn(B, T, generator=g)) * (1 - mask)
    ref["advantage_rewards"] = out(R)
    adv_cases = []
    for gamma, lam in [(1.0, 0.95), (0.99, 0.9)]:
        white, ret, raw = compute_gae_advantage_return(R, d["values"], mask, gamma, lam)
        adv_cases.append({"config": {"adv_estimator": "gae", "gamma": gamma, "lam": lam},
                          "raw_advantages": out(raw), "advantages": out(white), "returns": out(ret)})
    for norm in [True, False]:
        a, r = compute_grpo_outcome_advantage(R * mask, mask, GROUP_IDS, 1e-6, norm)
        adv_cases.append({"config": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": norm},
                          "advantages": out(a), "returns": out(r)})
    a, r = compute_rloo_outcome_advantage(R * mask, mask, GROUP_IDS)
    adv_cases.append({"config": {"adv_estimator": "rloo"}, "advantages": out(a), "returns": out(r)})
    for gamma in [1.0, 0.9]:
        a, r = compute_reinforce_plus_plus_outcome_advantage(R * mask, mask, gamma)
        adv_cases.append({"config": {"adv_estimator": "reinforce_plus_plus", "gamma": gamma},
                          "advantages": out(a), "returns": out(r)})
    a, r = compute_reinforce_plus_plus_baseline_outcome_advantage(R * mask, mask, GROUP_IDS)
    adv_cases.append({"config": {"adv_estimator": "reinforce_plus_plus_baseline"}, "advantages": out(a), "returns": out(r)})
    a, r = compute_remax_outcome_advantage(R, d["baseline_scores"], mask)
    adv_cases.append({"config": {"adv_estimator": "remax"}, "advantages": out(a), "returns": out(r)})
    ref["advantages"] = adv_cases
    gae_adv, gae_ret, _ = compute_gae_advantage_return(R, d["values"], mask, 1.0, 0.95)
    gae_adv = gae_adv * mask

    # policy losses (advantages: whitened GAE, garbage on padding)
    A = gae_adv + f32(40.0 * torch.randn(B, T, generator=g)) * (1 - mask)
    ref["loss_advantages"] = out(A)
    policy_cases = [
        {},
        {"clip_ratio_c": None},
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "seq-mean-token-sum"},
        {"clip_ratio": 0.1, "clip_ratio_c": 2.0, "loss_agg_mode": "seq-mean-token-mean"},
    ]
    ref["policy_loss"] = []
    for cfg in policy_cases:
        lp = d["new_logp"].clone().requires_grad_(True)
        loss, cf, cfl, akl, pkl, rm = compute_policy_loss(d["logp"], lp, A, mask, cfg)
        loss.backward()
        ref["policy_loss"].append({
            "config": cfg, "loss": out(loss), "clipfrac": out(cf), "clipfrac_lower": out(cfl),
            "approxkl": out(akl), "ppo_kl": out(pkl), "ratio_mean": out(rm), "grad_logp": out(lp.grad),
        })
    Ret = gae_ret * mask + f32(40.0 * torch.randn(B, T, generator=g)) * (1 - mask)
    ref["loss_returns"] = out(Ret)
    value_cases = [
        {},
        {"cliprange_value": 0.1, "loss_agg_mode": "seq-mean-token-sum"},
        {"cliprange_value": 0.5, "loss_agg_mode": "seq-mean-token-mean"},
    ]
    ref["value_loss"] = []
    for cfg in value_cases:
        vp = d["vpreds"].clone().requires_grad_(True)
        loss, cf = compute_value_loss(vp, Ret, d["values"], mask, cfg.get("cliprange_value", 0.2),
                                      cfg.get("loss_agg_mode", "token-mean"))
        loss.backward()
        ref["value_loss"].append({"config": cfg, "loss": out(loss), "clipfrac": out(cf), "grad_vpreds": out(vp.grad)})

    # entropy (TRL's entropy_from_logits) and its aggregation
    ent = entropy_from_logits(d["logits"])
    ref["entropy"] = {
        "entropy": out(ent),
        "agg": {m: out(agg_loss(ent, mask, m)) for m in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]},
    }

    # KL losses (verl actor: agg_loss(kl_penalty(logp, ref_logp, kl_loss_type)))
    ref["kl_loss"] = []
    for kind, mode in [("low_var_kl", "token-mean"), ("kl", "seq-mean-token-mean"), ("mse", "seq-mean-token-sum")]:
        lp = d["new_logp"].clone().requires_grad_(True)
        loss = agg_loss(kl_penalty(lp, d["ref_logp"], kind), mask, mode)
        loss.backward()
        ref["kl_loss"].append({"kl_loss_type": kind, "loss_agg_mode": mode, "loss": out(loss), "grad_logp": out(lp.grad)})

    # actor loss (verl dp_actor.update_policy): pg - entropy_coeff * entropy + kl_loss_coef * kl_loss
    cfg = {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl"}
    lp = d["new_logp"].clone().requires_grad_(True)
    pg = compute_policy_loss(d["logp"], lp, A, mask, cfg)[0]
    ent_agg = agg_loss(ent, mask, "token-mean")
    klv = agg_loss(kl_penalty(lp, d["ref_logp"], "low_var_kl"), mask, "token-mean")
    loss = pg - 0.01 * ent_agg + 0.001 * klv
    loss.backward()
    ref["actor_loss"] = {"config": cfg, "loss": out(loss), "entropy": out(ent_agg), "kl_loss": out(klv), "grad_logp": out(lp.grad)}

    # masked statistics of the values
    vals = d["values"]
    ref["masked"] = {
        "mean": out(masked_mean(vals, mask)),
        "var_unbiased": out(masked_var(vals, mask, True)),
        "var_biased": out(masked_var(vals, mask, False)),
        "whiten": out(masked_whiten(vals, mask, True) * mask),
        "whiten_keep_mean": out(masked_whiten(vals, mask, False) * mask),
    }

    # KL controllers
    kls = [3.0, 8.0, 6.5, 100.0, 0.0, 5.9]
    ada, fix = AdaptiveKLController(0.2, 6.0, 10000), FixedKLController(0.05)
    trace = []
    for kl in kls:
        ada.update(kl, 256)
        fix.update(kl, 256)
        trace.append(ada.value)
    ref["kl_controller"] = {
        "config": {"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 10000.0},
        "n_steps": 256, "kls": kls, "adaptive_values": trace, "fixed_value": fix.value,
    }

    # metrics: TRL PPOTrainer.train's `metrics[...]` block, per-token averages over the
    # mask; two policy/value updates (epochs) so that val/ratio_var is non-trivial
    # verl metric_utils.compute_data_metrics for critic/* and response_length/mean.
    stats = {k: [] for k in ["approxkl", "clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio"]}
    for new_lp, vp, logits in [(d["new_logp"], d["vpreds"], d["logits"]), (d["new_logp2"], d["vpreds2"], 0.5 * d["logits"])]:
        pg_loss, cf, _, akl, _, rm = compute_policy_loss(d["logp"], new_lp, A, mask, {})
        vf_loss, vcf = compute_value_loss(vp, Ret, d["values"], mask, 0.2, "token-mean")
        stats["approxkl"].append(akl)
        stats["clipfrac"].append(cf)
        stats["pg_loss"].append(pg_loss)
        stats["vf_loss"].append(vf_loss)
        stats["vf_clipfrac"].append(vcf)
        stats["entropy"].append(masked_mean(entropy_from_logits(logits), mask))
        stats["ratio"].append(rm)
    st = {k: torch.stack(v) for k, v in stats.items()}
    mean_kl = (kl0 * mask).sum(1).mean()
    mean_entropy = (-d["logp"] * mask).sum(1).mean()
    mean_nsr = (nsr0 * mask).sum(1).mean()
    valid = mask.bool()
    v_ret, v_val = torch.masked_select(Ret, valid), torch.masked_select(d["values"], valid)
    ref["metrics"] = {
        "objective/kl": out(mean_kl),
        "objective/entropy": out(mean_entropy),
        "objective/non_score_reward": out(mean_nsr),
        "objective/rlhf_reward": out(mean_nsr + sc0.mean()),
        "objective/scores": out(sc0.mean()),
        "policy/approxkl_avg": out(st["approxkl"].mean()),
        "policy/clipfrac_avg": out(st["clipfrac"].mean()),
        "loss/policy_avg": out(st["pg_loss"].mean()),
        "loss/value_avg": out(st["vf_loss"].mean()),
        "val/clipfrac_avg": out(st["vf_clipfrac"].mean()),
        "policy/entropy_avg": out(st["entropy"].mean()),
        "val/ratio": out(st["ratio"].mean()),
        "val/ratio_var": out(st["ratio"].var()),
        "val/num_eos_tokens": float(sum(HAS_EOS)),
        "critic/advantages/mean": out(torch.masked_select(A, valid).mean()),
        "critic/returns/mean": out(v_ret.mean()),
        "critic/values/mean": out(v_val.mean()),
        "critic/vf_explained_var": out(1.0 - torch.var(v_ret - v_val) / (torch.var(v_ret) + 1e-5)),
        "response_length/mean": out(mask.sum(-1).mean()),
    }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(ref, separators=(",", ":"))
    args.out.write_text(text + "\n")
    print(f"wrote {args.out} ({len(text) / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
