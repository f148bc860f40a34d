#!/usr/bin/env python3
"""PyTorch baseline for crates/rlhf-algo/examples/algo_bench.rs: one PPO step's
math for a batch of 256 x 1024 tokens, the way TRL's PPOTrainer and verl's
core_algos compute it (per-token rewards with KL and the score on the last
valid token, GAE as verl's masked reverse loop over columns, masked whitening,
verl's clipped policy loss with dual clip, clipped value loss, TRL metrics with
`.item()`), timed as the median over iterations after two warm-ups.

Run through scripts/algo_bench.sh, which also runs the Rust side and prints the
ratio. The last line is machine-readable: `RESULT torch_median_ms=<total>`.
Needs torch (the script re-runs itself inside $VENV, default .venv-ref, when
torch is missing, creating it if needed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ensure_env() -> None:
    try:
        import torch  # noqa: F401

        return
    except ImportError:
        pass
    venv = Path(os.environ.get("VENV", ROOT / ".venv-ref"))
    py = venv / "bin" / "python"
    if Path(sys.prefix).resolve() == venv.resolve():
        sys.exit(f"torch still missing in {venv}; install it with {venv}/bin/pip install torch")
    if not py.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    if subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode != 0:
        subprocess.check_call([str(venv / "bin" / "pip"), "install", "--quiet", "torch", "numpy"])
    os.execv(str(py), [str(py), str(Path(__file__).resolve())] + sys.argv[1:])


ensure_env()

import torch  # noqa: E402


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def masked_var(values, mask):
    mean = masked_mean(values, mask)
    n = mask.sum()
    return masked_mean((values - mean) ** 2, mask) * n / (n - 1)


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    w = (values - mean) * torch.rsqrt(var + 1e-8)
    return w if shift_mean else w + mean


def step(d, kl_coef=0.05, gamma=1.0, lam=0.95, clip=0.2, clip_c=3.0, cliprange_value=0.2):
    mask, logp, ref_logp = d["mask"], d["logp"], d["ref_logp"]
    B, T = mask.shape
    lap = []
    t0 = time.perf_counter()
    # rewards: missing-EOS penalty, k1 KL, score on the last valid token
    scores = d["scores"].clone()
    scores[~d["has_eos"]] -= 1.0
    kl = (logp - ref_logp) * mask
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    last = mask.sum(1).long() - 1
    rewards[torch.arange(B), last] += scores
    lap.append(time.perf_counter())
    # verl compute_gae_advantage_return + masked_whiten
    values = d["values"]
    nextvalues = 0
    lastgaelam = 0
    rev = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    returns = adv + values
    adv = masked_whiten(adv, mask) * mask
    lap.append(time.perf_counter())
    # verl compute_policy_loss_vanilla, token-mean
    new_logp = d["new_logp"]
    neg_kl = torch.clamp(new_logp - logp, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    c1 = torch.maximum(pg1, pg2)
    clipfrac = masked_mean(torch.gt(pg2, pg1).float(), mask)
    pg3 = -adv * clip_c
    c2 = torch.min(pg3, c1)
    clipfrac_lower = masked_mean(torch.gt(c1, pg3) * (adv < 0).float(), mask)
    pg = torch.where(adv < 0, c2, c1)
    pg_loss = masked_mean(pg, mask)
    approxkl = masked_mean(0.5 * (new_logp - logp) ** 2, mask)
    ratio_mean = masked_mean(ratio, mask)
    stats = [x.item() for x in (clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean)]
    lap.append(time.perf_counter())
    # verl compute_value_loss, token-mean
    vpreds = d["vpreds"]
    vclip = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    l1 = (vpreds - returns) ** 2
    l2 = (vclip - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(l1, l2), mask)
    vf_clipfrac = masked_mean(torch.gt(l2, l1).float(), mask).item()
    lap.append(time.perf_counter())
    # metrics (TRL names; verl critic/*)
    m = {}
    m["objective/kl"] = kl.sum(1).mean().item()
    m["objective/entropy"] = (-logp * mask).sum(1).mean().item()
    nsr = non_score_reward.sum(1).mean()
    m["objective/non_score_reward"] = nsr.item()
    m["objective/rlhf_reward"] = (nsr + scores.mean()).item()
    m["objective/scores"] = scores.mean().item()
    m["policy/approxkl_avg"] = stats[2]
    m["policy/clipfrac_avg"] = stats[0]
    m["loss/policy_avg"] = pg_loss.item()
    m["loss/value_avg"] = vf_loss.item()
    m["val/clipfrac_avg"] = vf_clipfrac
    m["val/ratio"] = stats[4]
    m["val/num_eos_tokens"] = int(d["has_eos"].sum().item())
    valid = mask.bool()
    v_adv = torch.masked_select(adv, valid)
    v_ret = torch.masked_select(returns, valid)
    v_val = torch.masked_select(values, valid)
    m["critic/advantages/mean"] = v_adv.mean().item()
    m["critic/returns/mean"] = v_ret.mean().item()
    m["critic/values/mean"] = v_val.mean().item()
    m["critic/vf_explained_var"] = (1.0 - torch.var(v_ret - v_val) / (torch.var(v_ret) + 1e-5)).item()
    m["response_length/mean"] = mask.sum(-1).mean().item()
    lap.append(time.perf_counter())
    laps = [t0] + lap
    return [(b - a) * 1e3 for a, b in zip(laps, laps[1:])], m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    B, T = args.batch, args.len
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    logp = -2.0 * torch.rand(B, T, generator=g) - 0.01
    d = {
        "mask": mask,
        "has_eos": lengths < T,
        "logp": logp,
        "ref_logp": logp + 0.1 * torch.randn(B, T, generator=g),
        "new_logp": logp + 0.2 * torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "scores": 2.0 * torch.randn(B, generator=g),
    }
    d["vpreds"] = d["values"] + 0.3 * torch.randn(B, T, generator=g)

    stages = ["rewards", "gae+whiten", "policy_loss", "value_loss", "metrics"]
    times = [[] for _ in range(len(stages) + 1)]
    with torch.no_grad():
        for it in range(args.iters + 2):
            laps, m = step(d)
            if it >= 2:
                for i, x in enumerate(laps):
                    times[i].append(x)
                times[-1].append(sum(laps))

    def median(v):
        return sorted(v)[len(v) // 2]

    print(f"pytorch {torch.__version__} bench: batch {B} x len {T}, {args.iters} iterations, "
          f"{torch.get_num_threads()} threads (median ms)")
    for s, v in zip(stages, times):
        print(f"  {s:<12} {median(v):8.3f}")
    total = median(times[-1])
    print(f"  {'total':<12} {total:8.3f}   (checksum {m['loss/policy_avg'] + m['loss/value_avg']:.6f})")
    print(f"RESULT torch_median_ms={total:.4f}")


if __name__ == "__main__":
    main()
