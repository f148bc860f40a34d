#!/usr/bin/env bash
# Runs a reference script (PyTorch/transformers) in the project's reference virtual
# environment ($VENV, default .venv-ref at the repo root), creating it and installing torch,
# transformers, tokenizers, safetensors, numpy and pyarrow on first use.
#   scripts/ref-venv.sh scripts/model_fixtures.py [args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-ref}"
PY="${PYTHON:-python3}"

if [ "$#" -lt 1 ]; then
    echo "usage: scripts/ref-venv.sh SCRIPT.py [ARGS...]" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment $VENV" >&2
    "$PY" -m venv "$VENV"
fi
pkgs=(torch transformers tokenizers safetensors numpy pyarrow)
if ! "$VENV/bin/python" -c "import torch, transformers, tokenizers, safetensors, numpy, pyarrow" 2>/dev/null; then
    echo "installing ${pkgs[*]} into $VENV" >&2
    "$VENV/bin/pip" install --quiet "${pkgs[@]}"
fi
script="$1"
shift
exec "$VENV/bin/python" "$script" "$@"
