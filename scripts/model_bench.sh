#!/usr/bin/env bash
# Bench: rlhf-model (candle) against PyTorch/transformers on the same model sizes, same run,
# on the CPU by default (--device cuda:0 for a GPU; scripts/gpu_bench.sh sets that up).
# Prints the JSON lines of both sides, then one JSON line per measurement (generation per
# batch size, no-grad log-probs, training step) with
# ratio = rust throughput / torch throughput (>= 1.0 means rlhf-model is faster).
# Extra flags are passed to both sides, e.g. scripts/model_bench.sh --layers 4 --new-tokens 32,
# or --device cuda:0 --dtype bf16 --family qwen2 --tie.
# --threads N pins both sides to N threads (torch.set_num_threads; RAYON_NUM_THREADS for candle).
# Set REPEATS to change the number of timed repetitions of the PyTorch side (default 3).
# Environment for machines without cargo or without the reference venv:
#   MODEL_BENCH_BIN=path  run this prebuilt model_bench binary instead of `cargo run`
#   REF_PYTHON=python     a Python that already has torch + transformers; no venv is made
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-ref}"
PY="${PYTHON:-python3}"
# Relative paths in the environment are meant from the caller's directory.
BIN="${MODEL_BENCH_BIN:-}"
if [ -n "$BIN" ] && [ "${BIN#/}" = "$BIN" ]; then BIN="$PWD/$BIN"; fi
cd "$ROOT"

FLAGS=(--hidden 512 --layers 6 --heads 8 --kv-heads 4 --intermediate 1408 --vocab 8192
       --prompt-len 16 --new-tokens 64 --train-batch 8 --train-seq 128 "$@")

# candle sizes its thread pool from RAYON_NUM_THREADS, read once at start-up.
prev=""
for arg in "$@"; do
    if [ "$prev" = "--threads" ] && [ "$arg" != "0" ]; then
        export RAYON_NUM_THREADS="$arg"
    fi
    case "$arg" in --threads=*) [ "${arg#--threads=}" != "0" ] && export RAYON_NUM_THREADS="${arg#--threads=}" ;; esac
    prev="$arg"
done

if [ -n "$BIN" ]; then
    if [ ! -x "$BIN" ]; then
        echo "error: MODEL_BENCH_BIN=$BIN is not an executable file" >&2
        exit 2
    fi
elif [ ! -f crates/rlhf-model/examples/model_bench.rs ] && [ ! -d crates/rlhf-model/examples/model_bench ]; then
    echo "error: the Rust side crates/rlhf-model/examples/model_bench.rs does not exist yet;" \
         "no ratio can be computed" >&2
    exit 2
fi

if [ -n "${REF_PYTHON:-}" ]; then
    REFPY="$REF_PYTHON"
    if ! "$REFPY" -c "import torch, transformers" 2>/dev/null; then
        echo "error: REF_PYTHON=$REFPY cannot import torch and transformers" >&2
        exit 2
    fi
else
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating virtual environment $VENV" >&2
        "$PY" -m venv "$VENV"
    fi
    if ! "$VENV/bin/python" -c "import torch, transformers, numpy" 2>/dev/null; then
        echo "installing torch, transformers, numpy into $VENV" >&2
        "$VENV/bin/pip" install --quiet torch transformers numpy
    fi
    REFPY="$VENV/bin/python"
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

if [ -n "$BIN" ]; then
    RUST=("$BIN")
else
    # Build first so that compile time is not mixed with the measurements.
    cargo build --release -q -p rlhf-model --example model_bench
    RUST=(cargo run --release -q -p rlhf-model --example model_bench --)
fi

echo "== pytorch" >&2
"$REFPY" scripts/model_bench.py "${FLAGS[@]}" --repeats "${REPEATS:-3}" | tee "$OUT/torch.jsonl"
echo "== rlhf-model" >&2
"${RUST[@]}" "${FLAGS[@]}" | tee "$OUT/rust.jsonl"

"$REFPY" - "$OUT/torch.jsonl" "$OUT/rust.jsonl" <<'PYEOF'
import json, sys

def load(path):
    rows = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        rows[(r["bench"], r.get("batch"))] = r
    return rows

torch_rows, rust_rows = load(sys.argv[1]), load(sys.argv[2])
missing = [k for k in torch_rows if k not in rust_rows]
for key, t in torch_rows.items():
    r = rust_rows.get(key)
    if r is None:
        continue
    if key[0] == "train_step":
        # Throughput is steps per second, so the ratio of throughputs is torch_s / rust_s.
        out = {"bench": key[0], "torch_seconds": round(t["seconds"], 4), "rust_seconds": round(r["seconds"], 4),
               "ratio": round(t["seconds"] / r["seconds"], 3)}
        if "tokens_per_s" in t and "tokens_per_s" in r:
            out["torch_tokens_per_s"] = round(t["tokens_per_s"], 2)
            out["rust_tokens_per_s"] = round(r["tokens_per_s"], 2)
    else:
        # generate (per batch size) and log_probs: tokens per second.
        out = {"bench": key[0]}
        if key[1] is not None:
            out["batch"] = key[1]
        out.update({"torch_tokens_per_s": round(t["tokens_per_s"], 2), "rust_tokens_per_s": round(r["tokens_per_s"], 2),
                    "ratio": round(r["tokens_per_s"] / t["tokens_per_s"], 3)})
    print(json.dumps(out))
if missing:
    print(f"error: the Rust bench printed no line for {missing}", file=sys.stderr)
    sys.exit(1)
PYEOF
