#!/usr/bin/env bash
# Two hosts on one box, for labkit's multi-host tests: "labkit-a" and "labkit-b", each with its own
# host name (a UTS namespace per process) and address, joined by one veth pair, so that ranks on
# the two talk over a real non-loopback link whose counters say what crossed it.
#
#   labkit-a   this machine's network namespace, interface ${P}a0 = $NET.1/24 (the notebook's side:
#              the controller listens here)
#   labkit-b   network namespace ${P}-b, interface ${P}b0 = $NET.2/24
#
#   scripts/netns-hosts.sh up | down        create / remove the namespace and the veth pair (root)
#   scripts/netns-hosts.sh ssh HOST CMD...  what ipyparallel's ssh launcher runs (ssh_cmd=[this, "ssh"]):
#                                           CMD in HOST's network namespace under its own host name
#   scripts/netns-hosts.sh scp SRC DST      its scp (the two hosts share this machine's files)
#   scripts/netns-hosts.sh stats            bytes and packets each end of the link sent and received
#
# LABKIT_NETNS_DOWN="labkit-b" makes `ssh labkit-b` fail as ssh does when a host is gone.
# Names: LABKIT_NETNS_PREFIX (default lk21) and LABKIT_NETNS_NET (default 10.213.0). Nothing leaves
# the box: the link's addresses exist only on its two ends.
set -euo pipefail

P=${LABKIT_NETNS_PREFIX:-lk21}
NET=${LABKIT_NETNS_NET:-10.213.0}
NS=$P-b
A=${P}a0
B=${P}b0

netns_of() {
    case "$1" in
    labkit-a) echo "" ;;
    labkit-b) echo "$NS" ;;
    *) echo "netns-hosts: unknown host $1 (labkit-a or labkit-b)" >&2; exit 255 ;;
    esac
}

up() {
    down quiet
    ip netns add "$NS"
    ip link add "$A" type veth peer name "$B"
    ip link set "$B" netns "$NS"
    ip addr add "$NET.1/24" dev "$A"
    ip link set "$A" up
    ip netns exec "$NS" ip addr add "$NET.2/24" dev "$B"
    ip netns exec "$NS" ip link set "$B" up
    ip netns exec "$NS" ip link set lo up
    # the link must carry what is meant for it: a route that went anywhere else is a failure here
    ip route get "$NET.2" | grep -q "dev $A" || { echo "netns-hosts: $NET.2 is not routed over $A" >&2; exit 1; }
    echo "netns-hosts: labkit-a=$NET.1 ($A), labkit-b=$NET.2 ($B in netns $NS)"
}

down() {
    ip link del "$A" 2>/dev/null || true
    ip netns del "$NS" 2>/dev/null || true
    [ "${1:-}" = quiet ] || echo "netns-hosts: down"
}

ssh_() {
    while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do # ssh options (-p PORT, ...): one host, no options needed
        case "$1" in -p | -l | -i | -o) shift ;; esac
        shift
    done
    host=$1
    shift
    ns=$(netns_of "$host")
    case " ${LABKIT_NETNS_DOWN:-} " in *" $host "*)  # a host taken down by a test: what ssh says then
        echo "ssh: connect to host $host port 22: No route to host" >&2; exit 255 ;;
    esac
    # like ssh: the remote command is the arguments joined by spaces, run by the remote shell, in
    # the home directory (where ipyparallel puts the remote profile: paths relative to ~)
    cd "$HOME"
    if [ -n "$ns" ]; then
        exec ip netns exec "$ns" unshare --uts bash -c 'hostname "$0" && exec bash -c "$1"' "$host" "$*"
    fi
    exec unshare --uts bash -c 'hostname "$0" && exec bash -c "$1"' "$host" "$*"
}

scp_() {
    exec cp "${1#*:}" "${2#*:}"
}

stats() {
    for side in "$A:" "$B:$NS"; do
        dev=${side%%:*}
        ns=${side#*:}
        run=()
        [ -n "$ns" ] && run=(ip netns exec "$ns")
        printf '%s' "$dev"
        for k in tx_bytes rx_bytes tx_packets rx_packets; do
            printf ' %s=%s' "$k" "$("${run[@]}" cat "/sys/class/net/$dev/statistics/$k")"
        done
        echo
    done
}

case "${1:-}" in
up) up ;;
down) down ;;
ssh) shift; ssh_ "$@" ;;
scp) shift; scp_ "$@" ;;
stats) stats ;;
*) echo "usage: $0 up|down|ssh HOST CMD...|scp SRC DST|stats" >&2; exit 2 ;;
esac
