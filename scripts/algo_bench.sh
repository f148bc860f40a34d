#!/usr/bin/env bash
# PPO math bench: rlhf-algo (Rust, candle CPU) vs the same computation in PyTorch (CPU),
# measured in the same run on the same machine. The sides alternate for $ROUNDS
# rounds (default 3) so that load from other processes hits them alike. PyTorch
# runs twice per round: with its default thread count and with one thread (the
# Rust side is single-threaded; on a busy machine PyTorch's threads can lose more
# to contention than they gain). Each round prints the stage tables and ratios;
# the last lines give the median ratios pytorch_time / rust_time (> 1: Rust faster).
# Usage: [ROUNDS=3] scripts/algo_bench.sh [--batch 256 --len 1024 --iters 20]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${ROUNDS:-3}"

ratio() { python3 -c "import sys; print(f'{float(sys.argv[2]) / float(sys.argv[1]):.2f}')" "$1" "$2"; }

cargo build --release -p rlhf-algo --example algo_bench >&2
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
r_default=()
r_single=()
for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round"
    rust_out="$("$rel/examples/algo_bench" "$@")"
    torch_out="$(python3 "$ROOT/scripts/algo_bench.py" "$@")"
    torch1_out="$(python3 "$ROOT/scripts/algo_bench.py" --threads 1 "$@")"
    printf '%s\n%s\n%s\n' "$rust_out" "$torch_out" "$torch1_out"
    rust_ms="$(sed -n 's/^RESULT rust_median_ms=//p' <<<"$rust_out")"
    torch_ms="$(sed -n 's/^RESULT torch_median_ms=//p' <<<"$torch_out")"
    torch1_ms="$(sed -n 's/^RESULT torch_median_ms=//p' <<<"$torch1_out")"
    r_default+=("$(ratio "$rust_ms" "$torch_ms")")
    r_single+=("$(ratio "$rust_ms" "$torch1_ms")")
    echo "round $round: rust $rust_ms ms, pytorch $torch_ms ms (default threads), $torch1_ms ms (1 thread)"
done
python3 - "${r_default[*]}" "${r_single[*]}" <<'PY'
import statistics, sys
for label, arg in zip(["default threads", "1 thread"], sys.argv[1:]):
    r = [float(x) for x in arg.split()]
    print(f"median ratio pytorch_time / rust_time ({label}) = {statistics.median(r):.2f} "
          f"over {len(r)} rounds (min {min(r):.2f}, max {max(r):.2f})")
PY
