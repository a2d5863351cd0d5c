#!/usr/bin/env bash
# A Ray cluster of several nodes on this one machine, to try the multi-node paths (ray job submit, several
# raylets, losing a node) without a cloud. Token auth is on; the dashboard (and with it the job API) listens on
# 127.0.0.1 only. The GCS port listens on every interface, as Ray does it: the token is what guards it.
#
#   cluster/local.sh start [WORKER_NODES]   a head + WORKER_NODES more nodes (default 1), each with its own
#                                           --temp-dir and ports; prints how to submit the demo
#   cluster/local.sh status                 `ray status` of this cluster
#   cluster/local.sh stop                   end the processes `start` started, and nothing else
#
# `stop` never calls `ray stop`, which kills every Ray process of the machine (other users' tests included).
# Instead `start` runs each node's `ray start` in a session of its own (setsid), records the session ids and
# the PIDs in them, and marks the processes it starts with RAYSFT_LOCAL_CLUSTER=<state dir>:<nonce> in their
# environment, which their children inherit. `stop` signals only the members of those sessions and the marked
# processes Ray moved out of them (job drivers), in `ray stop`'s order (raylets, the rest, the GCS): SIGTERM,
# then SIGKILL to any left after RAYSFT_LOCAL_STOP_TIMEOUT seconds (5, about `ray stop`'s grace period; Ray's
# autoscaler monitor often needs it).
#
# Environment:
#   RAYSFT_LOCAL_DIR      state: Ray's temp dirs and logs, the token, recorded sessions and PIDs
#                         (default /tmp/raysft-local-$UID; keep it short, Ray's socket paths are length-limited)
#   RAY_AUTH_TOKEN_PATH   the cluster's token file (default $RAYSFT_LOCAL_DIR/auth_token; made if missing)
#   RAYSFT_LOCAL_PORT, RAYSFT_LOCAL_DASHBOARD_PORT, RAYSFT_LOCAL_CLIENT_PORT   head ports (6379, 8265, 10001)
#   RAYSFT_LOCAL_CPUS, RAYSFT_LOCAL_GPUS     logical CPUs / GPUs per node (2, 0)
#   RAYSFT_LOCAL_OBJECT_STORE_MB             object store per node (512)
#   RAY                   the ray executable (default: this checkout's .venv/bin/ray, else ray on PATH)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=${RAYSFT_LOCAL_DIR:-/tmp/raysft-local-$(id -u)}
if [[ -z ${RAY:-} ]]; then
    if [[ -x $repo/.venv/bin/ray ]]; then RAY=$repo/.venv/bin/ray; else RAY=$(command -v ray || true); fi
fi
unset RAY_ADDRESS  # a RAY_ADDRESS left in the shell must not point the nodes at another cluster

die() { echo "local.sh: $*" >&2; exit 1; }
USAGE="usage: $0 start [WORKER_NODES] | status | stop"
usage_error() { echo "local.sh: $*" >&2; echo "$USAGE" >&2; exit 2; }  # before anything is started

# number NAME VALUE: a usage error naming NAME unless VALUE is a whole number (a port, a count, megabytes)
number() { [[ $2 =~ ^[0-9]+$ ]] || usage_error "$1 must be a whole number, got '$2'"; }

# The processes of this cluster: those carrying this start's mark (the job drivers Ray moves to sessions of
# their own included), and every member of a recorded session that holds a marked process. Such a session id
# cannot have been reused: Linux keeps a session's id allocated while any member lives. Members without the
# mark exist: processes that set their title (the dashboard's modules) overwrite the environment /proc shows.
our_pids() {
    local mark sids pid sid marked=" " verified=" "
    mark=$(cat "$state/mark" 2>/dev/null) || return 0
    sids=" $(cut -d' ' -f2 "$state/sessions" 2>/dev/null | tr '\n' ' ' || true) "
    local rows
    rows=$(ps -u "$(id -u)" -o pid=,sid=)
    while read -r pid sid; do
        if grep -qzxF "RAYSFT_LOCAL_CLUSTER=$mark" "/proc/$pid/environ" 2>/dev/null; then
            marked+="$pid "
            [[ $sids == *" $sid "* ]] && verified+="$sid "
        fi
    done <<<"$rows"
    while read -r pid sid; do
        [[ $marked == *" $pid "* || $verified == *" $sid "* ]] && echo "$pid"
    done <<<"$rows"
    return 0
}

