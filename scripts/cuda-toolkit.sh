#!/usr/bin/env bash
# Builds a minimal CUDA 13.0 toolkit from NVIDIA's Python wheels so that candle's `cuda`
# feature compiles and links on a machine with no GPU, no driver and no system CUDA:
#   eval "$(scripts/cuda-toolkit.sh [DIR])"      # DIR: $CUDA_TOOLKIT_DIR or ~/.cache/rlhf-cuda-toolkit
# Why the 13.0 line: PTX from a newer nvcc does not load on the 13.0 drivers of the GPU machines.
# Layout of DIR:
#   wheels/   nvcc, crt, runtime (cudart), nvvm (cicc, libdevice), cccl (include/cccl, which
#             nvcc adds itself), installed by pip under nvidia/cu13
#   toolkit/  bin, include, nvvm linked to the wheels' ones; lib (+ lib64) with libcudart.so;
#             this is CUDA_HOME
#   stubs/    link-only stand-ins for libcuda, libnvrtc, libcurand, libcublas, libcublasLt,
#             libnccl (no wheel here has them): every function cudarc declares, returning
#             an error code, so the linker is satisfied and a built binary starts and reports
#             "no CUDA device" instead of failing to load. toolkit/lib/stubs links here.
# Only the export lines go to stdout; progress and errors go to stderr. When the machine
# has a real driver (libcuda.so.1 known to ldconfig), the stubs stay off LD_LIBRARY_PATH.
# A complete DIR (stamp file matching the pins below) is reused: the script then only prints.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DIR="${1:-${CUDA_TOOLKIT_DIR:-$HOME/.cache/rlhf-cuda-toolkit}}"

# The newest 13.0.x of each wheel (the PTX of a 13.0 nvcc loads on the GPU machines' 13.0 driver).
WHEELS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-nvvm==13.0.88
    nvidia-cuda-cccl==13.0.85
)
# Stub libraries: link name, cudarc module declaring its functions, soname.
STUBS=(
    "cuda driver libcuda.so.1"
    "nvrtc nvrtc libnvrtc.so.13"
    "curand curand libcurand.so.10"
    "cublas cublas libcublas.so.13"
    "cublasLt cublaslt libcublasLt.so.13"
    "nccl nccl libnccl.so.2"
)
STAMP_TEXT="$(printf '%s\n' "${WHEELS[@]}" "stubs-v1: ${STUBS[*]}")"

log() { echo "cuda-toolkit.sh: $*" >&2; }
die() { echo "cuda-toolkit.sh: error: $*" >&2; exit 1; }

# Prints the environment to build with, as export lines for eval.
print_env() {
    local tk="$DIR/toolkit" stubs="$DIR/stubs" ld
    ld="$tk/lib"
    if ! { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
        ld="$stubs:$ld" # no driver here: let built binaries start on the stubs
    fi
    printf 'export CUDA_HOME=%q\n' "$tk"
    printf 'export CUDA_PATH=%q\n' "$tk"
    printf 'export CUDA_ROOT=%q\n' "$tk"
    printf 'export CUDA_COMPUTE_CAP=%q\n' "${CUDA_COMPUTE_CAP:-90}"
    # The ${VAR:+...} parts are expanded by the caller's eval, on purpose.
    # shellcheck disable=SC2016
    {
        printf 'export PATH=%q"${PATH:+:$PATH}"\n' "$tk/bin"
        printf 'export LIBRARY_PATH=%q"${LIBRARY_PATH:+:$LIBRARY_PATH}"\n' "$stubs:$tk/lib"
        printf 'export LD_LIBRARY_PATH=%q"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n' "$ld"
    }
}

mkdir -p "$DIR" || die "cannot create $DIR; pick a writable directory (argument or CUDA_TOOLKIT_DIR)"
DIR="$(cd "$DIR" && pwd)"
STAMP="$DIR/.complete"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] &&
    [ -x "$DIR/toolkit/bin/nvcc" ] && [ -f "$DIR/stubs/libcuda.so.1" ]; then
    log "CUDA 13.0 toolkit already complete in $DIR"
    print_env
    exit 0
fi

# --- prerequisites ---
command -v "$PY" >/dev/null 2>&1 || die "$PY not found; install Python 3 (or set PYTHON=/path/to/python3)"
"$PY" -m pip --version >/dev/null 2>&1 ||
    die "pip is not available for $PY; install it (apt-get install python3-pip, or $PY -m ensurepip)"
command -v gcc >/dev/null 2>&1 || die "gcc not found; install it (apt-get install gcc): stubs are built with it and nvcc needs a host compiler"

