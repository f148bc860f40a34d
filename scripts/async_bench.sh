#!/usr/bin/env bash
# Async rollout bench: steps per second of sync, one_step_off and bounded(2) on a ppo_tiny-like
# job where generation and training take comparable time, next to the ideal overlap bound
# measured in the same run: bound = (G + T) / max(G, T), with G the generation time and T the
# rest of a sync step (experience, updates, sync), both medians of the sync run. Ratio =
# (sync step time / async step time) / bound; goal >= 0.9.
#
# Each role process computes on one thread (RAYON_NUM_THREADS=1) so that the rollout process
# and the trainer process can run side by side like two devices; on a 2-core machine the
# reference and the rollout still compete for a core while the trainers compute old log-probs,
# which the ratio shows. Rounds alternate the modes to spread machine noise.
# Usage: scripts/async_bench.sh [STEPS] [ROUNDS]   (defaults 30 and 2)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
rounds=${2:-2}
cargo build --release --workspace --bins
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export RAYON_NUM_THREADS=1

# GRPO (no critic), one epoch, high temperature (responses run to ~90 tokens), 8 sequences.
common=(training.train_iters="$steps" checkpoint.save_steps=0 logging.progress=false
  logging.sample_every=0 algorithm.adv_estimator=grpo actor_rollout.temperature=50
  training.seq_length=128 actor_rollout.max_response_length=96 actor_rollout.ppo_epochs=1
  training.global_batch_size=4 training.micro_batch_size=8)
modes=(sync one_step_off bounded)
for r in $(seq 1 "$rounds"); do
  for m in "${modes[@]}"; do
    extra=(actor_rollout.async.mode="$m")
    [ "$m" = bounded ] && extra+=(actor_rollout.async.max_staleness=2)
    "$rel"/rlhf-head run --config-name ppo_tiny "${common[@]}" "${extra[@]}" \
      "checkpoint.dir=$out/ckpt" "logging.metrics_file=$out/$m.$r.jsonl" \
      "logging.samples_file=$out/samples.jsonl" >"$out/run.log" 2>&1 ||
      { cat "$out/run.log"; exit 1; }
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(mode):
    r = []
    for i in range(1, rounds + 1):
        # The first steps warm caches and fill the pipeline.
        r += [json.loads(l) for l in open(f"{out}/{mode}.{i}.jsonl")][3:]
    return r
med = lambda rs, k: st.median(x[k] for x in rs)
sync = rows("sync")
g = med(sync, "timing_s/gen")
t = st.median(x["timing_s/step"] - x["timing_s/gen"] for x in sync)
bound = (g + t) / max(g, t)
base = med(sync, "timing_s/step")
print(f"sync phases (median s): generation G {g:.4f}, rest of the step T {t:.4f}; "
      f"ideal overlap bound (G+T)/max(G,T) = {bound:.3f}")
print(f"{'mode':<16}{'s/step':>9}{'steps/s':>9}{'speedup':>9}{'of bound':>10}{'staleness':>11}")
for m in ["sync", "one_step_off", "bounded"]:
    rs = rows(m)
    s = med(rs, "timing_s/step")
    sp = base / s
    lag = st.mean(x["rollout/staleness_mean"] for x in rs)
    name = "bounded(2)" if m == "bounded" else m
    print(f"{name:<16}{s:>9.4f}{1 / s:>9.2f}{sp:>9.3f}{sp / bound:>10.3f}{lag:>11.2f}")
PY
