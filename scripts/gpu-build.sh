#!/usr/bin/env bash
# Builds the CUDA binaries for a GPU machine, here on a build machine with no GPU:
#   scripts/gpu-build.sh
# Why: the GPU machines have a driver and PyTorch but no Rust toolchain and no CUDA toolkit,
# and only the repository plus a small payload travel there. This builds, against the
# minimal CUDA 13.0 toolkit of scripts/cuda-toolkit.sh, in release mode with CUDA:
#   rlhf-worker, rlhf-head, rlhf          the orchestrator (a PPO job on the GPUs)
#   model_bench, gpu_parity, zero3_bench  the rlhf-model examples (scripts/gpu_bench.sh, parity,
#                                         ZeRO-3 against plain data parallelism)
#   weight_ipc_bench                      the CUDA IPC weight sync between two processes
#   tests/{gradients,memory_paths,generation,reference,zero3,zero3_lora}
#                                         rlhf-model's integration tests, which also run on cuda:0
# and copies them, stripped, into gpu-bin/ (git-ignored) with gpu-bin/BUILD_ROOT, this
# checkout's path: the tests find their fixtures under the CARGO_MANIFEST_DIR baked in at
# compile time, and scripts/gpu-check.sh links that path to the repository on the GPU machine.
# Nothing else is copied: the fixtures, configs and models travel with the repository.
# The repository plus gpu-bin/ must stay under 64 MiB (what one transfer to a GPU machine
# carries); when gpu-bin/ does not fit it is also packed into gpu-bin.tar.xz (git-ignored
# too), and when even that does not fit the script says so loudly and exits 3.
#   RLHF_CUDA_TARGET_DIR   cargo target dir (default ~/.cache/rlhf-cuda-target), kept apart
#                          from target/ so that CPU and CUDA builds do not rebuild each other
#   CUDA_COMPUTE_CAP       GPU architecture to compile kernels for (default 90: H100/H200)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
LIMIT=$((64 * 1024 * 1024))
TESTS=(gradients memory_paths generation reference zero3 zero3_lora)

log() { echo "gpu-build.sh: $*" >&2; }
die() { echo "gpu-build.sh: error: $*" >&2; exit 1; }

command -v cargo >/dev/null 2>&1 || die "cargo not found; this script runs on the build machine"
command -v python3 >/dev/null 2>&1 || die "python3 not found (needed to read cargo's JSON output)"
command -v strip >/dev/null 2>&1 || die "strip not found; install binutils"

toolkit_env="$(scripts/cuda-toolkit.sh)" || die "scripts/cuda-toolkit.sh failed (see above)"
eval "$toolkit_env"
export CARGO_TARGET_DIR="${RLHF_CUDA_TARGET_DIR:-$HOME/.cache/rlhf-cuda-target}"
log "building in $CARGO_TARGET_DIR (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)"

cargo build --release -p rlhf-worker -p rlhf-head -p rlhf-cli \
    --features rlhf-worker/cuda,rlhf-cli/cuda
cargo build --release -p rlhf-model --features cuda --example model_bench --example gpu_parity \
    --example zero3_bench
cargo build --release -p rlhf-roles --features cuda --example weight_ipc_bench

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
test_args=()
for t in "${TESTS[@]}"; do test_args+=(--test "$t"); done
cargo test --release -p rlhf-model --features cuda "${test_args[@]}" --no-run \
    --message-format=json >"$TMP/tests.jsonl"
# "name<TAB>executable" per wanted integration test, from cargo's compiler-artifact messages.
python3 - "$TMP/tests.jsonl" "${TESTS[@]}" >"$TMP/tests.tsv" <<'PYEOF'
import json, sys
want = set(sys.argv[2:])
found = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    target = msg.get("target", {})
    if "test" in target.get("kind", []) and target.get("name") in want:
        found[target["name"]] = msg["executable"]
missing = sorted(want - set(found))
if missing:
    sys.exit(f"cargo reported no test executable for {missing}")
for name in sorted(found):
    print(f"{name}\t{found[name]}")
PYEOF

rm -rf gpu-bin gpu-bin.tar.xz
mkdir -p gpu-bin/tests
for b in rlhf-worker rlhf-head rlhf; do
    cp "$CARGO_TARGET_DIR/release/$b" gpu-bin/
done
for b in model_bench gpu_parity zero3_bench weight_ipc_bench; do
    cp "$CARGO_TARGET_DIR/release/examples/$b" gpu-bin/
done
while IFS=$'\t' read -r name exe; do
    cp "$exe" "gpu-bin/tests/$name"
done <"$TMP/tests.tsv"
strip gpu-bin/rlhf-worker gpu-bin/rlhf-head gpu-bin/rlhf gpu-bin/model_bench gpu-bin/gpu_parity gpu-bin/zero3_bench \
    gpu-bin/weight_ipc_bench \
    gpu-bin/tests/*
echo "$ROOT" >gpu-bin/BUILD_ROOT

# Size of what travels: the repository's files (tracked and untracked, not ignored) + gpu-bin/.
repo_bytes="$(git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
names = [n for n in sys.stdin.buffer.read().split(b"\0") if n]
print(sum(os.path.getsize(n) for n in names if os.path.isfile(n)))')"
bin_bytes="$(du -sb gpu-bin | cut -f1)"
mib() { python3 -c "print(f'{$1 / 1048576:.1f} MiB')"; }
echo "gpu-bin/:"
du -b gpu-bin/* gpu-bin/tests/* | sort -k2 | while read -r bytes path; do
    [ -d "$path" ] && continue
    printf '  %-28s %s\n' "$path" "$(mib "$bytes")"
done
echo "total: gpu-bin $(mib "$bin_bytes") + repository $(mib "$repo_bytes") = $(mib $((bin_bytes + repo_bytes))) (limit $(mib "$LIMIT"))"

if [ $((bin_bytes + repo_bytes)) -gt "$LIMIT" ]; then
    log "gpu-bin/ and the repository exceed 64 MiB; packing gpu-bin.tar.xz (a few minutes)"
    # Every binary embeds the same CUDA kernels (tens of MiB of PTX): one xz stream whose
    # dictionary spans several binaries stores them once (~18 MiB instead of ~64 for 9
    # binaries). Single-threaded on purpose: threads would split the stream into blocks.
    tar -cf - gpu-bin | xz -T1 --lzma2=preset=6,dict=256MiB >gpu-bin.tar.xz
    xz_bytes="$(stat -c %s gpu-bin.tar.xz)"
    echo "gpu-bin.tar.xz: $(mib "$xz_bytes"); with the repository $(mib $((xz_bytes + repo_bytes)))"
    if [ $((xz_bytes + repo_bytes)) -gt "$LIMIT" ]; then
        echo "!!! WARNING: even packed, gpu-bin.tar.xz + the repository are $(mib $((xz_bytes + repo_bytes))), over the 64 MiB a GPU machine receives !!!" >&2
        echo "!!! carry fewer binaries (e.g. leave out gpu-bin/tests) or split the run !!!" >&2
        exit 3
    fi
    echo "carry gpu-bin.tar.xz instead of gpu-bin/; on the GPU machine, at the repository root:"
    echo "  tar -xJf gpu-bin.tar.xz        # (scripts/gpu-check.sh also unpacks it when gpu-bin/ is missing)"
else
    echo "fits: carry gpu-bin/ with the repository, then run scripts/gpu-check.sh there"
fi
