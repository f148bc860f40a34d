#!/usr/bin/env bash
# Starts an rlhf cluster on the machines of a host file over a remote shell (ssh by default):
# `rlhf-head start` on the first host, `rlhf-worker join` on the others, waits until every node
# is alive and prints `rlhf-head status`. scripts/stop-cluster.sh HOSTFILE stops it again.
#
# HOSTFILE: one host a line, the head first; after the host an optional resources JSON object
# for that host's worker (`#` starts a comment):
#     10.0.0.1                  # the head (no resources: it runs no worker)
#     10.0.0.2 {"GPU": 8}
#     10.0.0.3 {"GPU": 8, "nvme": 1}
# Resources on the head's line also start a worker on the head host (like `ray start --head`,
# whose node contributes its own devices).
#
# The token never appears on a command line: it is read back from the head over the remote
# shell's stdout and written through stdin into a 0600 file on each worker host.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/start-cluster.sh [options] HOSTFILE
       scripts/stop-cluster.sh  [options] HOSTFILE

options:
  --port PORT          head port (default 6344; 0 picks a free one)
  --state-dir DIR      directory used on every host for state, token, logs and pid files
                       (default /tmp/rlhf-cluster-$USER); each host writes under DIR/<host>,
                       the head under DIR/head
  --bin-dir DIR        directory holding rlhf-head and rlhf-worker on the hosts
                       (default: found on the hosts' PATH)
  --head-bind HOST     interface the head listens on (default 0.0.0.0)
  --head-address HOST  address the workers dial (default: the head's host in HOSTFILE)
  --head-arg ARG       extra argument for `rlhf-head start`, repeatable
                       (e.g. --head-arg=--dead-after-ms=5000 --head-arg=--no-dashboard)
  --worker-arg ARG     extra argument for every `rlhf-worker join`, repeatable
  --timeout SECONDS    how long to wait for the head, then for every node (default 60);
                       for stop: how long processes get to exit before they are killed (default 20)
  -h, --help           this text

environment:
  RLHF_REMOTE_SHELL    command that runs a shell script on a host (default
                       "ssh -o BatchMode=yes {host}"). Split on spaces; {host} is replaced by the
                       host, or the host is appended when no word holds {host}; the script comes
                       last, as one argument. Examples: "ip netns exec ns-{host} sh -c",
                       "env HOST={host} sh -c" (all hosts on this machine).
EOF
}

die() {
  echo "start-cluster: error: $*" >&2
  exit 1
}

mode=start
[[ ${1:-} == --stop ]] && { mode=stop; shift; }

port=6344
state_dir="/tmp/rlhf-cluster-${USER:-$(id -un)}"
bin_dir=""
head_bind="0.0.0.0"
head_address=""
timeout=""
head_args=()
worker_args=()
hostfile=""

need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --port) need_value "$@"; port=$2; shift 2 ;;
    --port=*) port=${1#*=}; shift ;;
    --state-dir) need_value "$@"; state_dir=$2; shift 2 ;;
    --state-dir=*) state_dir=${1#*=}; shift ;;
    --bin-dir) need_value "$@"; bin_dir=$2; shift 2 ;;
    --bin-dir=*) bin_dir=${1#*=}; shift ;;
    --head-bind) need_value "$@"; head_bind=$2; shift 2 ;;
    --head-bind=*) head_bind=${1#*=}; shift ;;
    --head-address) need_value "$@"; head_address=$2; shift 2 ;;
    --head-address=*) head_address=${1#*=}; shift ;;
    --head-arg) need_value "$@"; head_args+=("$2"); shift 2 ;;
    --head-arg=*) head_args+=("${1#*=}"); shift ;;
    --worker-arg) need_value "$@"; worker_args+=("$2"); shift 2 ;;
    --worker-arg=*) worker_args+=("${1#*=}"); shift ;;
    --timeout) need_value "$@"; timeout=$2; shift 2 ;;
    --timeout=*) timeout=${1#*=}; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *)
      [[ -z $hostfile ]] || die "only one HOSTFILE may be given (got '$hostfile' and '$1')"
      hostfile=$1; shift ;;
  esac
done
[[ -n $hostfile ]] || { usage >&2; die "no HOSTFILE given"; }
[[ -r $hostfile ]] || die "cannot read HOSTFILE '$hostfile'"
[[ $port =~ ^[0-9]+$ && $port -le 65535 ]] || die "--port must be a number from 0 to 65535, got '$port'"
if [[ -z $timeout ]]; then
  if [[ $mode == start ]]; then timeout=60; else timeout=20; fi
fi
[[ $timeout =~ ^[0-9]+$ && $timeout -gt 0 ]] || die "--timeout must be a whole number of seconds > 0, got '$timeout'"
[[ $state_dir == /* ]] || die "--state-dir must be an absolute path (it is used on every host), got '$state_dir'"

# ---- host file ----------------------------------------------------------------------------
hosts=()
resources=()
lineno=0
while IFS= read -r line || [[ -n $line ]]; do
  lineno=$((lineno + 1))
  line=${line%%#*}
  line="${line#"${line%%[![:space:]]*}"}"
  line="${line%"${line##*[![:space:]]}"}"
  [[ -z $line ]] && continue
  host=${line%%[[:space:]]*}
  rest=${line#"$host"}
  rest="${rest#"${rest%%[![:space:]]*}"}"
  if [[ -n $rest && ($rest != \{* || $rest != *\}) ]]; then
    die "$hostfile line $lineno: after the host comes an optional resources JSON object like {\"GPU\": 8}; got '$rest'"
  fi
  for h in "${hosts[@]}"; do
    [[ $h == "$host" ]] && die "$hostfile line $lineno: host '$host' is listed twice; to give the head host resources, put them on the first line"
  done
  hosts+=("$host")
  resources+=("$rest")
done <"$hostfile"
[[ ${#hosts[@]} -gt 0 ]] || die "$hostfile lists no host (one host a line, the head first)"

# ---- helpers -------------------------------------------------------------------------------
# Single-quotes a word for a POSIX shell on the remote side.
q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
qall() {
  local out="" w
  for w in "$@"; do out+=" $(q "$w")"; done
  printf '%s' "$out"
}

remote_shell=${RLHF_REMOTE_SHELL:-"ssh -o BatchMode=yes {host}"}
# remote HOST SCRIPT: runs SCRIPT with a POSIX shell on HOST; stdin and stdout pass through.
remote() {
  local host=$1 script=$2 words=() cmd=() w has=0
  read -r -a words <<<"$remote_shell"
  for w in "${words[@]}"; do
    if [[ $w == *'{host}'* ]]; then
      has=1
      cmd+=("${w//'{host}'/$host}")
    else
      cmd+=("$w")
    fi
  done
  [[ $has == 1 ]] || cmd+=("$host")
  "${cmd[@]}" "$script"
}

# Per-host directory name: the host without user@, odd characters replaced.
host_dir() {
  local h=${1#*@}
  printf '%s/%s' "$state_dir" "${h//[^A-Za-z0-9._-]/_}"
}
host_addr() { local h=${1#*@}; printf '%s' "$h"; }
is_ipv4() { [[ $1 =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]]; }
binary() { if [[ -n $bin_dir ]]; then printf '%s/%s' "$bin_dir" "$1"; else printf '%s' "$1"; fi; }

head_host=${hosts[0]}
head_dir="$state_dir/head"
head_bin=$(binary rlhf-head)
worker_bin=$(binary rlhf-worker)

# Shell snippet (remote side) that runs "$@" detached, in its own session, with its pid in
# PIDFILE, output in LOG. Used as: detach PIDFILE LOG CMD ARGS...
# shellcheck disable=SC2016 # expanded by the remote shell
detach_fn='detach() {
  pidfile=$1; log=$2; shift 2
  s=""; if command -v setsid >/dev/null 2>&1; then s=setsid; fi
  nohup $s sh -c '\''echo $$ > "$0"; exec "$@"'\'' "$pidfile" "$@" >"$log" 2>&1 </dev/null &
  i=0; while [ ! -s "$pidfile" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done
}'

# Refuses to start over a process a previous start left running.
# shellcheck disable=SC2016 # expanded by the remote shell
running_check='running() {
  [ -s "$1" ] || return 1
  p=$(cat "$1")
  kill -0 "$p" 2>/dev/null
}'

# ---- stop ----------------------------------------------------------------------------------
if [[ $mode == stop ]]; then
  echo "stopping the cluster of $hostfile (head $head_host)"
  # Graceful first: the head tells every worker to stop its actors and exit.
  if remote "$head_host" "[ -f $(q "$head_dir/head.json") ] && $(q "$head_bin") stop --state-dir $(q "$head_dir") --connect-timeout 3" </dev/null >/dev/null 2>&1; then
    echo "  $head_host: asked the head to stop the cluster"
  else
    echo "  $head_host: no head answered; stopping the recorded processes directly"
  fi
  # shellcheck disable=SC2016 # expanded by the remote shell
  stop_script="timeout=$timeout"'
ours() {
  if [ -r "/proc/$1/cmdline" ]; then tr "\000" " " <"/proc/$1/cmdline" | grep -q rlhf-
  else ps -p "$1" -o args= 2>/dev/null | grep -q rlhf-; fi
}
for dir in "$@"; do
  for f in "$dir"/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f"); name=$(basename "$f" .pid)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
      echo "$name (pid $pid) had exited"; rm -f "$f"; continue
    fi
    if ! ours "$pid"; then
      echo "$name: pid $pid is no longer an rlhf process; stale pid file removed"; rm -f "$f"; continue
    fi
    i=0; while kill -0 "$pid" 2>/dev/null && [ $i -lt $((timeout * 10)) ]; do sleep 0.1; i=$((i+1)); done
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      i=0; while kill -0 "$pid" 2>/dev/null && [ $i -lt 30 ]; do sleep 0.1; i=$((i+1)); done
      if kill -0 "$pid" 2>/dev/null; then
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        echo "killed $name (pid $pid) with SIGKILL"
      else
        echo "stopped $name (pid $pid) with SIGTERM"
      fi
    else
      echo "$name (pid $pid) exited"
    fi
    # Actors and other children in its process group, if any outlived it.
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$f"
  done
done'
  pids=()
  for i in "${!hosts[@]}"; do
    h=${hosts[$i]}
    dirs=("$(host_dir "$h")")
    [[ $i == 0 ]] && dirs=("$head_dir" "${dirs[@]}")
    (remote "$h" "set -- $(qall "${dirs[@]}"); $stop_script" </dev/null 2>&1 | sed "s/^/  $h: /") &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || die "could not reach every host; run scripts/stop-cluster.sh again or check the hosts by hand"
  echo "cluster stopped"
  exit 0
fi

# ---- start: head ---------------------------------------------------------------------------
echo "starting the head on $head_host"
head_cmd=("$head_bin" start --port "$port" --host "$head_bind" --state-dir "$head_dir" "${head_args[@]}")
head_script="set -e
$detach_fn
$running_check
umask 077
mkdir -p $(q "$head_dir")
chmod 700 $(q "$state_dir") 2>/dev/null || true
if running $(q "$head_dir/head.pid"); then
  echo \"a head started from $state_dir is still running on this host (pid \$(cat $(q "$head_dir/head.pid"))); stop it first with scripts/stop-cluster.sh\" >&2
  exit 3
fi
rm -f $(q "$head_dir/head.json")
detach $(q "$head_dir/head.pid") $(q "$head_dir/head.out")$(qall "${head_cmd[@]}")
# Wait for head.json (written once the head serves), or report why the head died.
i=0
while [ ! -s $(q "$head_dir/head.json") ]; do
  if ! kill -0 \"\$(cat $(q "$head_dir/head.pid") 2>/dev/null || echo 0)\" 2>/dev/null; then
    echo 'the head exited; its output:' >&2; tail -n 20 $(q "$head_dir/head.out") >&2; exit 4
  fi
  i=\$((i+1)); [ \$i -lt $((timeout * 10)) ] || { echo 'the head did not start within ${timeout}s; its output:' >&2; tail -n 20 $(q "$head_dir/head.out") >&2; exit 5; }
  sleep 0.1
done
cat $(q "$head_dir/head.json")"
head_json=$(remote "$head_host" "$head_script" </dev/null) || die "the head did not start on $head_host (see above)"
head_port=$(printf '%s\n' "$head_json" | sed -n 's/.*"address": *"[^"]*:\([0-9][0-9]*\)".*/\1/p' | head -n 1)
token_file=$(printf '%s\n' "$head_json" | sed -n 's/.*"token_file": *"\([^"]*\)".*/\1/p' | head -n 1)
[[ -n $head_port && -n $token_file ]] || die "cannot read the port and token file from the head's head.json: $head_json"
address="${head_address:-$(host_addr "$head_host")}:$head_port"
echo "  head serving at $address"

# The token travels over the remote shell's stdout, never through a command line.
token=$(remote "$head_host" "cat $(q "$token_file")" </dev/null) || die "cannot read the token file $token_file on $head_host"
[[ -n $token ]] || die "the token file $token_file on $head_host is empty"

# ---- start: workers ------------------------------------------------------------------------
worker_idx=()
for i in "${!hosts[@]}"; do
  if [[ $i -gt 0 || -n ${resources[$i]} ]]; then worker_idx+=("$i"); fi
done

start_worker() {
  local h=$1 res=$2 dir cmd
  dir=$(host_dir "$h")
  cmd=("$worker_bin" join --address "$address" --token-file "$dir/token" --state-dir "$dir")
  if is_ipv4 "$(host_addr "$h")"; then cmd+=(--node-ip "$(host_addr "$h")"); fi
  [[ -n $res ]] && cmd+=(--resources "$res")
  cmd+=("${worker_args[@]}")
  printf '%s\n' "$token" | remote "$h" "set -e
$detach_fn
$running_check
umask 077
mkdir -p $(q "$dir")
if running $(q "$dir/worker.pid"); then
  echo \"a worker started from $state_dir is still running on this host; stop it first with scripts/stop-cluster.sh\" >&2
  exit 3
fi
cat > $(q "$dir/token")
detach $(q "$dir/worker.pid") $(q "$dir/worker.out")$(qall "${cmd[@]}")"
}

if [[ ${#worker_idx[@]} -gt 0 ]]; then
  echo "starting ${#worker_idx[@]} worker(s)"
  pids=()
  for i in "${worker_idx[@]}"; do
    (start_worker "${hosts[$i]}" "${resources[$i]}" 2>&1 | sed "s/^/  ${hosts[$i]}: /"; exit "${PIPESTATUS[0]}") &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || die "some workers did not start (see above); scripts/stop-cluster.sh $hostfile stops what did"
fi

# ---- wait until every node is alive --------------------------------------------------------
# Prints "ADDRESS STATE" per node from pretty-printed `rlhf-head status --format json`.
nodes_of() {
  awk '
    /^  "nodes": \[\]/ { next }
    /^  "nodes": \[/ { inside = 1; next }
    inside && /^  \]/ { inside = 0 }
    inside && /^    \{/ { a = ""; s = "" }
    inside && /^      "address": / { a = $2; gsub(/[",]/, "", a) }
    inside && /^      "state": / { s = $2; gsub(/[",]/, "", s) }
    inside && /^    \}/ { print a, s }
  '
}
status_cmd="$(q "$head_bin") status --state-dir $(q "$head_dir") --connect-timeout 3"
expected=${#worker_idx[@]}
deadline=$((SECONDS + timeout))
missing=()
while :; do
  nodes=$(remote "$head_host" "$status_cmd --format json" </dev/null 2>/dev/null | nodes_of || true)
  alive=$(printf '%s\n' "$nodes" | awk '$2 == "ALIVE"' | wc -l)
  missing=()
  for i in "${worker_idx[@]}"; do
    a=$(host_addr "${hosts[$i]}")
    if is_ipv4 "$a" && ! printf '%s\n' "$nodes" | grep -q "^$a:[0-9]* ALIVE$"; then missing+=("${hosts[$i]}"); fi
  done
  if [[ $alive -ge $expected && ${#missing[@]} -eq 0 ]]; then break; fi
  if [[ $SECONDS -ge $deadline ]]; then
    echo "start-cluster: error: only $alive of $expected node(s) alive after ${timeout}s${missing[*]:+; not alive: ${missing[*]}}" >&2
    for i in "${worker_idx[@]}"; do
      dir=$(host_dir "${hosts[$i]}")
      echo "--- ${hosts[$i]}: last lines of $dir/worker.out" >&2
      remote "${hosts[$i]}" "tail -n 15 $(q "$dir/worker.out")" </dev/null 2>&1 | sed 's/^/    /' >&2 || true
    done
    echo "scripts/stop-cluster.sh $hostfile stops what was started" >&2
    exit 1
  fi
  sleep 1
done

echo "all $expected worker node(s) alive"
echo
remote "$head_host" "$status_cmd" </dev/null
echo
echo "head address: $address  (state, logs and pids under $state_dir on each host)"
stop_opts=""
[[ $state_dir != "/tmp/rlhf-cluster-${USER:-$(id -un)}" ]] && stop_opts+=" --state-dir $state_dir"
[[ -n $bin_dir ]] && stop_opts+=" --bin-dir $bin_dir"
echo "stop with:    scripts/stop-cluster.sh$stop_opts $hostfile"
