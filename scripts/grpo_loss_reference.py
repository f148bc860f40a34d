#!/usr/bin/env python3
"""Reference numbers for the GRPO family's policy losses and GRPO's reward scaling
(crates/rlhf-algo/tests/fixtures/grpo_losses.json), computed by TRL 1.16's own code on fixed
inputs.

Losses: GRPOTrainer._compute_loss runs on a namespace holding the attributes it reads (the
trainer is not constructed: that needs a model, a dataset and accelerate's state), with a
stand-in for the per-token log-prob computation that returns a fixed leaf tensor. Everything
between those log-probs and the loss, its gradient (autograd's, taken on the leaf) and the
logged metrics is TRL's code. Each case covers one `loss_type` (grpo, bnpo, dr_grpo, dapo,
cispo, sapo) at one `importance_sampling_level` (token, sequence); cases with two
micro-batches run as one gradient-accumulation window of two steps, so the per-micro-batch
normalizers (dapo's `num_items_in_batch`, the others' division by the accumulation steps) are
part of the reference. Inputs are f32 values; TRL computes on them in f64, so the fixture holds
the exact result that an f32 implementation approximates.

Advantages: TRL computes them inside `_generate_and_score_completions`, which cannot run
without generation; the few lines that turn the rewards into advantages for
`scale_rewards` group / batch / none (multi_objective_aggregation sum_then_normalize) are
repeated in `advantages()` below, calling TRL's own `nanstd`.

Run: python3 -m pip install torch trl==1.16.0; python3 scripts/grpo_loss_reference.py
"""

import json
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import trl
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

OUT = Path(__file__).resolve().parent.parent / "crates/rlhf-algo/tests/fixtures/grpo_losses.json"

ROWS, WIDTH, GROUP = 6, 7, 3


