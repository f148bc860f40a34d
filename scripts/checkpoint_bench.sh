#!/usr/bin/env bash
# Checkpoint cost bench (fault_tolerance): ppo_tiny with a checkpoint after every step
# (checkpoint.save_steps=1) against the same run with none (save_steps=0), rounds alternating
# to spread machine noise. Prints the median step time of each (timing_s/step: wall time
# between two steps' ends, the previous checkpoint included), the time a step waits for its
# checkpoint (the copy of the state; the files are written while the next step runs) and the
# overhead ratio. Goal: save_steps=1 costs <= 5 % of step time. A third variant also keeps
# every checkpoint in the embedded worker's memory (checkpoint.memory_snapshot=true: the
# writer thread pushes each directory after the disk write).
# Usage: scripts/checkpoint_bench.sh [STEPS] [ROUNDS]   (defaults 30 and 3)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
rounds=${2:-3}
cargo build --release --workspace --bins
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

common=(training.train_iters="$steps" logging.progress=false logging.sample_every=0
  checkpoint.keep_last=2)
for r in $(seq 1 "$rounds"); do
  for v in 0 1 1m; do
    every=${v%m}
    memory=false
    [ "$v" = "$every" ] || memory=true
    rm -rf "$out/ckpt"
    "$rel"/rlhf-head run --config-name ppo_tiny "${common[@]}" \
      "checkpoint.save_steps=$every" "checkpoint.dir=$out/ckpt" \
      "checkpoint.memory_snapshot=$memory" \
      "logging.metrics_file=$out/$v.$r.jsonl" "logging.samples_file=$out/samples.jsonl" \
      >"$out/run.log" 2>&1 || { cat "$out/run.log"; exit 1; }
  done
  [ -f "$out/ckpt/global_step_$steps/trainer_state.json" ] ||
    { echo "no committed checkpoint of the last step"; ls -R "$out/ckpt"; exit 1; }
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(every):
    r = []
    for i in range(1, rounds + 1):
        # The first steps warm caches.
        r += [json.loads(l) for l in open(f"{out}/{every}.{i}.jsonl")][2:]
    return r
off, on, mem = rows(0), rows(1), rows("1m")
s_off = st.median(x["timing_s/step"] for x in off)
s_on = st.median(x["timing_s/step"] for x in on)
s_mem = st.median(x["timing_s/step"] for x in mem)
wait = st.median(x["timing_s/checkpoint"] for x in on)
print(f"median step time, no checkpoints      {s_off:.4f} s")
print(f"median step time, checkpoint per step {s_on:.4f} s")
print(f"  of which waiting for the checkpoint {wait:.4f} s ({wait / s_on:.1%} of the step)")
print(f"  ... plus a memory snapshot per step {s_mem:.4f} s")
print(f"overhead ratio on/off                 {s_on / s_off:.3f}   (goal <= 1.05)")
print(f"overhead ratio on+memory/off          {s_mem / s_off:.3f}")
PY
