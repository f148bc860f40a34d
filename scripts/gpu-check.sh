#!/usr/bin/env bash
# Checks the CUDA build on a GPU machine: run from the repository root after the repository
# and gpu-bin/ (or gpu-bin.tar.xz) from scripts/gpu-build.sh were copied there.
#   scripts/gpu-check.sh [tests] [parity] [ipc] [ppo] [zero3] [bench]   (no step named: all)
# Why: the build machine has no GPU and the GPU machines have no Rust toolchain, so whether
# the CUDA paths work (and how fast they are) can only be learnt here, from prebuilt binaries.
# Steps, each under `== ...`:
#   nvidia-smi   the GPUs and the driver version (always)
#   libraries    the NVIDIA libraries of this machine's PyTorch install (site-packages
#                nvidia/*/lib) put on LD_LIBRARY_PATH, libnccl.so provided when only
#                libnccl.so.2 exists, and every binary checked for unresolved libraries (always)
#   tests        rlhf-model's integration tests (gpu-bin/tests/*), which run on cuda:0 too
#   parity       gpu-bin/gpu_parity: fixture models on cuda:0 (f32, bf16) against the CPU
#   ipc          gpu-bin/weight_ipc_bench: a 0.5B bf16 weight sync between two processes on
#                cuda:0 through CUDA IPC, checksummed, against mapping a handle and the host path
#   ppo          a 5-step ppo_tiny job with every role on a GPU (needs 4 GPUs), and the same
#                colocated on one GPU (resource_pool.colocate), in f32 and in bf16 with
#                checkpointing, chunked log-probs and LoRA on actor and critic, and with the
#                rollout as a process of its own (actor_rollout.hybrid_engine=false), whose
#                weights must go by CUDA IPC, and so again at ZeRO stage 3; with the trainer's
#                AdamW moments offloaded while it generates; and a colocated run whose
#                rollout batch cannot fit (PyTorch holds the rest of the GPU), which must
#                fail naming the remedy (PPO_RUNS="name ..." runs only the named ones)
#   zero3        gpu-bin/zero3_bench --device cuda: ZeRO-3 against plain data parallelism, two
#                rank processes on cuda:0, step time and GPU memory, on the tiny model and on
#                Qwen2.5-0.5B's shape (ZERO3_MODELS, default tiny,q05), computing in
#                ZERO3_DTYPE (f32, the default, or bf16: stage 3 then gathers bf16), over
#                ZERO3_COMM (tcp, the default, or shm)
#   bench        scripts/gpu_bench.sh, rlhf-model against PyTorch at Qwen2.5-0.5B's shape
# Ends with `gpu-check: P passed, F failed, S skipped`; exits 1 when anything failed.
#   PYTHON=python3          the Python with torch (+ transformers for the bench)
#   GPU_CHECK_TIMEOUT=600   seconds any one command may take
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
T="${GPU_CHECK_TIMEOUT:-600}"
BIN="$ROOT/gpu-bin"

ALL_STEPS="tests parity ipc ppo zero3 bench"
STEPS="${*:-$ALL_STEPS}"
for s in $STEPS; do
    case " $ALL_STEPS " in
        *" $s "*) ;;
        *) echo "gpu-check: unknown step $s (steps: $ALL_STEPS)" >&2; exit 2 ;;
    esac
done
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