class Accel:
    """One process: gathers and reductions are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather

    @staticmethod
    def reduce(t, reduction="sum"):
        return t


def f32(t):
    """Rounds to f32 values and computes in f64 from there."""
    return t.float().double()


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    # lengths 1..WIDTH, at least one full row; no empty row (TRL counts empty rows in its
    # per-sequence means, this crate does not)
    lens = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    lens[seed % ROWS] = WIDTH
    mask = (torch.arange(WIDTH)[None, :] < lens[:, None]).double()
    old = f32(-torch.rand(ROWS, WIDTH, generator=g, dtype=torch.float64) * 3.0) * mask
    # a per-row drift moves whole sequences out of the clip range, token noise single tokens
    drift = (torch.rand(ROWS, 1, generator=g, dtype=torch.float64) - 0.5) * 0.7
    noise = torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64) * 0.25
    logp = f32(old + drift + noise) * mask
    ref = f32(logp + torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64) * 0.3) * mask
    adv = f32(torch.randn(ROWS, generator=g, dtype=torch.float64))
    return logp, old, ref, adv, mask


def trl_loss(case, logp, old, ref, adv, mask, ga, total_tokens):
    """One micro-batch through GRPOTrainer._compute_loss: the loss, d loss / d logp, metrics."""
    leaf = logp.clone().requires_grad_(True)
    rows = logp.shape[0]
    args = SimpleNamespace(
        use_bias_correction_kl=False,
        delta=None,
        sapo_temperature_pos=case.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=case.get("sapo_temperature_neg", 1.05),
        steps_per_generation=ga,
    )
    me = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=Accel(),
        args=args,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=case["importance_sampling_level"],
        beta=case.get("beta", 0.0),
        loss_type=case["trl_loss_type"],
        epsilon_low=case["epsilon_low"],
        epsilon_high=case["epsilon_high"],
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=ga,
        max_completion_length=case.get("max_completion_length", WIDTH),
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    me._get_per_token_logps_and_entropies = lambda *a, **kw: (leaf, torch.zeros_like(leaf), None)
    inputs = {
        "prompt_ids": torch.ones(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.ones(rows, WIDTH, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(total_tokens)),
    }
    loss = GRPOTrainer._compute_loss(me, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in me._metrics["train"].items() if k != "entropy"}
    return float(loss.detach()), leaf.grad, metrics


def advantages(rewards, scale_rewards):
    """The reward-to-advantage lines of TRL 1.16's _generate_and_score_completions
    (sum_then_normalize, one reward function of weight 1, every completion scored)."""
    mean_grouped = torch.nanmean(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    if scale_rewards in ["group", "none"]:
        std = nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean_grouped
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv


# (name, TRL loss_type, our policy_loss, our loss_agg_mode, level, micro-batches, settings)
CASES = [
    ("grpo", "grpo", "ppo", "seq-mean-token-mean", "token", 2, {}),
    ("bnpo", "bnpo", "ppo", "token-mean", "token", 1, {}),
    ("dr_grpo", "dr_grpo", "ppo", "seq-mean-token-sum-norm", "token", 2, {"max_completion_length": 9}),
    ("dapo", "dapo", "ppo", "token-mean", "token", 2, {"epsilon_high": 0.28}),
    ("gspo", "grpo", "ppo", "seq-mean-token-mean", "sequence", 2, {"epsilon_low": 3e-4, "epsilon_high": 4e-4}),
    ("gspo_wide", "grpo", "ppo", "seq-mean-token-mean", "sequence", 1, {"epsilon_low": 0.05, "epsilon_high": 0.1}),
    ("gspo_dapo", "dapo", "ppo", "token-mean", "sequence", 2, {"epsilon_low": 0.02, "epsilon_high": 0.03}),
    ("cispo", "cispo", "cispo", "token-mean", "token", 2, {"epsilon_high": 1.15}),
    ("cispo_sequence", "cispo", "cispo", "token-mean", "sequence", 1, {"epsilon_high": 1.05}),
    ("sapo", "sapo", "sapo", "seq-mean-token-mean", "token", 2, {}),
    ("sapo_sequence", "sapo", "sapo", "seq-mean-token-mean", "sequence", 1,
     {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}),
    ("bnpo_kl", "bnpo", "ppo", "token-mean", "token", 1, {"beta": 0.04}),
]


def main():
    cases = []
    for seed, (name, loss_type, policy, agg, level, micro, extra) in enumerate(CASES):
        logp, old, ref, adv, mask = batch(seed)
        case = {
            "name": name,
            "trl_loss_type": loss_type,
            "policy_loss": policy,
            "loss_agg_mode": agg,
            "importance_sampling_level": level,
            "epsilon_low": 0.2,
            "epsilon_high": 0.2,
            **extra,
        }
        total_tokens = int(mask.sum())
        per = ROWS // micro
        parts = []
        for k in range(micro):
            s = slice(k * per, (k + 1) * per)
            loss, grad, metrics = trl_loss(case, logp[s], old[s], ref[s], adv[s], mask[s], micro, total_tokens)
            parts.append({
                "logp": logp[s].tolist(), "old_logp": old[s].tolist(), "ref_logp": ref[s].tolist(),
                "advantages": adv[s].tolist(), "mask": mask[s].tolist(),
                "loss": loss, "grad": grad.tolist(), "metrics": metrics,
            })
        case["num_tokens"] = total_tokens
        case["num_seqs"] = ROWS
        case["micro_batches"] = parts
        cases.append(case)

    adv_cases = []
    for seed, scale in enumerate(["group", "batch", "none"]):
        g = torch.Generator().manual_seed(300 + seed)
        rewards = f32(torch.randn(2 * GROUP, generator=g, dtype=torch.float64) * 2.0 + 0.5)
        adv_cases.append({
            "scale_rewards": scale, "group_size": GROUP, "epsilon": 1e-4,
            "rewards": rewards.tolist(), "advantages": advantages(rewards, scale).tolist(),
        })

    doc = {
        "generated_by": "scripts/grpo_loss_reference.py",
        "trl": trl.__version__,
        "torch": torch.__version__,
        "losses": cases,
        "advantages": adv_cases,
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} loss cases, {len(adv_cases)} advantage cases) with TRL {trl.__version__}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
