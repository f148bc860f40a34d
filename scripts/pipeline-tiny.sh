#!/usr/bin/env bash
# The whole pipeline on the shipped tiny data (data/pipeline/, made by
# scripts/pipeline_data.py), on CPU with an embedded head and worker per stage:
#   SFT (models/tiny learns to answer in digits)
#   -> a reward model from the SFT model, on preference pairs (digits over words)
#   -> PPO from the SFT model with that reward model as its reward
#   and, from the same SFT model, DPO on the same pairs.
# Prints each stage's first and last numbers (eval/*: the held-out pairs, data.eval_path). Outputs go under $OUT (default runs/pipeline).
# Extra arguments go to every stage, e.g. `training.seed=7`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/pipeline}"
STEPS="${STEPS:-30}"
# A short SFT leaves PPO something to learn: the reward model prefers answers in digits, and a
# policy after 30 SFT steps already answers in digits (its PPO starts at the top score).
SFT_STEPS="${SFT_STEPS:-8}"
PPO_STEPS="${PPO_STEPS:-40}"
cargo build --release -p rlhf-head -p rlhf-worker
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
head_bin="$rel"/rlhf-head
rm -rf "$OUT"
mkdir -p "$OUT"

stage() { # name config overrides...
  local name="$1" config="$2"
  shift 2
  "$head_bin" run --config-name "$config" \
    "checkpoint.dir=$OUT/$name/ckpt" "logging.metrics_file=$OUT/$name/metrics.jsonl" \
    "logging.samples_file=$OUT/$name/samples.jsonl" logging.progress=false "$@" \
    >"$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
}

ends() { # name metric...: each metric's mean over the first and the last 5 steps that log it
  python3 - "$OUT/$1/metrics.jsonl" "${@:2}" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for key in sys.argv[2:]:
    v = [r[key] for r in rows if key in r]
    k = min(5, len(v))
    print(f"  {key:<22} first {k}: {sum(v[:k]) / k:9.4f}   last {k}: {sum(v[-k:]) / k:9.4f}")
PY
}

stage sft sft_tiny "training.train_iters=$SFT_STEPS" "$@"
sft_model="$OUT/sft/ckpt/global_step_$SFT_STEPS/actor"
echo "sft ($sft_model)"
ends sft train/loss

stage rm rm_tiny "training.train_iters=$STEPS" "reward.model=$sft_model" "$@"
rm_model="$OUT/rm/ckpt/global_step_$STEPS/reward"
echo "reward model ($rm_model)"
ends rm train/loss accuracy margin eval/accuracy eval/margin

stage ppo ppo_tiny "training.train_iters=$PPO_STEPS" "actor_rollout.model=$sft_model" \
  "ref.model=$sft_model" "critic.model=$sft_model" reward.kind=model "reward.model=$rm_model" \
  resource_pool.reward=1 checkpoint.save_steps=0 "$@"
echo "ppo from the sft model, scored by the reward model"
ends ppo objective/scores objective/kl

stage dpo dpo_tiny "training.train_iters=$STEPS" "actor_rollout.model=$sft_model" \
  "ref.model=$sft_model" "$@"
echo "dpo from the sft model"
ends dpo train/loss rewards/margins rewards/accuracies eval/rewards/margins
