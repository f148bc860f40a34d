#!/usr/bin/env python3
"""One PPO step computed the way TRL's PPOTrainer computes it, in PyTorch, on the project's own
tiny fixture models: the reference for precision alignment (tests/e2e/tests/trl_alignment.rs).

TRL's PPOTrainer cannot be run on a fixed batch (it generates its own responses), so the
step's formulas are transcribed from trl/experimental/ppo/ppo_trainer.py (`PPOTrainer.train`,
the section from "Response Processing 1" to the metrics dict) and trl/experimental/utils.py
(`get_reward`, `first_true_indices`), the same way scripts/algo_reference.py transcribes
verl. Every model forward is transformers' own.

Setup (mirrored by the `overrides` the script writes for `rlhf-head run`):
  policy     crates/rlhf-model/tests/fixtures/tiny-llama        (LlamaForCausalLM)
  reference  crates/rlhf-model/tests/fixtures/tiny-qwen2        (another policy, so KL != 0)
  reward     crates/rlhf-model/tests/fixtures/tiny-llama-reward (LlamaForSequenceClassification)
  critic     the reward model, as TRL's value model (AutoModelForSequenceClassification:
             `score` has no bias)
  tokenizer  the fixtures' tokenizer with eos = <|im_end|> and pad = <|endoftext|> (TRL needs
             pad != eos, or EOS tokens are treated as padding)
  batch      4 prompts of different lengths (left padding) and fixed responses given as token
             ids: EOS early, EOS in the last slot, no EOS at full length, no EOS and short.
  precision  float64 throughout (the exact maths; the Rust run is f32)
  step       greedy / fixed responses, temperature 1, k1 KL with a fixed coefficient,
             missing_eos_penalty, GAE, advantage whitening, 4 PPO epochs over one mini-batch
             (= one micro-batch), AdamW (eps 1e-6, see ADAM_EPS) without weight decay or
             clipping, TRL's score placement.

TRL averages four statistics over every slot of the padded batch, padding included:
`objective/entropy` adds -INVALID_LOGPROB (-1) per padded slot, and `policy/approxkl_avg`,
`policy/entropy_avg`, `val/ratio` (and so `val/ratio_var`) take `.mean()` over all slots.
The project averages over response tokens only. Both numbers are written: `metrics` holds the
masked forms (TRL's tensors, averaged over ~padding_mask), `trl_as_logged` what TRL logs.

Writes tests/e2e/fixtures/trl_ppo_step/{tokenizer/, prompts.jsonl, fixed_responses.jsonl,
reference.json}. Run through scripts/trl_reference.sh, which creates the virtual environment.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "crates/rlhf-model/tests/fixtures"
OUT = ROOT / "tests/e2e/fixtures/trl_ppo_step"

POLICY = "crates/rlhf-model/tests/fixtures/tiny-llama"
REFERENCE = "crates/rlhf-model/tests/fixtures/tiny-qwen2"
REWARD = "crates/rlhf-model/tests/fixtures/tiny-llama-reward"

PROMPTS = [
    "What is two plus two?",
    "Hello world!",
    "The fox runs.",
    "Café",
]
P = 16  # actor_rollout.max_prompt_length
R = 6  # actor_rollout.max_response_length

LR = 2e-4
KL_COEF = 0.05
GAMMA = 1.0
LAM = 0.95
CLIPRANGE = 0.2
CLIPRANGE_VALUE = 0.2
VF_COEF = 0.1
EPOCHS = 4
MISSING_EOS_PENALTY = 1.0
# AdamW epsilon (TRL's TrainingArguments.adam_epsilon). Not the default 1e-8: the critic starts
# as the reward model, so at TRL's score slot the value equals the score and the advantage there
# is exactly zero; the gradient it sends (e.g. to the EOS embedding) is rounding noise (~1e-9),
# which AdamW with eps 1e-8 turns into a step of a quarter of the learning rate in one
# implementation and none in another. eps 1e-6 keeps rounding noise from moving weights.
ADAM_EPS = 1e-6
TEMPERATURE = 1.0
INVALID_LOGPROB = 1.0  # TRL's constant


# --- TRL helpers, transcribed (trl/experimental/utils.py, trl/trainer/utils.py) ------------


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def forward(model, query_responses: torch.Tensor, pad_token_id: int):
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
    )


def backbone_hidden(model, query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    lm_backbone = getattr(model, model.base_model_prefix)
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    output = lm_backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
        use_cache=False,
    )
    # TRL reads hidden_states[-1]; it must be the final (normed) hidden state.
    assert torch.equal(output.hidden_states[-1], output.last_hidden_state)
    return output.hidden_states[-1]


def get_reward(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    reward_logits = model.score(backbone_hidden(model, query_responses, pad_token_id))
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    return (
        reward_logits,
        reward_logits[torch.arange(reward_logits.size(0)), sequence_lengths].squeeze(-1),
        sequence_lengths,
    )


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def truncate_response(stop_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.shape[1]).view(1, -1)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)


# --- fixtures ----------------------------------------------------------------------------


def write_tokenizer() -> tuple[Tokenizer, int, int]:
    """The fixtures' tokenizer with a stop token distinct from the pad token."""
    out = OUT / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIX / "tokenizer/tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((FIX / "tokenizer/tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|im_end|>"
    cfg["pad_token"] = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return tok, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")


