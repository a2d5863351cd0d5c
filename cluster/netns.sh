#!/usr/bin/env bash
# A Ray cluster of real nodes on this one machine: each node is a network namespace with an address of its own in
# a private /24 (10.213.0.0/24) that exists only inside the namespaces this script makes, so Ray sees N nodes with
# N IPs (node ranks, HYBRID_SHARD across nodes, a node's link cut) as on a real cluster. Needs root (CAP_NET_ADMIN
# and CAP_SYS_ADMIN for `ip netns`). Nothing on the host's network changes: every veth pair is created with both
# ends inside namespaces, and the bridge lives in a namespace of its own.
#
#   cluster/netns.sh up N [--rate RATE] [--cpus C]   N nodes (a head and N-1 workers); RATE (tc's units, e.g.
#                                                    1gbit) shapes each node's link, both ways; C logical CPUs
#                                                    per node (default 2). Prints the cluster's tag and address.
#   cluster/netns.sh exec I CMD...                   run CMD in node I's namespace (I=0: the head), e.g. a driver
#                                                    with RAY_ADDRESS set to the head
#   cluster/netns.sh join I                          a new Ray node in node I's namespace, replacing one whose
#                                                    processes ended (killed, or Ray declared it dead)
#   cluster/netns.sh status                          the namespaces and `ray status`
#   cluster/netns.sh down [TAG]                      end every process in the cluster's namespaces, by PID, then
#                                                    delete the namespaces and the state directory
#
# Every name carries the prefix rsn<TAG>: namespaces rsn<TAG>-br (the bridge), rsn<TAG>-n0 ... (the nodes); TAG
# is random unless RAYSFT_NETNS_TAG sets it, so several clusters can exist side by side (each has its own bridge
# and the same /24, which never meets another). `down` touches only namespaces with that prefix and the processes
# inside them (`ip netns pids`), never `ray stop`, which would end every Ray on the machine.
#
# Environment:
#   RAYSFT_NETNS_DIR   state: the tag, each node's Ray temp dir and `ray start` log (default /tmp/rsn-$UID; keep
#                      it short: Ray's socket paths are length-limited)
#   RAYSFT_NETNS_TAG   the tag (default: 6 random hex digits)
#   RAYSFT_NETNS_OBJECT_STORE_MB   object store per node (256)
#   RAY                the ray executable (default: this checkout's .venv/bin/ray, else ray on PATH)
#   RAY_*              passed to every node (e.g. RAY_health_check_period_ms for faster node-death detection)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=${RAYSFT_NETNS_DIR:-/tmp/rsn-$(id -u)}
if [[ -z ${RAY:-} ]]; then
    if [[ -x $repo/.venv/bin/ray ]]; then RAY=$repo/.venv/bin/ray; else RAY=$(command -v ray || true); fi
fi
unset RAY_ADDRESS
SUBNET=10.213.0
PORT=6379

die() { echo "netns.sh: $*" >&2; exit 1; }
USAGE="usage: $0 up N [--rate RATE] [--cpus C] | exec I CMD... | join I | status | down [TAG]"
usage_error() { echo "netns.sh: $*" >&2; echo "$USAGE" >&2; exit 2; }  # before anything is made

