#!/usr/bin/env bash
# ZeRO stage 1 bench (training.zero_stage): sft_tiny on two trainer ranks with the whole AdamW
# state on each rank (zero_stage 0) against each rank keeping half of it (1), rounds
# alternating to spread machine noise. Prints the median step time of each and the ratio, and
# checks that both runs logged the same losses (the sharded step is exact).
# Usage: scripts/zero_bench.sh [STEPS] [ROUNDS]   (defaults 20 and 3)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
rounds=${2:-3}
cargo build --release --workspace --bins
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

common=(training.train_iters="$steps" logging.progress=false checkpoint.save_steps=0
  resource_pool.actor_rollout=2 actor_rollout.num_gpus_for_train=2)
for r in $(seq 1 "$rounds"); do
  for zero in 0 1; do
    target/release/rlhf-head run --config-name sft_tiny "${common[@]}" \
      "training.zero_stage=$zero" "checkpoint.dir=$out/ckpt" \
      "logging.metrics_file=$out/$zero.$r.jsonl" "logging.samples_file=$out/samples.jsonl" \
      >"$out/run.log" 2>&1 || { cat "$out/run.log"; exit 1; }
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(zero):
    return [[json.loads(l) for l in open(f"{out}/{zero}.{i}.jsonl")] for i in range(1, rounds + 1)]
plain, zero = rows(0), rows(1)
for a, b in zip(plain, zero):
    assert [x["train/loss"] for x in a] == [x["train/loss"] for x in b], "losses differ"
# The first steps warm caches.
step = lambda runs: st.median(x["timing_s/step"] for r in runs for x in r[2:])
sa, sb = step(plain), step(zero)
print(f"zero_stage 0: median step {sa:.4f} s")
print(f"zero_stage 1: median step {sb:.4f} s   (AdamW moments per rank: 1/2)")
print(f"zero 1 / zero 0 step time: {sb / sa:.3f}   (same losses at every step)")
PY
