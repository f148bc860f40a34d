#!/usr/bin/env bash
# SFT packing bench (data.packing): sft_tiny with 8 rows per step, one example per row against
# packed rows (several examples back to back, best-fit decreasing), rounds alternating to
# spread machine noise. Both steps have the same shape ([8, 48] tokens), so the step costs the
# same; packing puts more trained tokens in it. Prints the median trained tokens per second
# (train/tokens_per_s: completion tokens over the update's wall time) of each, and the ratio.
# Usage: scripts/sft_packing_bench.sh [STEPS] [ROUNDS]   (defaults 20 and 3)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
rounds=${2:-3}
cargo build --release --workspace --bins
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

common=(training.train_iters="$steps" logging.progress=false checkpoint.save_steps=0
  training.global_batch_size=8 training.micro_batch_size=8)
for r in $(seq 1 "$rounds"); do
  for packing in false true; do
    "$rel"/rlhf-head run --config-name sft_tiny "${common[@]}" \
      "data.packing=$packing" "checkpoint.dir=$out/ckpt" \
      "logging.metrics_file=$out/$packing.$r.jsonl" "logging.samples_file=$out/samples.jsonl" \
      >"$out/run.log" 2>&1 || { cat "$out/run.log"; exit 1; }
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(packing):
    r = []
    for i in range(1, rounds + 1):
        # The first steps warm caches.
        r += [json.loads(l) for l in open(f"{out}/{packing}.{i}.jsonl")][2:]
    return r
plain, packed = rows("false"), rows("true")
a = st.median(x["train/tokens_per_s"] for x in plain)
b = st.median(x["train/tokens_per_s"] for x in packed)
sa = st.median(x["timing_s/step"] for x in plain)
sb = st.median(x["timing_s/step"] for x in packed)
print(f"one example per row: {a:9.1f} trained tokens/s, median step {sa:.4f} s")
print(f"packed rows:         {b:9.1f} trained tokens/s, median step {sb:.4f} s")
print(f"packed / one per row: {b / a:.2f}x trained tokens per second")
PY
