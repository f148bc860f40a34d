#!/usr/bin/env bash
# Regenerate tests/e2e/fixtures/trl_ppo_step (one TRL PPO step on the tiny fixtures) in the
# reference virtual environment (scripts/ref-venv.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "$ROOT/scripts/ref-venv.sh" "$ROOT/scripts/trl_ppo_step_reference.py" "$@"