alive() {  # those of the given PIDs that still run (a killed process waiting to be reaped does not)
    [[ $# -gt 0 ]] || return 0
    ps -o pid=,stat= -p "$(IFS=,; echo "$*")" | awk '$2 !~ /^Z/ {print $1}' || true  # ps fails when none is left
}

stop() {
    [[ -f $state/mark ]] || { echo "local.sh: nothing recorded in $state; nothing to stop"; return 0; }
    local pids raylets=() gcs=() others=() pid comm
    pids=$(our_pids)
    for pid in $pids; do
        comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
        case $comm in raylet) raylets+=("$pid") ;; gcs_server) gcs+=("$pid") ;; *) others+=("$pid") ;; esac
    done
    # Ray's own order (`ray stop`): the raylets first, the GCS last, so that nothing waits on a vanished peer.
    terminate "${raylets[@]}"
    local rest=()
    for pid in "${others[@]}" $(our_pids); do  # and whatever a raylet started while going down
        [[ " ${gcs[*]} " == *" $pid "* ]] || rest+=("$pid")
    done
    terminate "${rest[@]}"
    terminate "${gcs[@]}"
    rm -f "$state/mark" "$state/sessions"
    echo "local.sh: stopped the cluster in $state (logs kept there)"
}

terminate() {  # SIGTERM to the given PIDs; SIGKILL to those left after RAYSFT_LOCAL_STOP_TIMEOUT seconds
    local timeout=${RAYSFT_LOCAL_STOP_TIMEOUT:-5} waited=0 left
    [[ $# -gt 0 ]] || return 0
    kill -TERM "$@" 2>/dev/null || true
    while [[ -n $(alive "$@") ]] && ((waited < timeout * 5)); do sleep 0.2; waited=$((waited + 1)); done
    left=$(alive "$@")
    [[ -n $left ]] || return 0
    echo "local.sh: SIGKILL after ${timeout}s to" $(for pid in $left; do echo "$pid($(cat /proc/$pid/comm))"; done)
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
    waited=0
    # shellcheck disable=SC2086
    while [[ -n $(alive $left) ]] && ((waited < 50)); do sleep 0.1; waited=$((waited + 1)); done
}

start() {
    local workers=${1:-1} port=${RAYSFT_LOCAL_PORT:-6379} dash_port=${RAYSFT_LOCAL_DASHBOARD_PORT:-8265}
    local client_port=${RAYSFT_LOCAL_CLIENT_PORT:-10001} cpus=${RAYSFT_LOCAL_CPUS:-2} gpus=${RAYSFT_LOCAL_GPUS:-0}
    [[ $# -le 1 ]] || usage_error "start: unexpected argument '$2'"
    number WORKER_NODES "$workers"
    number RAYSFT_LOCAL_PORT "$port"
    number RAYSFT_LOCAL_DASHBOARD_PORT "$dash_port"
    number RAYSFT_LOCAL_CLIENT_PORT "$client_port"
    number RAYSFT_LOCAL_CPUS "$cpus"
    number RAYSFT_LOCAL_GPUS "$gpus"
    number RAYSFT_LOCAL_OBJECT_STORE_MB "${RAYSFT_LOCAL_OBJECT_STORE_MB:-512}"
    number RAYSFT_LOCAL_STOP_TIMEOUT "${RAYSFT_LOCAL_STOP_TIMEOUT:-5}"
    local osm=$((${RAYSFT_LOCAL_OBJECT_STORE_MB:-512} * 1024 * 1024))
    [[ -x $RAY ]] || die "no ray executable (set RAY=...)"
    [[ ! -f $state/mark ]] || die "a cluster is recorded in $state: run '$0 stop' first"
    mkdir -p "$state"

    # Token auth. `ray get-auth-token --generate` writes $HOME/.ray/auth_token: give it a scratch HOME so the
    # user's own token is neither read nor replaced, and keep the token where RAY_AUTH_TOKEN_PATH says.
    local token=${RAY_AUTH_TOKEN_PATH:-$state/auth_token} scratch
    if [[ ! -s $token ]]; then
        scratch=$(mktemp -d "$state/home.XXXXXX")
        env -u RAY_AUTH_TOKEN -u RAY_AUTH_TOKEN_PATH HOME="$scratch" "$RAY" get-auth-token --generate \
            >/dev/null 2>"$scratch/err" || { cat "$scratch/err" >&2; die "could not generate a token"; }
        mkdir -p "$(dirname "$token")"
        mv "$scratch/.ray/auth_token" "$token"
        rm -rf "$scratch"
    fi
    chmod 600 "$token"
    token=$(cd "$(dirname "$token")" && pwd)/$(basename "$token")
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token
    unset RAY_AUTH_TOKEN  # the file is the cluster's token

    # Job entrypoints run `python` from the raylet's PATH: make it the interpreter that has raysft and ray.
    export PATH=$(dirname "$RAY"):$PATH
    echo "$state:$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')" >"$state/mark"
    : >"$state/sessions"
    : >"$state/pids"
    printf 'port=%q\ndash_port=%q\ntoken=%q\n' "$port" "$dash_port" "$token" >"$state/cluster.env"

    # Each node: its own temp dir, log and session; ports are chosen by Ray (0) except the head's.
    local common=(--node-ip-address 127.0.0.1 --num-cpus "$cpus" --num-gpus "$gpus" --object-store-memory "$osm"
                  --min-worker-port 0 --max-worker-port 0 --dashboard-agent-listen-port 0 --disable-usage-stats)
    start_node head --head --port "$port" --dashboard-host 127.0.0.1 --dashboard-port "$dash_port" \
        --ray-client-server-port "$client_port" "${common[@]}"
    # Every node keeps its log monitor: it streams the output of the Ray workers on its node to the drivers, and
    # without it `ray job logs` lacks the progress lines of a rank 0 placed on that node.
    local i
    for ((i = 1; i <= workers; i++)); do
        start_node "worker$i" --address "127.0.0.1:$port" "${common[@]}"
    done
    our_pids >"$state/pids"

    cat <<EOF
local.sh: Ray cluster up: head + $workers worker node(s), $cpus CPUs each, state in $state
  token:      $token
  dashboard:  http://127.0.0.1:$dash_port   (127.0.0.1 only; send the token as 'Authorization: Bearer <token>')
Submit the demo (from $repo):
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token
  ray job submit --address http://127.0.0.1:$dash_port --working-dir . -- python jobs/sft.py jobs/configs/demo.yaml
Watch:  ray job list --address http://127.0.0.1:$dash_port;  $0 status
Stop:   $0 stop
EOF
}

start_node() {  # name, ray start arguments...
    local name=$1 port
    shift
    source "$state/cluster.env"
    mkdir -p "$state/$name"
    # setsid: a new session whose id is this bash's PID ($$ below), which then becomes `ray start`; every
    # process `ray start` spawns (GCS, raylet, dashboard, Ray workers) inherits the session.
    # RAY_ADDRESS in the nodes' environment: Ray code in workers that looks the cluster up (Ray Train's
    # placement group cleaner) finds this one, not another Ray instance of the same machine.
    if ! setsid --wait env RAYSFT_LOCAL_CLUSTER="$(cat "$state/mark")" RAY_ADDRESS="127.0.0.1:$port" \
        bash -c 'echo "$$" >"$0"; exec "$@"' "$state/$name.sid" \
        "$RAY" start --temp-dir "$state/$name" "$@" >"$state/$name.log" 2>&1; then
        echo "local.sh: 'ray start' of $name failed; its log ($state/$name.log):" >&2
        tail -n 30 "$state/$name.log" >&2
        echo "$name $(cat "$state/$name.sid")" >>"$state/sessions"
        stop >&2
        exit 1
    fi
    echo "$name $(cat "$state/$name.sid")" >>"$state/sessions"
}

status() {
    [[ -f $state/mark ]] || die "no cluster recorded in $state"
    local port dash_port token
    source "$state/cluster.env"
    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token "$RAY" status --address "127.0.0.1:$port"
}

case ${1:-} in
    start) shift; start "$@" ;;
    stop) [[ $# -le 1 ]] || usage_error "stop: unexpected argument '$2'"
        number RAYSFT_LOCAL_STOP_TIMEOUT "${RAYSFT_LOCAL_STOP_TIMEOUT:-5}"; stop ;;
    status) [[ $# -le 1 ]] || usage_error "status: unexpected argument '$2'"; status ;;
    *) usage_error "unknown command '${1:-}'" ;;
esac
