#!/usr/bin/env bash
# PPO bench: a step's timing breakdown from a real ppo_tiny run (release build), then
# experience-batch transfer (64 and 256 MiB to a separate actor process) and bucketed weight
# sync between two ranks' TCP communicators, each next to a raw TCP loopback copy of the same
# bytes measured in the same run (ratio = raw time / our time; goal >= 0.5).
# Usage: scripts/ppo_bench.sh [STEPS]   (default 20)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
# One build of the whole workspace (binaries and examples) so that every piece is compiled
# once with the same unified features; per-package builds would compile shared crates again.
cargo build --release --workspace --bins --examples
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== PPO step breakdown: ppo_tiny, $steps steps (embedded head + worker, 5 role processes)"
"$rel"/rlhf-head run --config-name ppo_tiny "training.train_iters=$steps" \
  checkpoint.save_steps=0 logging.progress=false logging.sample_every=0 \
  "checkpoint.dir=$out/ckpt" "logging.metrics_file=$out/metrics.jsonl" \
  "logging.samples_file=$out/samples.jsonl" >"$out/run.log" 2>&1 || { cat "$out/run.log"; exit 1; }
python3 - "$out/metrics.jsonl" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = rows[1:] or rows  # the first step warms caches up
keys = ["gen", "old_log_prob", "ref", "values", "reward", "experience", "adv",
        "update_actor", "update_critic", "sync_weights", "step"]
step = statistics.median(r["timing_s/step"] for r in rows)
print(f"{'phase':<16}{'median s':>10}{'share':>8}")
for k in keys:
    v = statistics.median(r[f"timing_s/{k}"] for r in rows)
    note = "  (old log-probs, ref, values, reward at once)" if k == "experience" else ""
    print(f"{k:<16}{v:>10.4f}{v / step:>8.1%}{note}")
print(f"perf/throughput  {statistics.median(r['perf/throughput'] for r in rows):.0f} tokens/s")
PY

echo
echo "== experience-batch transfer to an actor process vs raw TCP copy"
"$rel"/examples/transfer_bench --sizes 64,256 --reps 3
echo
echo "== weight sync (bucketed broadcast) and collectives vs raw TCP copy"
"$rel"/examples/collective_bench --sizes-mib 64,256 --iters 3
