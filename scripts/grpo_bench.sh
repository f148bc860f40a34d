#!/usr/bin/env bash
# GRPO-family loss math bench: rlhf-algo (Rust, candle CPU) against the same computation by
# TRL 1.16's own code in PyTorch (CPU), measured in the same run on the same machine. For each
# loss (grpo, bnpo, dr_grpo, dapo, gspo, cispo, sapo) one step's algorithm math on 256 x 4096
# tokens: the group advantages from the scores, the policy loss and its gradient w.r.t. the
# log-probs (crates/rlhf-algo/examples/grpo_bench.rs, scripts/grpo_bench.py). The sides
# alternate for $ROUNDS rounds (default 3) so that load from other processes hits them alike;
# PyTorch runs with its default thread count and with one thread. The script checks that both
# sides computed the same loss and gradient (fails otherwise) and ends with, per loss, the
# median times and the median ratio pytorch_time / rust_time (> 1: Rust faster).
# Needs torch and trl 1.16 in $PYTHON (default python3; python3 -m pip install torch trl==1.16.0).
# Usage: [ROUNDS=3] [PYTHON=python3] scripts/grpo_bench.sh [--batch 256 --len 4096 --group 8 --iters 10 --losses grpo,sapo]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${ROUNDS:-3}"
PYTHON="${PYTHON:-python3}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

cargo build --release -p rlhf-algo --example grpo_bench >&2
for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round"
    "$ROOT/target/release/examples/grpo_bench" "$@" | tee "$OUT/rust.$round" | grep -v '^RESULT'
    "$PYTHON" "$ROOT/scripts/grpo_bench.py" "$@" | tee "$OUT/torch.$round" | grep -v '^RESULT'
    "$PYTHON" "$ROOT/scripts/grpo_bench.py" --threads 1 "$@" | tee "$OUT/torch1.$round" | grep -v '^RESULT'
done
"$PYTHON" - "$OUT" "$ROUNDS" <<'PY'
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])


def parse(path):
    results = {}
    for line in open(path):
        if line.startswith("RESULT "):
            fields = dict(f.split("=", 1) for f in line.split()[1:])
            results[fields["loss"]] = fields
    return results


# Both sides must have computed the same thing. The losses are means of O(1) per-token terms
# that largely cancel (the advantages of a group sum to 0), so a loss near 0 is compared to an
# absolute floor of 1e-6 (f32 sums in a different order differ by ~1e-7); the sum of |gradient|
# does not cancel and is compared relatively.
TOLERANCE = {"loss_value": (1e-4, 1e-6), "grad_abs_sum": (1e-4, 0.0)}
sides = {"default threads": "torch", "1 thread": "torch1"}
times, ratios, disagree = {}, {}, []
for r in range(1, rounds + 1):
    rust = parse(f"{out}/rust.{r}")
    for label, name in sides.items():
        torch = parse(f"{out}/{name}.{r}")
        for loss, ours in rust.items():
            theirs = torch[loss]
            rust_ms, torch_ms = float(ours["rust_median_ms"]), float(theirs["torch_median_ms"])
            times.setdefault(loss, {}).setdefault("rust", []).append(rust_ms)
            times[loss].setdefault(label, []).append(torch_ms)
            ratios.setdefault(loss, {}).setdefault(label, []).append(torch_ms / rust_ms)
            for key, (rel, floor) in TOLERANCE.items():
                a, b = float(ours[key]), float(theirs[key])
                if abs(a - b) > max(rel * abs(b), floor):
                    disagree.append(f"round {r}, {loss}, {label}: {key} rust {a} vs pytorch {b}")

print(f"\nmedians over {rounds} rounds; ratio = pytorch_time / rust_time (> 1: Rust faster), "
      "min-max over the rounds")
print(f"{'loss':<8} {'rust ms':>8} {'pytorch ms':>11} {'ratio':>6} {'(min-max)':>12}"
      f" {'1-thread ms':>12} {'ratio':>6} {'(min-max)':>12}")
med = statistics.median
for loss in times:
    row = f"{loss:<8} {med(times[loss]['rust']):8.2f}"
    for label in sides:
        r = ratios[loss][label]
        row += (f" {med(times[loss][label]):{11 if label == 'default threads' else 12}.2f}"
                f" {med(r):6.2f} {f'({min(r):.2f}-{max(r):.2f})':>12}")
    print(row)
if disagree:
    print("\nthe two sides disagree:\n  " + "\n  ".join(disagree), file=sys.stderr)
    sys.exit(1)
print("\nboth sides agree on every loss value (1e-4 relative, or 1e-6 absolute near 0) "
      "and sum of |gradient| (1e-4 relative)")
PY