# Where cudarc's sources are: $CUDARC_SRC, else the version Cargo.lock pins, else the newest 0.19.
find_cudarc() {
    if [ -n "${CUDARC_SRC:-}" ]; then echo "$CUDARC_SRC"; return; fi
    local reg="${CARGO_HOME:-$HOME/.cargo}/registry/src" ver=""
    if [ -f "$ROOT/Cargo.lock" ]; then
        ver="$(awk '$0=="name = \"cudarc\"" {getline; gsub(/version = |"/, ""); print; exit}' "$ROOT/Cargo.lock")"
    fi
    # shellcheck disable=SC2012 # names are plain crate directories
    { ls -d "$reg"/*/"cudarc-${ver:-0.19.}"* 2>/dev/null || true; } | sort -V | tail -n 1
}
CUDARC="$(find_cudarc)"
if [ -z "$CUDARC" ] || [ ! -f "$CUDARC/src/driver/sys/mod.rs" ]; then
    die "cudarc sources not found in the cargo registry; run 'cargo fetch' in the repository (or set CUDARC_SRC=/path/to/cudarc-0.19.x)"
fi

# --- wheels ---
rm -rf "$DIR/wheels" "$DIR/toolkit" "$DIR/stubs" "$STAMP"
log "installing ${WHEELS[*]} into $DIR/wheels (~105 MB download)"
if ! "$PY" -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
    --only-binary=:all: --target "$DIR/wheels" "${WHEELS[@]}" >"$DIR/pip.log" 2>&1; then
    tail -n 5 "$DIR/pip.log" >&2
    die "could not download the CUDA 13.0 wheels (no network or package index unreachable?); connect the machine (or set PIP_INDEX_URL to a reachable index) and rerun; full log: $DIR/pip.log"
fi

CU="$DIR/wheels/nvidia/cu13"
for f in bin/nvcc nvvm/bin/cicc nvvm/libdevice include/cuda_runtime.h include/crt/host_config.h \
    include/cccl/cuda/std/limits lib/libcudart.so.13; do
    [ -e "$CU/$f" ] || die "unexpected wheel layout: $CU/$f is missing; the wheels changed, adapt scripts/cuda-toolkit.sh"
done

# --- toolkit layout ---
TK="$DIR/toolkit"
mkdir -p "$TK/lib"
for d in bin include nvvm; do ln -sfn "$CU/$d" "$TK/$d"; done
for f in "$CU"/lib/*; do ln -sfn "$f" "$TK/lib/$(basename "$f")"; done
ln -sfn libcudart.so.13 "$TK/lib/libcudart.so"
ln -sfn lib "$TK/lib64"
ln -sfn "$DIR/stubs" "$TK/lib/stubs" # where cudarc's build script also looks

# --- link stubs ---
log "building link stubs from $CUDARC"
mkdir -p "$DIR/stubs"
for entry in "${STUBS[@]}"; do
    read -r name module soname <<<"$entry"
    src="$CUDARC/src/$module/sys/mod.rs"
    [ -f "$src" ] || die "cudarc layout changed: $src is missing; adapt scripts/cuda-toolkit.sh"
    c="$DIR/stubs/$name.c"
    # The functions are the `fn NAME(` lines of cudarc's `extern "C"` blocks ("NAME s" when
    # they return a C string, "NAME i" otherwise); dedupe by name (cfg-gated variants repeat).
    sed -nE 's/^ {12}fn ([A-Za-z0-9_]+)\(.*\) -> \*const ::core::ffi::c_char;$/\1 s/p; t
             s/^ {12}fn ([A-Za-z0-9_]+)\(.*/\1 i/p' "$src" | sort -u -k1,1 |
        awk -v lib="$soname" '
            $2 == "s" { printf "const char *%s(void) { return \"%s stub: no NVIDIA driver or library here\"; }\n", $1, lib; next }
            { printf "int %s(void) { return 999; }\n", $1 }' >"$c"
    n="$(wc -l <"$c")"
    [ "$n" -gt 10 ] || die "found only $n functions in $src; cudarc layout changed, adapt scripts/cuda-toolkit.sh"
    gcc -shared -fPIC -O0 -w -o "$DIR/stubs/$soname" -Wl,-soname,"$soname" "$c" ||
        die "gcc failed to build the $soname stub from $c"
    ln -sfn "$soname" "$DIR/stubs/lib$name.so"
    log "  $soname: $n functions"
done

"$TK/bin/nvcc" --version 2>/dev/null | grep -q 'release 13\.0' ||
    die "$TK/bin/nvcc does not report CUDA 13.0; remove $DIR and rerun"
echo "$STAMP_TEXT" >"$STAMP"
log "CUDA 13.0 toolkit ready in $DIR ($(du -sh "$DIR" | cut -f1))"
print_env
