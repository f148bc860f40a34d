#!/usr/bin/env bash
# Regenerate tests/e2e/fixtures/trl_ppo_step (one TRL PPO step on the tiny fixtures).
# Creates or reuses a virtual environment ($VENV, default .venv-ref at the repo root).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-ref}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, transformers, tokenizers, numpy" 2>/dev/null; then
    echo "installing torch, transformers, tokenizers, numpy into $VENV" >&2
    "$VENV/bin/pip" install --quiet torch transformers tokenizers safetensors numpy
fi
exec "$VENV/bin/python" "$ROOT/scripts/trl_ppo_step_reference.py" "$@"
