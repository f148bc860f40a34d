#!/usr/bin/env bash
# Recovery bench (fault_tolerance): a ppo_tiny run with a checkpoint every 2 steps; after step
# KILL_AT the critic's process is SIGKILLed, and the script prints, as seconds after that
# death: detected (the driver's "restart 1/N" line), every role running again (the next
# "placed ... role processes" line) and the next step done (the first progress line after
# "resuming from"). Goals: detected <= 5 s, next step done <= 30 s. MEMORY=1 keeps the
# checkpoints in the worker's memory too (checkpoint.memory_snapshot) and prints where the
# restart loaded them from.
# Usage: [MEMORY=1] scripts/recovery_bench.sh [KILL_AT] [BACKOFF_S]   (defaults 5 and 1)
set -euo pipefail
cd "$(dirname "$0")/.."
kill_at=${1:-5}
backoff=${2:-1}
memory=false
[ "${MEMORY:-0}" = 0 ] || memory=true
cargo build --release --workspace --bins
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
out=$(mktemp -d)
trap 'kill "$run_pid" 2>/dev/null || true; rm -rf "$out"' EXIT
# Not a TTY: one progress line per step.
"$rel"/rlhf-head run --config-name ppo_tiny training.train_iters=20 \
  checkpoint.save_steps=2 "fault_tolerance.restart_backoff_s=$backoff" \
  "checkpoint.memory_snapshot=$memory" \
  "checkpoint.dir=$out/ckpt" "logging.metrics_file=$out/metrics.jsonl" \
  "logging.samples_file=$out/samples.jsonl" >"$out/run.log" 2>&1 &
run_pid=$!
now() { date +%s.%N; }
deadline=$(( $(date +%s) + 600 ))
while [ "$(wc -l 2>/dev/null <"$out/metrics.jsonl" || echo 0)" -lt "$kill_at" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "no step $kill_at in 600 s"; cat "$out/run.log"; exit 1; }
  kill -0 "$run_pid" 2>/dev/null || { cat "$out/run.log"; exit 1; }
  sleep 0.05
done
critic=$(pgrep -P "$run_pid" -f -- "--kind critic" | head -1)
t0=$(now)
kill -9 "$critic"
detected="" running="" next=""
deadline=$(( $(date +%s) + 120 ))
while [ -z "$next" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "no recovery in 120 s"; cat "$out/run.log"; exit 1; }
  [ -n "$detected" ] || ! grep -q '^restart 1/' "$out/run.log" || detected=$(now)
  [ -n "$running" ] || [ "$(grep -c '^placed ' "$out/run.log")" -lt 2 ] || running=$(now)
  [ -n "$next" ] || ! awk '/^resuming from/{r=1; next} r && /^step /{f=1} END{exit !f}' "$out/run.log" || next=$(now)
  sleep 0.02
done
from=$(grep -o 'from [^ ]*global_step_[0-9]*' "$out/run.log" | head -1)
echo "critic SIGKILLed after step $kill_at; restart $from (backoff ${backoff} s)"
grep 'checkpoint loaded from' "$out/run.log" || true
python3 - "$t0" "$detected" "$running" "$next" <<'PY'
import sys
t0, d, r, n = map(float, sys.argv[1:])
print(f"detected          {d - t0:6.2f} s   (goal <= 5)")
print(f"roles running     {r - t0:6.2f} s")
print(f"next step done    {n - t0:6.2f} s   (goal <= 30)")
PY
if wait "$run_pid"; then
  echo "the run finished by itself"
else
  echo "the run failed"
  tail -20 "$out/run.log"
  exit 1
fi
