#!/usr/bin/env bash
# GPU bench at a real model's shape: rlhf-model (candle, CUDA) against PyTorch/transformers on
# Qwen2.5-0.5B's sizes (hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864,
# vocab 151936, Qwen2 with tied embeddings), cuda:0, bf16 (frozen bf16 model for generation
# and log-probs, bf16 mixed precision over f32 weights for training).
# Why: the CPU bench (scripts/model_bench.sh) says nothing about the GPU path the roles take
# on GPU machines; this compares it with what transformers does there, same work, same run.
# Runs on a GPU machine with no Rust toolchain: the Rust side is a prebuilt binary
# (scripts/gpu-build.sh makes it on a build machine), the PyTorch side any Python with
# torch + transformers. Prints the ratios as scripts/model_bench.sh does (which it runs).
#   PYTHON=python3                 the Python with torch + transformers
#   MODEL_BENCH=gpu-bin/model_bench the CUDA build of the model_bench example
#   REPEATS=3                      timed repetitions on the PyTorch side
# Extra flags override the defaults below, e.g. scripts/gpu_bench.sh --batches 1,8 --device cuda:1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

BIN="${MODEL_BENCH:-$ROOT/gpu-bin/model_bench}"
if [ "${BIN#/}" = "$BIN" ]; then BIN="$PWD/$BIN"; fi
if [ ! -x "$BIN" ]; then
    echo "error: no model_bench binary at $BIN; build it with scripts/gpu-build.sh on a build" \
         "machine and copy gpu-bin/ here (or set MODEL_BENCH)" >&2
    exit 2
fi
export MODEL_BENCH_BIN="$BIN"
export REF_PYTHON="${PYTHON:-python3}"

exec "$ROOT/scripts/model_bench.sh" \
    --device cuda:0 --dtype bf16 --family qwen2 --tie \
    --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936 \
    --prompt-len 128 --new-tokens 128 --batches 1,16,64 --train-batch 8 --train-seq 512 \
    "$@"