def responses_for(vocab: int, eos: int, pad: int) -> list[list[int]]:
    rng = np.random.default_rng(7)

    def toks(n):
        return [int(t) for t in rng.integers(3, vocab, size=n)]

    rows = [
        toks(2) + [eos],  # EOS early: padding after it
        toks(R - 1) + [eos],  # EOS in the last slot: TRL's score stays on it
        toks(R),  # no EOS, full length: missing_eos_penalty, score on the last slot
        toks(3),  # no EOS and short: penalty, padding after it
    ]
    for r in rows:
        assert pad not in r and len(r) <= R
    return rows


def main() -> None:
    torch.manual_seed(0)
    np.random.seed(0)  # the epochs' row permutations (TRL draws them from numpy)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    OUT.mkdir(parents=True, exist_ok=True)
    tok, eos, pad = write_tokenizer()

    prompt_ids = [tok.encode(p, add_special_tokens=True).ids for p in PROMPTS]
    for p, ids in zip(PROMPTS, prompt_ids):
        assert 0 < len(ids) <= P and pad not in ids, (p, ids)
    resp = responses_for(tok.get_vocab_size(), eos, pad)
    with open(OUT / "prompts.jsonl", "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")
    with open(OUT / "fixed_responses.jsonl", "w") as f:
        for ids, r in zip(prompt_ids, resp):
            f.write(json.dumps({"prompt_ids": ids, "response_ids": r}) + "\n")

    # Left-padded queries, right-padded responses, as TRL's batches are.
    context_length = max(len(ids) for ids in prompt_ids)
    queries = torch.tensor([[pad] * (context_length - len(ids)) + ids for ids in prompt_ids])
    responses = torch.tensor([r + [pad] * (R - len(r)) for r in resp])
    query_responses = torch.cat([queries, responses], 1)

    # float64: the reference is the exact maths, so the comparison measures the Rust side's own
    # f32 error only (an f32 PyTorch run adds its own ~1e-7 per log-prob, which the KL and the
    # variance metrics amplify past 1e-5).
    torch.set_default_dtype(torch.float64)
    # sdpa: transformers' eager attention fills fully masked (left-padding) rows with NaN in
    # float64, and 0 * NaN then reaches the valid rows.
    kw = dict(dtype=torch.float64, attn_implementation="sdpa")
    policy = AutoModelForCausalLM.from_pretrained(ROOT / POLICY, **kw)
    ref_policy = AutoModelForCausalLM.from_pretrained(ROOT / REFERENCE, **kw)
    reward_model = AutoModelForSequenceClassification.from_pretrained(ROOT / REWARD, num_labels=1, **kw)
    value_model = AutoModelForSequenceClassification.from_pretrained(ROOT / REWARD, num_labels=1, **kw)
    assert value_model.score.bias is None, "TRL's value model has no score bias"
    for m in (policy, ref_policy, reward_model, value_model):
        m.train()  # no dropout in these configs; train() as in TRL's loop
    reward_model.eval()
    ref_policy.eval()

    with torch.no_grad():
        # The rollout: TRL takes the generation's logits; with fixed responses (precision
        # alignment) they are the policy's forward logits on the same sequences.
        out = forward(policy, query_responses, pad)
        logits = out.logits[:, context_length - 1 : -1] / (TEMPERATURE + 1e-7)
        logprobs = selective_log_softmax(logits, responses)
        ref_out = forward(ref_policy, query_responses, pad)
        ref_logits = ref_out.logits[:, context_length - 1 : -1] / (TEMPERATURE + 1e-7)
        ref_logprobs = selective_log_softmax(ref_logits, responses)

        postprocessed_responses = truncate_response(eos, pad, responses)
        postprocessed_query_responses = torch.cat((queries, postprocessed_responses), 1)
        sequence_lengths = first_true_indices(postprocessed_responses == pad) - 1
        full_value, _, _ = get_reward(value_model, query_responses, pad, context_length)
        values = full_value[:, context_length - 1 : -1].squeeze(-1)
        _, scores, _ = get_reward(reward_model, postprocessed_query_responses, pad, context_length)
        raw_scores = scores.clone()

        contain_eos_token = torch.any(postprocessed_responses == eos, dim=-1)
        scores[~contain_eos_token] -= MISSING_EOS_PENALTY

        response_idxs = torch.arange(responses.shape[1]).repeat(responses.shape[0], 1)
        padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
        logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
        ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
        sequence_lengths_p1 = sequence_lengths + 1
        padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
        values = torch.masked_fill(values, padding_mask_p1, 0)

        logr = ref_logprobs - logprobs
        kl = -logr  # k1
        non_score_reward = -KL_COEF * kl
        rewards = non_score_reward.clone()
        actual_start = torch.arange(rewards.size(0))
        actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
        rewards[actual_start, actual_end] += scores

        lastgaelam = 0
        advantages_reversed = []
        gen_length = responses.shape[1]
        for t in reversed(range(gen_length)):
            nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
            delta = rewards[:, t] + GAMMA * nextvalues - values[:, t]
            lastgaelam = delta + GAMMA * LAM * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], axis=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, ~padding_mask)
        advantages = torch.masked_fill(advantages, padding_mask, 0)

    # TRL trains policy and value with one optimizer on pg_loss + vf_coef * vf_loss; the two
    # networks share no parameter, so per-parameter AdamW equals two optimizers.
    params = list(policy.parameters()) + list(value_model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=0.0)
    valid = (~padding_mask).float()
    stats = {k: [] for k in ["approxkl", "approxkl_masked", "pg_clipfrac", "pg_loss", "vf_loss",
                             "vf_clipfrac", "entropy", "entropy_masked", "ratio", "ratio_masked"]}
    margins = []
    for _ in range(EPOCHS):
        # One mini-batch of the whole batch: the permutation only reorders rows.
        mb = np.random.permutation(len(PROMPTS))
        output = forward(policy, query_responses[mb], pad)
        vpred_temp = value_model.score(backbone_hidden(value_model, query_responses[mb], pad))
        logits = output.logits[:, context_length - 1 : -1]
        logits /= TEMPERATURE + 1e-7
        new_logprobs = selective_log_softmax(logits, responses[mb])
        new_logprobs = torch.masked_fill(new_logprobs, padding_mask[mb], INVALID_LOGPROB)
        vpred = vpred_temp[:, context_length - 1 : -1].squeeze(-1)
        vpred = torch.masked_fill(vpred, padding_mask_p1[mb], 0)
        vpredclipped = torch.clamp(vpred, values[mb] - CLIPRANGE_VALUE, values[mb] + CLIPRANGE_VALUE)
        vf_losses1 = torch.square(vpred - returns[mb])
        vf_losses2 = torch.square(vpredclipped - returns[mb])
        vf_loss_max = torch.max(vf_losses1, vf_losses2)
        vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1[mb])
        vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1[mb])
        logprobs_diff = new_logprobs - logprobs[mb]
        ratio = torch.exp(logprobs_diff)
        pg_losses = -advantages[mb] * ratio
        pg_losses2 = -advantages[mb] * torch.clamp(ratio, 1.0 - CLIPRANGE, 1.0 + CLIPRANGE)
        pg_loss_max = torch.max(pg_losses, pg_losses2)
        pg_loss = masked_mean(pg_loss_max, ~padding_mask[mb])
        loss = pg_loss + VF_COEF * vf_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            v = valid[mb]
            pg_clipfrac = masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask[mb])
            prob_dist = torch.nn.functional.softmax(logits, dim=-1)
            entropy = torch.logsumexp(logits, dim=-1) - torch.sum(prob_dist * logits, dim=-1)
            stats["approxkl"].append(0.5 * (logprobs_diff**2).mean())
            stats["approxkl_masked"].append(0.5 * masked_mean(logprobs_diff**2, v))
            stats["pg_clipfrac"].append(pg_clipfrac)
            stats["pg_loss"].append(pg_loss.detach())
            stats["vf_loss"].append(vf_loss.detach())
            stats["vf_clipfrac"].append(vf_clipfrac)
            stats["entropy"].append(entropy.mean())
            stats["entropy_masked"].append(masked_mean(entropy, v))
            stats["ratio"].append(ratio.mean())
            stats["ratio_masked"].append(masked_mean(ratio, v))
            # How close any ratio or value prediction sits to a clip boundary: a tie there
            # would make the clip fractions fragile across implementations.
            r = ratio[~padding_mask[mb]]
            margins.append(float(torch.min(torch.abs(torch.abs(r - 1.0) - CLIPRANGE))))
            d = (vpred - values[mb])[~padding_mask_p1[mb]]
            margins.append(float(torch.min(torch.abs(torch.abs(d) - CLIPRANGE_VALUE))))

    def avg(name):
        return float(torch.stack(stats[name]).mean())

    def var(name):
        return float(torch.stack(stats[name]).var())

    common = {
        "objective/kl": float(kl.sum(1).mean()),
        "objective/non_score_reward": float(non_score_reward.sum(1).mean()),
        "objective/rlhf_reward": float(non_score_reward.sum(1).mean() + scores.mean()),
        "objective/scores": float(scores.mean()),
        "policy/clipfrac_avg": avg("pg_clipfrac"),
        "loss/policy_avg": avg("pg_loss"),
        "loss/value_avg": avg("vf_loss"),
        "val/clipfrac_avg": avg("vf_clipfrac"),
        "val/num_eos_tokens": float((responses == eos).sum()),
        "lr": LR,
        "episode": float(len(PROMPTS)),
    }
    masked = dict(common)
    masked.update({
        "objective/entropy": float((-logprobs * valid).sum(1).mean()),
        "policy/approxkl_avg": avg("approxkl_masked"),
        "policy/entropy_avg": avg("entropy_masked"),
        "val/ratio": avg("ratio_masked"),
        "val/ratio_var": var("ratio_masked"),
    })
    logged = dict(common)
    logged.update({
        "objective/entropy": float((-logprobs).sum(1).mean()),
        "policy/approxkl_avg": avg("approxkl"),
        "policy/entropy_avg": avg("entropy"),
        "val/ratio": avg("ratio"),
        "val/ratio_var": var("ratio"),
    })

    overrides = [
        f"actor_rollout.model={POLICY}",
        f"ref.model={REFERENCE}",
        f"critic.model={REWARD}",
        "reward.kind=model",
        f"reward.model={REWARD}",
        "training.tokenizer_name_or_path=tests/e2e/fixtures/trl_ppo_step/tokenizer",
        "data.path=tests/e2e/fixtures/trl_ppo_step/prompts.jsonl",
        "data.shuffle=false",
        "data.apply_chat_template=false",
        "actor_rollout.fixed_responses_file=tests/e2e/fixtures/trl_ppo_step/fixed_responses.jsonl",
        "actor_rollout.do_sample=false",
        f"actor_rollout.temperature={TEMPERATURE}",
        f"actor_rollout.max_prompt_length={P}",
        f"actor_rollout.max_response_length={R}",
        "actor_rollout.num_samples_per_step=1",
        f"actor_rollout.ppo_mini_batch_size={len(PROMPTS)}",
        f"actor_rollout.ppo_epochs={EPOCHS}",
        "actor_rollout.shuffle_minibatch=false",
        f"actor_rollout.clip_ratio={CLIPRANGE}",
        "actor_rollout.clip_ratio_c=null",
        "actor_rollout.entropy_coeff=0.0",
        "actor_rollout.loss_agg_mode=token-mean",
        f"critic.cliprange_value={CLIPRANGE_VALUE}",
        f"critic.vf_coef={VF_COEF}",
        f"critic.critic_mini_batch_size={len(PROMPTS)}",
        f"critic.critic_update_epochs={EPOCHS}",
        "critic.shuffle_minibatch=false",
        f"critic.lr={LR}",
        f"training.global_batch_size={len(PROMPTS)}",
        f"training.micro_batch_size={len(PROMPTS)}",
        f"training.seq_length={P + R}",
        "training.train_iters=1",
        f"training.lr={LR}",
        "training.lr_decay_style=constant",
        "training.weight_decay=0.0",
        f"training.adam_eps={ADAM_EPS}",
        "training.clip_grad=0",
        "algorithm.adv_estimator=gae",
        f"algorithm.gamma={GAMMA}",
        f"algorithm.lam={LAM}",
        "algorithm.kl_penalty=kl",
        "algorithm.kl_ctrl.type=fixed",
        f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        f"algorithm.missing_eos_penalty={MISSING_EOS_PENALTY}",
        "algorithm.whiten_rewards=false",
        "algorithm.whiten_advantages=true",
        "algorithm.score_placement=trl",
        "resource_pool.device=CPU",
        "resource_pool.actor_rollout=2",
        "resource_pool.ref=1",
        "resource_pool.critic=1",
        "resource_pool.reward=1",
    ]
    ref = {
        "about": "One TRL PPOTrainer step (formulas from trl/experimental/ppo/ppo_trainer.py) on the "
        "fixed batch in this directory; made by scripts/trl_ppo_step_reference.py.",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "overrides": overrides,
        "metrics": masked,
        "trl_as_logged": logged,
        "padding_averaged": ["objective/entropy", "policy/approxkl_avg", "policy/entropy_avg",
                             "val/ratio", "val/ratio_var"],
        "clip_margin": min(margins),
        "batch": {
            "context_length": context_length,
            "sequence_lengths": sequence_lengths.tolist(),
            "raw_scores": raw_scores.tolist(),
            "scores": scores.tolist(),
            "score_slots": actual_end.tolist(),
            "values": values.tolist(),
            "advantages": advantages.tolist(),
            "returns": returns.tolist(),
        },
    }
    (OUT / "reference.json").write_text(json.dumps(ref, indent=2) + "\n")
    for k, v in masked.items():
        extra = "" if logged[k] == v else f"   (TRL logs {logged[k]:.9g})"
        print(f"{k:28s} {v:.9g}{extra}")
    print(f"closest ratio / value prediction to a clip boundary: {min(margins):.3g}")


if __name__ == "__main__":
    main()
