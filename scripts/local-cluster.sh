#!/usr/bin/env bash
# Starts a head and one worker on this machine,
# prints `rlhf-head status`, then stops the cluster. This is the main command until the
# PPO job (`rlhf-head run --config-name ppo_tiny`) lands.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p rlhf-head -p rlhf-worker
bin=target/release
state=$(mktemp -d)
export RLHF_STATE_DIR="$state"
cleanup() {
  "$bin/rlhf-head" stop --state-dir "$state" >/dev/null 2>&1 || true
  wait 2>/dev/null || true
  rm -rf "$state"
}
trap cleanup EXIT

"$bin/rlhf-head" start --port 0 --dashboard-port 0 >"$state/head.out" 2>&1 &
for _ in $(seq 100); do [ -f "$state/head.json" ] && break; sleep 0.1; done
cat "$state/head.out" | grep -v INFO || true
address=$(sed -n 's/.*"address": "\(.*\)".*/\1/p' "$state/head.json")

"$bin/rlhf-worker" join --address "$address" --resources '{"GPU": 2, "demo": 1}' >"$state/worker.out" 2>&1 &
for _ in $(seq 100); do grep -q "joined the cluster" "$state/worker.out" && break; sleep 0.1; done
grep "joined" "$state/worker.out"
echo
"$bin/rlhf-head" status