PASSED=0
FAILED=0
SKIPPED=0
header() { printf '\n== %s\n' "$*"; }
pass() { PASSED=$((PASSED + 1)); echo "PASS $*"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL $*"; }
skip() { SKIPPED=$((SKIPPED + 1)); echo "SKIPPED $*"; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [ ! -d "$BIN" ] && [ -f gpu-bin.tar.xz ]; then
    echo "unpacking gpu-bin.tar.xz"
    timeout "$T" tar -xJf gpu-bin.tar.xz
fi
if [ ! -d "$BIN" ]; then
    echo "gpu-check: no gpu-bin/ (nor gpu-bin.tar.xz) here; build it with scripts/gpu-build.sh" \
         "on a build machine and copy it to the repository root" >&2
    exit 2
fi

# --- (a) GPUs and driver ---
header "nvidia-smi"
NGPU=0
if ! command -v nvidia-smi >/dev/null 2>&1; then
    fail "nvidia-smi: not found; this machine has no NVIDIA driver"
elif timeout "$T" nvidia-smi; then
    driver="$(timeout 60 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)" || true
    NGPU="$(timeout 60 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" || NGPU=0
    echo "driver version: ${driver:-unknown}; $NGPU GPU(s)"
    pass "nvidia-smi (driver ${driver:-unknown}, $NGPU GPU(s))"
else
    fail "nvidia-smi exited with an error"
fi

# --- (b) NVIDIA libraries from the PyTorch install ---
header "NVIDIA libraries"
nvdirs="$(timeout "$T" "$PY" - <<'PYEOF' 2>/dev/null
import glob, os, site

roots = []
try:
    import nvidia  # namespace package of NVIDIA's wheels (cublas, nccl, cu13, ...)
    roots += list(getattr(nvidia, "__path__", []))
except ImportError:
    pass
sites = list(getattr(site, "getsitepackages", lambda: [])())
sites.append(site.getusersitepackages())
roots += [os.path.join(s, "nvidia") for s in sites]
seen = []
for root in roots:
    for d in sorted(glob.glob(os.path.join(root, "*", "lib"))):
        d = os.path.realpath(d)
        if os.path.isdir(d) and d not in seen:
            seen.append(d)
print("\n".join(seen))
PYEOF
)" || nvdirs=""
if [ -z "$nvdirs" ]; then
    echo "no nvidia/*/lib directories found for $PY; relying on the system's libraries"
else
    while IFS= read -r d; do
        echo "  $d"
        LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done <<<"$nvdirs"
    export LD_LIBRARY_PATH
fi
# Loaders that ask for the development name libnccl.so find only libnccl.so.2 in the wheels.
nccl2=""
has_nccl_so=0
while IFS= read -r d; do
    [ -n "$d" ] || continue
    [ -e "$d/libnccl.so" ] && has_nccl_so=1
    [ -z "$nccl2" ] && [ -e "$d/libnccl.so.2" ] && nccl2="$d/libnccl.so.2"
done <<<"$nvdirs"
if [ "$has_nccl_so" = 0 ] && [ -n "$nccl2" ]; then
    mkdir -p "$TMP/nccl"
    ln -sfn "$nccl2" "$TMP/nccl/libnccl.so"
    export LD_LIBRARY_PATH="$TMP/nccl:$LD_LIBRARY_PATH"
    echo "  libnccl.so -> $nccl2 (in $TMP/nccl)"
fi
missing=""
for exe in "$BIN"/rlhf-worker "$BIN"/rlhf-head "$BIN"/rlhf "$BIN"/model_bench "$BIN"/gpu_parity "$BIN"/zero3_bench "$BIN"/weight_ipc_bench \
    "$BIN"/tests/*; do
    [ -f "$exe" ] || continue
    m="$(ldd "$exe" 2>&1 | awk '/not found/ {print $1}')" || true
    if [ -n "$m" ]; then missing+="$m"$'\n'; fi
done
missing="$(printf '%s' "$missing" | sort -u | tr '\n' ' ')"
if [ -n "$missing" ]; then
    fail "libraries: the binaries need libraries found nowhere: $missing(install the matching" \
         "CUDA 13 wheels, e.g. nvidia-curand for libcurand, into $PY's environment, or set LD_LIBRARY_PATH)"
else
    pass "libraries: every library of gpu-bin resolves"
fi

# --- (c) rlhf-model tests ---
if want tests; then
    header "rlhf-model tests on the GPU"
    # The tests read fixtures under the CARGO_MANIFEST_DIR baked in at build time: the build
    # machine's checkout. Make that path lead here when it does not exist.
    build_root="$(cat "$BIN/BUILD_ROOT" 2>/dev/null || true)"
    fixtures_ok=1
    if [ -z "$build_root" ]; then
        fail "tests: gpu-bin/BUILD_ROOT is missing; rebuild with scripts/gpu-build.sh"
        fixtures_ok=0
    elif [ ! -e "$build_root" ]; then
        if mkdir -p "$(dirname "$build_root")" && ln -sfn "$ROOT" "$build_root"; then
            echo "linked $build_root -> $ROOT (the tests' baked fixture path)"
        else
            fail "tests: cannot create $build_root -> $ROOT (the tests' baked fixture path); create it by hand"
            fixtures_ok=0
        fi
    fi
    if [ "$fixtures_ok" = 1 ] && [ ! -d "$build_root/crates/rlhf-model/tests/fixtures" ]; then
        fail "tests: $build_root exists but holds no crates/rlhf-model/tests/fixtures; point it at this repository"
        fixtures_ok=0
    fi
    if [ "$fixtures_ok" = 1 ]; then
        found=0
        for exe in "$BIN"/tests/*; do
            [ -f "$exe" ] || continue
            found=1
            name="$(basename "$exe")"
            echo "-- $name"
            if (cd crates/rlhf-model && timeout "$T" "$exe" --include-ignored --test-threads 1); then
                pass "tests/$name"
            else
                fail "tests/$name (exit $?)"
            fi
        done
        [ "$found" = 1 ] || fail "tests: gpu-bin/tests/ holds no test executable"
    fi
fi

# --- (d) parity of the GPU paths with the CPU ---
if want parity; then
    header "gpu_parity"
    rc=0
    timeout "$T" "$BIN/gpu_parity" "$ROOT/crates/rlhf-model/tests/fixtures" || rc=$?
    case "$rc" in
        0) pass "gpu_parity" ;;
        2) fail "gpu_parity: no GPU could be opened" ;;
        *) fail "gpu_parity (exit $rc)" ;;
    esac
fi

# --- (d2) CUDA IPC weight sync between two processes on one GPU ---
if want ipc; then
    header "weight_ipc_bench (trainer -> rollout on cuda:0 through CUDA IPC)"
    rc=0
    timeout "$T" "$BIN/weight_ipc_bench" --device cuda:0 --iters 5 || rc=$?
    if [ "$rc" = 0 ]; then pass "weight_ipc_bench"; else fail "weight_ipc_bench (exit $rc)"; fi
fi

# --- (e) a PPO job on the GPUs ---
# With 4 GPUs or more each role gets its own; with fewer, every role shares them
# (resource_pool.colocate: fractional bundles, the rollout inside the trainer process).
ppo_on_gpus() { # name, extra overrides...
    local name="$1" metrics="$TMP/$1/metrics.jsonl" rc=0 lines=0
    shift
    if [ -n "${PPO_RUNS:-}" ] && [[ " $PPO_RUNS " != *" $name "* ]]; then
        echo "ppo_tiny $name: not in PPO_RUNS, not run"
        return 0
    fi
    mkdir -p "$TMP/$name"
    timeout "$T" "$BIN/rlhf-head" run --config-name ppo_tiny resource_pool.device=GPU \
        training.train_iters=5 checkpoint.save_steps=0 checkpoint.dir="$TMP/$name/checkpoints" \
        logging.metrics_file="$metrics" logging.samples_file="$TMP/$name/samples.jsonl" \
        logging.progress=false "$@" 2>&1 | tee "$TMP/$name/out.log" || rc=$?
    [ -f "$metrics" ] && lines="$(wc -l <"$metrics")"
    if [ "$rc" = 0 ] && [ "$lines" -eq 5 ]; then
        pass "ppo_tiny $name: 5 steps, 5 metrics lines"
    else
        fail "ppo_tiny $name (exit $rc, $lines metrics lines, expected 5)"
    fi
}
# A colocated run whose rollout batch cannot fit: PyTorch holds all but 4 GiB of the GPU, and
# the rollout batch (64 prompts x 2048 samples) needs ~28 GiB (`rlhf-head check`). The job
# must fail by itself, naming the call and the settings that make it fit.
rollout_oom() {
    local d="$TMP/rollout-oom" rc=0 hog
    if [ -n "${PPO_RUNS:-}" ] && [[ " $PPO_RUNS " != *" rollout-oom "* ]]; then
        echo "ppo_tiny rollout-oom: not in PPO_RUNS, not run"
        return 0
    fi
    mkdir -p "$d"
    "$PY" - "$d/ready" <<'EOF' &
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
hog = torch.empty(max(free - (4 << 30), 0), dtype=torch.uint8, device="cuda")
open(sys.argv[1], "w").write(f"{hog.numel() >> 20} MiB held of {free >> 20} MiB free")
time.sleep(900)
EOF
    hog=$!
    for _ in $(seq 120); do [ -f "$d/ready" ] && break; sleep 0.5; done
    echo "rollout-oom: PyTorch holds $(cat "$d/ready" 2>/dev/null || echo nothing)"
    timeout "$T" "$BIN/rlhf-head" run --config-name ppo_tiny resource_pool.device=GPU \
        resource_pool.colocate=true training.global_batch_size=64 \
        actor_rollout.num_samples_per_step=2048 training.train_iters=2 checkpoint.save_steps=0 \
        checkpoint.dir="$d/checkpoints" logging.metrics_file="$d/metrics.jsonl" \
        logging.samples_file="$d/samples.jsonl" logging.progress=false \
        >"$d/out.log" 2>&1 || rc=$?
    kill "$hog" 2>/dev/null || true
    wait "$hog" 2>/dev/null || true
    grep -i -m3 "out of memory" "$d/out.log" || tail -20 "$d/out.log"
    if [ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -q "Generate: the device ran out of memory" "$d/out.log" \
        && grep -q "actor_rollout.num_samples_per_step" "$d/out.log"; then
        pass "ppo_tiny rollout-oom: failed (exit $rc) naming Generate and the settings that fit"
    else
        fail "ppo_tiny rollout-oom (exit $rc): no 'Generate: the device ran out of memory' remedy"
    fi
}
if want ppo; then
    header "ppo_tiny on GPUs"
    if [ "$NGPU" -ge 4 ]; then
        ppo_on_gpus "on-4-gpus"
    else
        skip "ppo_tiny with a GPU per role: needs 4 GPUs, this machine has $NGPU"
    fi
    if [ "$NGPU" -ge 1 ]; then
        ppo_on_gpus "colocated-on-one-gpu" resource_pool.colocate=true
        # bf16 mixed precision with the memory savers, and LoRA (the reference is the
        # trainer's base with the adapters off), on the same one GPU.
        ppo_on_gpus "colocated-bf16-lora" resource_pool.colocate=true training.bf16=true \
            training.gradient_checkpointing=true training.logits_chunk_size=7 \
            actor_rollout.lora.rank=8 actor_rollout.lora.alpha=16 critic.lora.rank=8
        # The rollout as a process of its own on the same GPU: the weights go by CUDA IPC.
        ppo_on_gpus "colocated-split-cuda-ipc" resource_pool.colocate=true \
            actor_rollout.hybrid_engine=false
        if [ ! -f "$TMP/colocated-split-cuda-ipc/out.log" ]; then
            :
        elif grep -q "weight sync: CUDA IPC" "$TMP/colocated-split-cuda-ipc/out.log"; then
            pass "ppo_tiny colocated-split-cuda-ipc: the weights went by CUDA IPC"
        else
            fail "ppo_tiny colocated-split-cuda-ipc: no 'weight sync: CUDA IPC' line in its log"
        fi
        # The colocated trainer's AdamW moments leave the GPU while it generates.
        ppo_on_gpus "colocated-offload-bf16" resource_pool.colocate=true \
            actor_rollout.offload=true training.bf16=true
        # ZeRO-3 on the GPU (one trainer rank: the model loaded in host memory, its pieces on
        # the GPU, every call gathering from its group), the rollout a process of its own.
        ppo_on_gpus "colocated-split-zero3" resource_pool.colocate=true \
            actor_rollout.hybrid_engine=false training.zero_stage=3
        rollout_oom
    else
        skip "ppo_tiny colocated: no GPU"
    fi
fi

# --- (e2) ZeRO-3 against plain data parallelism on the GPU ---
if want zero3; then
    header "zero3_bench (ZeRO-3 vs stage 0, two rank processes on cuda:0)"
    rc=0
    timeout "$T" "$BIN/zero3_bench" --device cuda --models "${ZERO3_MODELS:-tiny,q05}" \
        --dtype "${ZERO3_DTYPE:-f32}" --comm "${ZERO3_COMM:-tcp}" --steps 3 --rounds 1 || rc=$?
    if [ "$rc" = 0 ]; then pass "zero3_bench"; else fail "zero3_bench (exit $rc)"; fi
fi

# --- (f) bench against PyTorch ---
if want bench; then
    header "gpu_bench (rlhf-model vs PyTorch, Qwen2.5-0.5B shape, cuda:0, bf16)"
    rc=0
    PYTHON="$PY" MODEL_BENCH="$BIN/model_bench" timeout "$T" scripts/gpu_bench.sh || rc=$?
    if [ "$rc" = 0 ]; then pass "gpu_bench"; else fail "gpu_bench (exit $rc)"; fi
fi

echo
echo "gpu-check: $PASSED passed, $FAILED failed, $SKIPPED skipped"
[ "$FAILED" -eq 0 ]
