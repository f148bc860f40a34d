#!/usr/bin/env bash
# The main command: a tiny PPO run on CPU with the head and a worker on this machine.
# Builds the two binaries, then `rlhf-head run --config-name ppo_tiny` starts an embedded
# head and worker, places the four roles as separate processes, trains for
# training.train_iters steps (objective/scores climbs from about 0.3) and stops everything.
# Extra arguments go to `rlhf-head run`, e.g. `training.train_iters=80` or `--resume latest`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p rlhf-head -p rlhf-worker
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
exec "$rel"/rlhf-head run --config-name ppo_tiny "$@"
