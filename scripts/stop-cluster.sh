#!/usr/bin/env bash
# Stops a cluster started by scripts/start-cluster.sh with the same HOSTFILE (and the same
# --state-dir / --bin-dir, if it was given any): asks the head to stop every worker and actor,
# then waits for every process recorded in the hosts' pid files and kills the ones left.
# Options: scripts/start-cluster.sh --help.
set -euo pipefail
exec "$(dirname "$0")/start-cluster.sh" --stop "$@"
