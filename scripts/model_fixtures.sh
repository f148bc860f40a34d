#!/usr/bin/env bash
# Regenerate crates/rlhf-model/tests/fixtures (tiny models, tokenizer, reference.json) in the
# reference virtual environment (scripts/ref-venv.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "$ROOT/scripts/ref-venv.sh" "$ROOT/scripts/model_fixtures.py" "$@"
