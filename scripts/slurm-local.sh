#!/usr/bin/env bash
# A one-node Slurm on this machine, for labkit's launcher tests and CI (Debian's slurm-wlm and munge).
#
#   scripts/slurm-local.sh start    # munged + slurmctld + slurmd, config and state under $LABKIT_SLURM_DIR
#   scripts/slurm-local.sh status   # exit 0 when the controller answers and the node is up
#   scripts/slurm-local.sh env      # the line to eval: export SLURM_CONF=...
#   scripts/slurm-local.sh logs     # every daemon's log (CI prints them when a test fails)
#   scripts/slurm-local.sh stop     # ends the daemons this script started (by their pid files)
#
# Idempotent: start on a running one does nothing, stop on a stopped one does nothing. Nothing is
# written outside $LABKIT_SLURM_DIR (default /tmp/labkit-slurm): munge gets its own key and socket,
# Slurm its own ports (LABKIT_SLURM_PORT, +1), so a system Slurm or munge, if any, is left alone.
# Needs root (slurmd launches jobs as their user) and the packages slurm-wlm, munge.
set -euo pipefail

DIR=${LABKIT_SLURM_DIR:-/tmp/labkit-slurm}
PORT=${LABKIT_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf
SOCKET=$DIR/munge/munge.socket
export SLURM_CONF=$CONF

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

ready() { alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && sinfo -h -N -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

write_config() {
    mkdir -p "$DIR"/{state,spool,munge,log}
    if [ ! -f "$DIR/munge/munge.key" ]; then
        head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    fi
    # munged refuses keys, sockets and logs that others could write
    chown -R munge:munge "$DIR/munge"
    chmod 0711 "$DIR/munge"  # clients need to reach the socket; the key itself is 0400
    chmod 0400 "$DIR/munge/munge.key"
    cat >"$CONF" <<CONF
ClusterName=labkit
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=2
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
}

start() {
    if ready; then
        echo "slurm-local: already running ($CONF)"
        return 0
    fi
    stop quiet
    write_config
    runuser -u munge -- munged --socket="$SOCKET" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    # -D: in the foreground of a background job, so the pid files name the daemons themselves
    setsid slurmctld -D -i -f "$CONF" >>"$DIR/log/slurmctld.out" 2>&1 </dev/null &
    setsid slurmd -D -N localhost -f "$CONF" >>"$DIR/log/slurmd.out" 2>&1 </dev/null &
    for _ in $(seq 1 60); do
        if ready; then
            echo "slurm-local: up ($CONF)"
            return 0
        fi
        sleep 0.5
    done
    echo "slurm-local: did not come up within 30 s" >&2
    logs >&2
    return 1
}

stop() {
    for name in slurmd slurmctld munge/munged; do
        pidfile=$DIR/$name.pid
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
    [ "${1:-}" = quiet ] || echo "slurm-local: stopped"
}

logs() {
    for f in "$DIR"/log/* "$DIR"/munge/munged.log; do
        [ -f "$f" ] && { echo "==> $f <=="; tail -n 100 "$f"; }
    done
    return 0
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) ready ;;
env) echo "export SLURM_CONF=$CONF" ;;
logs) logs ;;
*) echo "usage: $0 start|stop|status|env|logs" >&2; exit 2 ;;
esac
