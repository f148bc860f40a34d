#!/usr/bin/env python3
"""PyTorch baseline for crates/rlhf-algo/examples/grpo_bench.rs: the algorithm math of one
GRPO step on a batch of 256 x 4096 tokens, for each loss of the GRPO family, as TRL 1.16
computes it, so that scripts/grpo_bench.sh can print the ratio against the Rust side measured
in the same run.

One timed iteration per loss: the group advantages from the scores (the lines of TRL's
`_generate_and_score_completions`, `scale_rewards: group`, calling TRL's own `nanstd`), then
`GRPOTrainer._compute_loss` on a namespace holding the attributes it reads (as
scripts/grpo_loss_reference.py does: the trainer needs a model, a dataset and accelerate's
state to be built) with a stand-in for the model's per-token log-probs and entropies that
returns fixed tensors, and `backward()` to the log-probs. Everything between the log-probs and
the loss, its gradient and its logged metrics is TRL's code, in f32 as a trainer runs it.

The inputs come from a counter-based hash that the Rust side implements bit for bit, so both
sides see the same f32 numbers; each loss prints its value and the sum of |gradient| for the
shell script to compare. The last lines are machine-readable:
`RESULT loss=<name> torch_median_ms=<ms> loss_value=<v> grad_abs_sum=<g>`.

Needs torch and trl 1.16 (python3 -m pip install torch trl==1.16.0).
Usage: grpo_bench.py [--batch 256 --len 4096 --group 8 --iters 10 --threads 0 --losses grpo,sapo]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

try:
    import torch
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd
except ImportError as e:
    sys.exit(f"grpo_bench.py needs torch and trl 1.16 ({e}); install them with "
             "`python3 -m pip install torch trl==1.16.0` and point PYTHON at that interpreter")

# name -> (TRL loss_type, importance_sampling_level, epsilon_low, epsilon_high). The Rust side
# maps each name to its policy_loss / loss_agg_mode / importance_sampling_level.
LOSSES = {
    "grpo": ("grpo", "token", 0.2, 0.2),
    "bnpo": ("bnpo", "token", 0.2, 0.2),
    "dr_grpo": ("dr_grpo", "token", 0.2, 0.2),
    "dapo": ("dapo", "token", 0.2, 0.28),
    # GSPO's recommended clip range; TRL's GSPO is loss_type grpo at the sequence level
    "gspo": ("grpo", "sequence", 3e-4, 4e-4),
    # under cispo TRL's epsilon_high is the cap on the importance weight
    "cispo": ("cispo", "token", 0.2, 5.0),
    "sapo": ("sapo", "token", 0.2, 0.2),
}

M32 = 0xFFFFFFFF


def mul32(x, c):
    """(x * c) mod 2^32 for an int64 tensor x < 2^32, without overflowing int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def lowbias32(x):
    """Chris Wellons' lowbias32 integer hash, on a Python int or an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32 if isinstance(x, int) else mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32 if isinstance(x, int) else mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(n, stream):
    """n numbers in [0, 1) with 24 bits, exact in f32 and f64: element i of `stream`."""
    i = torch.arange(n, dtype=torch.int64)
    h = lowbias32((i + lowbias32(stream)) & M32)
    return (h >> 8).double() / float(1 << 24)


def inputs(b, t):
    """The bench's batch; grpo_bench.rs builds the same numbers (computed in f64, rounded to f32)."""
    lens = (t // 4 + torch.floor(uniform(b, 1) * (t - t // 4 + 1))).clamp(max=t)
    mask = (torch.arange(t, dtype=torch.float64)[None, :] < lens[:, None]).float()
    scores = (uniform(b, 2) * 4.0 - 2.0).float()
    old = (-3.0 * uniform(b * t, 3)).float().view(b, t)
    drift = (uniform(b, 4) - 0.5) * 0.01
    noise = ((uniform(b * t, 5) - 0.5) * 0.4).view(b, t)
    logp = ((old.double() + drift[:, None]) + noise).float()
    entropy = (uniform(b * t, 6) * 2.0).float().view(b, t)
    return mask, scores, old, logp, entropy


def trl_advantages(rewards, num_generations):
    """TRL 1.16 `_generate_and_score_completions`, sum_then_normalize with one reward function
    of weight 1, every completion scored, `scale_rewards: group`."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
    std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # noqa: F841 (logged by TRL)
    return torch.nan_to_num(advantages, nan=0.0)


class Accel:
    """One process: gathers and reductions are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trainer(name, leaf, entropy, t):
    """The attributes GRPOTrainer._compute_loss reads, for one micro-batch per step."""
    loss_type, level, eps_low, eps_high = LOSSES[name]
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, steps_per_generation=1)
    me = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Accel(), args=args,
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=t, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    me._get_per_token_logps_and_entropies = lambda *a, **kw: (leaf, entropy, None)
    return me


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--losses", default=",".join(LOSSES), help="comma-separated subset of " + ",".join(LOSSES))
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    b, t, g = args.batch, args.len, args.group
    if b % g:
        sys.exit(f"--batch {b} is not a multiple of --group {g}")
    names = args.losses.split(",")
    for n in names:
        if n not in LOSSES:
            sys.exit(f"unknown loss {n}; choose from {','.join(LOSSES)}")

    mask, scores, old, logp, entropy = inputs(b, t)
    leaf = logp.clone().requires_grad_(True)
    batch = {
        "prompt_ids": torch.ones(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    print(f"pytorch {torch.__version__} trl {trl.__version__} GRPO bench: batch {b} x len {t}, group {g}, "
          f"{int(mask.sum())} valid tokens, {args.iters} iterations, {torch.get_num_threads()} threads (median ms)")
    results = []
    for name in names:
        me = trainer(name, leaf, entropy, t)
        times = []
        for it in range(args.iters + 2):
            start = time.perf_counter()
            batch["advantages"] = trl_advantages(scores, g)
            leaf.grad = None
            loss = GRPOTrainer._compute_loss(me, None, batch)
            loss.backward()
            value = loss.item()
            elapsed = (time.perf_counter() - start) * 1e3
            if it >= 2:
                times.append(elapsed)
        med = sorted(times)[len(times) // 2]
        grad_abs = leaf.grad.double().abs().sum().item()
        print(f"  {name:<8} {med:9.3f}   (loss {value:.6e}, sum |grad| {grad_abs:.6e})")
        results.append(f"RESULT loss={name} torch_median_ms={med:.4f} loss_value={value:.9e} grad_abs_sum={grad_abs:.9e}")
    print("\n".join(results))


if __name__ == "__main__":
    main()
