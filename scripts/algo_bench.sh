#!/usr/bin/env bash
# PPO math bench: rlhf-algo (Rust, candle CPU) vs the same computation in PyTorch (CPU),
# measured in the same run on the same machine. Prints both stage tables and the
# ratio pytorch_time / rust_time (> 1 means the Rust side is faster).
# Usage: scripts/algo_bench.sh [--batch 256 --len 1024 --iters 20]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

cargo build --release -p rlhf-algo --example algo_bench >&2
rust_out="$("$ROOT/target/release/examples/algo_bench" "$@")"
torch_out="$(python3 "$ROOT/scripts/algo_bench.py" "$@")"
echo "$rust_out"
echo "$torch_out"

rust_ms="$(sed -n 's/^RESULT rust_median_ms=//p' <<<"$rust_out")"
torch_ms="$(sed -n 's/^RESULT torch_median_ms=//p' <<<"$torch_out")"
python3 - "$rust_ms" "$torch_ms" <<'PY'
import sys
rust, torch = map(float, sys.argv[1:3])
print(f"ratio pytorch_time / rust_time = {torch / rust:.2f}  (rust {rust:.2f} ms, pytorch {torch:.2f} ms)")
PY