# value OPTION ARGS...: the value after OPTION, or a usage error naming it (missing, empty, or the next option)
value() {
    [[ $# -ge 2 && -n $2 && $2 != -* ]] || usage_error "$1 needs a value"
    echo "$2"
}

node_ns() { echo "rsn$1-n$2"; }  # tag, index
node_ip() { echo "$SUBNET.$(($1 + 1))"; }

up() {
    local n=${1:-} rate="" cpus=2 i
    [[ $n =~ ^[1-9][0-9]*$ ]] || usage_error "up: N (the number of nodes) must be a positive integer, got '$n'"
    shift
    while [[ $# -gt 0 ]]; do
        case $1 in
            --rate) rate=$(value "$@") || exit 2; shift 2
                [[ $rate =~ ^[0-9]+(\.[0-9]+)?[a-zA-Z]*$ ]] ||
                    usage_error "--rate must be a rate in tc's units (e.g. 1gbit, 100mbit), got '$rate'" ;;
            --cpus) cpus=$(value "$@") || exit 2; shift 2
                [[ $cpus =~ ^[1-9][0-9]*$ ]] || usage_error "--cpus must be a positive integer, got '$cpus'" ;;
            *) usage_error "up: unknown option '$1'" ;;
        esac
    done
    [[ ${RAYSFT_NETNS_OBJECT_STORE_MB:-256} =~ ^[1-9][0-9]*$ ]] ||
        usage_error "RAYSFT_NETNS_OBJECT_STORE_MB must be a positive integer (MB), got '$RAYSFT_NETNS_OBJECT_STORE_MB'"
    [[ -x $RAY ]] || die "no ray executable (set RAY=...)"
    [[ ! -f $state/tag ]] || die "a cluster is recorded in $state (tag $(cat "$state/tag")): run '$0 down' first"
    local tag=${RAYSFT_NETNS_TAG:-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')}
    [[ $tag =~ ^[a-z0-9]{1,12}$ ]] || die "RAYSFT_NETNS_TAG must be 1-12 of [a-z0-9], got '$tag'"
    mkdir -p "$state"
    echo "$tag" >"$state/tag"
    trap 'echo "netns.sh: up failed; removing what it made" >&2; down "$tag" >&2' ERR

    local br=rsn$tag-br
    ip netns add "$br"
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    for ((i = 0; i < n; i++)); do
        local ns
        ns=$(node_ns "$tag" "$i")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # both ends made inside namespaces: the host's interface list never holds them
        ip link add name eth0 netns "$ns" type veth peer name "p$i" netns "$br"
        ip -n "$br" link set "p$i" master br0 up
        ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [[ -n $rate ]]; then  # each direction of the node's link: its own egress and the bridge port's
            ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
            ip netns exec "$br" tc qdisc add dev "p$i" root tbf rate "$rate" burst 256kb latency 50ms
        fi
    done

    printf 'tag=%s\nnodes=%s\nhead=%s\nrate=%s\ncpus=%s\n' "$tag" "$n" "$(node_ip 0):$PORT" "$rate" "$cpus" \
        >"$state/cluster.env"
    trap - ERR
    for ((i = 0; i < n; i++)); do
        start_node "$i" || { down "$tag" >&2; exit 1; }
    done
    local head=$(node_ip 0):$PORT
    cat <<EOF
netns.sh: Ray cluster up: $n node(s) ($(for ((i = 0; i < n; i++)); do printf '%s ' "$(node_ns "$tag" "$i")=$(node_ip "$i")"; done)), $cpus CPUs each${rate:+, links shaped to $rate}
  tag $tag, state in $state, head $head (reachable only from the cluster's namespaces)
Run a driver on the head:  $0 exec 0 env RAY_ADDRESS=$head python ...
Stop:                      $0 down
EOF
}

start_node() {  # index: `ray start` in the node's namespace, with a temp dir of its own (a replacement: a new one)
    local i=$1 tag head cpus temp nodes rate
    source "$state/cluster.env"
    local osm=$((${RAYSFT_NETNS_OBJECT_STORE_MB:-256} * 1024 * 1024))
    temp=$state/n$i
    [[ ! -e $temp ]] || temp=$(mktemp -d "$state/n$i.XXX")
    mkdir -p "$temp"
    local args=(--node-ip-address "$(node_ip "$i")" --temp-dir "$temp" --num-cpus "$cpus" --num-gpus 0
                --object-store-memory "$osm" --disable-usage-stats)
    if ((i == 0)); then
        args+=(--head --port "$PORT" --dashboard-host "$(node_ip 0)")
    else
        args+=(--address "$head")
    fi
    # Job entrypoints run `python` from the raylet's PATH: make it the interpreter that has raysft and ray.
    # RAY_ADDRESS in the nodes' environment: Ray code in workers that looks the cluster up finds this one.
    # GLOO_SOCKET_IFNAME: gloo binds to the address the hostname resolves to, here (as on many hosts)
    # loopback, which no other node can reach: name the node's link, as a real cluster's setup must.
    # The cluster's network exists only inside its namespaces: token auth stays off.
    if ! ip netns exec "$(node_ns "$tag" "$i")" env PATH="$(dirname "$RAY"):$PATH" RAY_ADDRESS="$head" \
        RAY_AUTH_MODE=disabled GLOO_SOCKET_IFNAME=eth0 "$RAY" start "${args[@]}" >"$temp.log" 2>&1; then
        tail -n 30 "$temp.log" >&2
        echo "netns.sh: 'ray start' of node $i failed (log: $temp.log)" >&2
        return 1
    fi
}

join() {  # a replacement for node I, whose processes have ended (killed, or gone after Ray declared it dead)
    local i=${1:-}
    [[ $i =~ ^[1-9][0-9]*$ ]] || usage_error "join: I must be a worker node's index (1 or more), got '$i'"
    [[ $# -le 1 ]] || usage_error "join: unexpected argument '$2'"
    [[ -f $state/cluster.env ]] || die "no cluster recorded in $state"
    # shellcheck disable=SC2046
    [[ -z $(alive $(ip netns pids "$(node_ns "$(cat "$state/tag")" "$i")" 2>/dev/null)) ]] ||
        die "node $i still has processes: end them first"
    start_node "$i" || exit 1
    echo "netns.sh: node $i joined again"
}

alive() {  # those of the given PIDs that still run (a killed process waiting to be reaped does not)
    [[ $# -gt 0 ]] || return 0
    ps -o pid=,stat= -p "$(IFS=,; echo "$*")" | awk '$2 !~ /^Z/ {print $1}' || true
}

ns_pids() {  # every process in the namespaces of cluster TAG
    local ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^rsn$1-n[0-9]+$" || true); do
        ip netns pids "$ns" 2>/dev/null || true
    done
}

down() {
    [[ $# -le 1 ]] || usage_error "down: unexpected argument '$2'"
    [[ -z ${1+x} || $1 =~ ^[a-z0-9]{1,12}$ ]] || usage_error "down: TAG must be 1-12 of [a-z0-9], got '$1'"
    local tag=${1:-$(cat "$state/tag" 2>/dev/null || true)} pids waited=0 ns
    [[ -n $tag ]] || { echo "netns.sh: nothing recorded in $state; nothing to take down"; return 0; }
    [[ $tag =~ ^[a-z0-9]{1,12}$ ]] || die "bad tag '$tag' recorded in $state/tag"
    pids=$(ns_pids "$tag" | tr '\n' ' ')
    if [[ -n ${pids// /} ]]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        # shellcheck disable=SC2086
        while [[ -n $(alive $pids) ]] && ((waited < 25)); do sleep 0.2; waited=$((waited + 1)); done
        pids=$(ns_pids "$tag" | tr '\n' ' ')  # the survivors and anything started while going down
        # shellcheck disable=SC2086
        [[ -z ${pids// /} ]] || kill -KILL $pids 2>/dev/null || true
    fi
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^rsn$tag-(br|n[0-9]+)$" || true); do
        ip netns del "$ns"
    done
    if [[ $(cat "$state/tag" 2>/dev/null) == "$tag" ]]; then
        rm -f "$state/tag" "$state/cluster.env"
    fi
    echo "netns.sh: cluster $tag down"
}

node_exec() {
    local i=${1:-} tag
    [[ $i =~ ^[0-9]+$ ]] || usage_error "exec: I must be a node's index (0: the head), got '$i'"
    [[ $# -ge 2 ]] || usage_error "exec: no command to run in node $i"
    shift
    tag=$(cat "$state/tag" 2>/dev/null) || die "no cluster recorded in $state"
    exec ip netns exec "$(node_ns "$tag" "$i")" "$@"
}

status() {
    local tag head
    tag=$(cat "$state/tag" 2>/dev/null) || die "no cluster recorded in $state"
    ip netns list | grep -E "^rsn$tag-" || true
    head=$(grep '^head=' "$state/cluster.env" | cut -d= -f2)
    ip netns exec "$(node_ns "$tag" 0)" env RAY_AUTH_MODE=disabled "$RAY" status --address "$head"
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    join) shift; join "$@" ;;
    exec) shift; node_exec "$@" ;;
    status) [[ $# -le 1 ]] || usage_error "status: unexpected argument '$2'"; status ;;
    *) usage_error "unknown command '${1:-}'" ;;
esac
