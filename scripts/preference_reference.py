#!/usr/bin/env python3
"""Reference numbers for the DPO family's and the reward model's losses and metrics
(crates/rlhf-algo/tests/fixtures/preference.json), computed by TRL's own trainer code on fixed
inputs: DPOTrainer._compute_loss (sigmoid, ipo), CPOTrainer.get_batch_loss_metrics (simpo, and
cDPO's label smoothing through its sigmoid loss on log-ratios), KTOTrainer._compute_loss (kto on
the pairs unpaired) and RewardTrainer.compute_loss (Bradley-Terry, margin, centering).

The trainers are not constructed (that needs a model, a dataset and accelerate's state): each
method runs on a namespace holding the attributes it reads, and a stand-in model returns the
fixed per-token log-probs (zero outside the completion, as TRL's fused head gives with labels
-100). Everything between those inputs and the numbers is TRL's code.

Run: python3 -m pip install torch trl==1.16.0; python3 scripts/preference_reference.py
"""

import json
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import trl
from trl.experimental.cpo import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.kto_trainer import KTOTrainer
from trl.trainer.reward_trainer import RewardTrainer

OUT = Path(__file__).resolve().parent.parent / "crates/rlhf-algo/tests/fixtures/preference.json"


class Accel:
    device = torch.device("cpu")

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather


def metrics_store():
    return defaultdict(lambda: defaultdict(list))


def inputs(pairs=5, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    def side():
        lens = torch.randint(1, length + 1, (pairs,), generator=g)
        mask = (torch.arange(length)[None, :] < lens[:, None]).float()
        logp = -torch.rand(pairs, length, generator=g, dtype=torch.float64) * 3.0
        return (logp * mask).float(), mask
    c_logp, c_mask = side()
    r_logp, r_mask = side()
    ref_c = (c_logp.sum(1) + torch.randn(pairs, generator=g) * 1.5).float()
    ref_r = (r_logp.sum(1) + torch.randn(pairs, generator=g) * 1.5).float()
    return c_logp, c_mask, r_logp, r_mask, ref_c, ref_r


def dpo(loss_type, beta, batch):
    c_logp, c_mask, r_logp, r_mask, ref_c, ref_r = batch
    pairs, length = c_logp.shape
    log_probs = torch.cat([c_logp, r_logp], 0)
    # TRL's completion_mask covers the whole sequence; its shifted view lines up with log_probs.
    completion_mask = torch.cat([torch.zeros(2 * pairs, 1), torch.cat([c_mask, r_mask], 0)], 1).long()
    out = SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros_like(log_probs),
        mean_logits=torch.zeros_like(log_probs),
        is_top1=torch.zeros_like(log_probs, dtype=torch.bool),
    )
    model = SimpleNamespace(training=True)
    me = SimpleNamespace(
        model=model, accelerator=Accel(), aux_loss_enabled=False, precompute_ref_logps=True,
        ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics=metrics_store(),
        _total_train_tokens=0, _tp_size=1,
    )
    batch_in = {
        "input_ids": torch.ones(2 * pairs, length + 1, dtype=torch.long),
        "attention_mask": torch.ones(2 * pairs, length + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_c,
        "ref_rejected_logps": ref_r,
    }
    loss = DPOTrainer._compute_loss(me, lambda **kw: out, batch_in, False)
    m = {k: v[-1] for k, v in me._metrics["train"].items()}
    keep = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"]
    return float(loss), {k: m[k] for k in keep}


def cpo(loss_type, beta, gamma, smoothing, chosen, rejected):
    me = SimpleNamespace(
        alpha=0.0, loss_type=loss_type, simpo_gamma=gamma, beta=beta, label_smoothing=smoothing,
        accelerator=Accel(), cpo_alpha=0.0, aux_loss_enabled=False,
    )
    me.cpo_loss = lambda a, b: CPOTrainer.cpo_loss(me, a, b)
    zeros = torch.zeros(1)
    me.concatenated_forward = lambda model, batch: (chosen, rejected, zeros, zeros, torch.tensor(0.0))
    loss, metrics = CPOTrainer.get_batch_loss_metrics(me, None, {})
    return float(loss), metrics


def simpo(beta, gamma, smoothing, batch):
    c_logp, c_mask, r_logp, r_mask, _, _ = batch
    # CPOTrainer.get_batch_logps(average_log_prob=True): the completion's mean log-prob.
    avg = lambda lp, m: (lp * m).sum(-1) / m.sum(-1)
    loss, m = cpo("simpo", beta, gamma, smoothing, avg(c_logp, c_mask), avg(r_logp, r_mask))
    keep = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"]
    return loss, {k: m[k] for k in keep}


def cdpo(beta, smoothing, batch):
    c_logp, c_mask, r_logp, r_mask, ref_c, ref_r = batch
    # cDPO is the CPO sigmoid loss of the log-ratios (its rewards are then DPO's).
    loss, m = cpo("sigmoid", beta, 0.0, smoothing, c_logp.sum(1) - ref_c, r_logp.sum(1) - ref_r)
    keep = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    return loss, {k: m[k] for k in keep}


def kto(beta, dw, uw, batch, kl_logps, ref_kl_logps):
    c_logp, c_mask, r_logp, r_mask, ref_c, ref_r = batch
    pairs, length = c_logp.shape
    log_probs = torch.cat([c_logp, r_logp], 0)
    completion_mask = torch.cat([torch.zeros(2 * pairs, 1), torch.cat([c_mask, r_mask], 0)], 1).long()
    ids = torch.ones(2 * pairs, length + 1, dtype=torch.long)
    kl_ids = torch.ones(2 * pairs, 2, dtype=torch.long)
    main = SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros_like(log_probs),
        mean_logits=torch.zeros_like(log_probs),
    )
    kl_out = SimpleNamespace(log_probs=kl_logps[:, None])

    def model(**kw):
        return kl_out if kw["input_ids"] is kl_ids else main

    me = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Accel(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=beta,
        desirable_weight=dw, undesirable_weight=uw, _metrics=metrics_store(),
        _total_train_tokens=0, _tp_size=1,
    )
    me._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(me, m, b)
    batch_in = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": completion_mask,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(kl_ids),
        "KL_completion_mask": torch.ones_like(kl_ids),
        "label": torch.tensor([True] * pairs + [False] * pairs),
        "ref_logps": torch.cat([ref_c, ref_r]),
        "ref_KL_logps": ref_kl_logps,
    }
    loss = KTOTrainer._compute_loss(me, model, batch_in, False)
    m = {k: v[-1] for k, v in me._metrics["train"].items()}
    keep = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"]
    return float(loss), {k: m[k] for k in keep}


def reward(chosen, rejected, margin, center):
    me = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Accel(),
        args=SimpleNamespace(center_rewards_coefficient=center), _metrics=metrics_store(),
        _total_train_tokens=0, _tp_size=1,
    )
    logits = torch.cat([chosen, rejected])[:, None]
    inp = {"attention_mask": torch.ones(logits.shape[0], 3, dtype=torch.long)}
    if margin is not None:
        inp["margin"] = margin
    loss = RewardTrainer.compute_loss(me, lambda **kw: SimpleNamespace(logits=logits), inp)
    m = {k: v[-1] for k, v in me._metrics["train"].items()}
    return float(loss), {k: m[k] for k in ["accuracy", "margin", "min_reward", "mean_reward", "max_reward"]}


def tolist(t):
    return t.tolist()


def main():
    cases = []
    for seed, (kind, cfg) in enumerate([
        ("sigmoid", {"beta": 0.1}),
        ("sigmoid", {"beta": 0.5, "label_smoothing": 0.2}),
        ("ipo", {"beta": 0.3}),
        ("simpo", {"beta": 2.0, "simpo_gamma": 0.5}),
        ("simpo", {"beta": 2.5, "simpo_gamma": 1.2, "label_smoothing": 0.1}),
        ("kto", {"beta": 0.2, "desirable_weight": 1.0, "undesirable_weight": 1.5}),
        ("kto", {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}),
    ]):
        batch = inputs(seed=seed)
        c_logp, c_mask, r_logp, r_mask, ref_c, ref_r = batch
        case = {
            "loss_type": kind, **cfg,
            "chosen_logp": tolist(c_logp), "chosen_mask": tolist(c_mask),
            "rejected_logp": tolist(r_logp), "rejected_mask": tolist(r_mask),
            "ref_chosen": tolist(ref_c), "ref_rejected": tolist(ref_r),
        }
        if kind == "sigmoid" and cfg.get("label_smoothing", 0) > 0:
            loss, m = cdpo(cfg["beta"], cfg["label_smoothing"], batch)
        elif kind in ("sigmoid", "ipo"):
            loss, m = dpo(kind, cfg["beta"], batch)
        elif kind == "simpo":
            loss, m = simpo(cfg["beta"], cfg["simpo_gamma"], cfg.get("label_smoothing", 0.0), batch)
        else:
            g = torch.Generator().manual_seed(100 + seed)
            kl = -torch.rand(2 * c_logp.shape[0], generator=g) * 8.0
            ref_kl = kl - torch.randn(2 * c_logp.shape[0], generator=g) * (0.5 if seed % 2 else 2.0) + 0.3
            loss, m = kto(cfg["beta"], cfg["desirable_weight"], cfg["undesirable_weight"], batch, kl, ref_kl)
            case["kl_logps"], case["ref_kl_logps"] = tolist(kl), tolist(ref_kl)
        case["loss"], case["metrics"] = loss, m
        cases.append(case)

    rewards = []
    for seed, (with_margin, center) in enumerate([(False, None), (True, None), (True, 0.01)]):
        g = torch.Generator().manual_seed(200 + seed)
        chosen, rejected = torch.randn(6, generator=g) * 2, torch.randn(6, generator=g) * 2
        margin = torch.rand(6, generator=g) if with_margin else None
        loss, m = reward(chosen, rejected, margin, center)
        rewards.append({
            "chosen": tolist(chosen), "rejected": tolist(rejected),
            "margin": None if margin is None else tolist(margin),
            "center_rewards_coefficient": center, "loss": loss, "metrics": m,
        })

    doc = {
        "generated_by": "scripts/preference_reference.py",
        "trl": trl.__version__,
        "torch": torch.__version__,
        "preference": cases,
        "reward": rewards,
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} preference cases, {len(rewards)} reward cases) with TRL {trl.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
