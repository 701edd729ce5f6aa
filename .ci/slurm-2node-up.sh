#!/usr/bin/env bash
# A second Slurm cluster on this machine with two compute nodes, n1 and n2, each a slurmd in a network namespace of
# its own (10.214.0.1 and .2, joined to the controller's bridge at .254), with its own hostname, /etc/hosts, spool
# directory and node-local scratch: a tmpfs at $base/scratch that only that node sees (the common path a cluster's
# local disk has; a job points TMPDIR there). A third node, n3 (.3), is the spare a lost node is replaced by: it is
# only in partition `spare` (n1, n2, n3; n3 weighted last, so a job there lands on n1 and n2 while they are up), and
# partition `two` (the default) stays n1 and n2. Its own slurmctld (port 6917) and its own configuration, so that the one-node cluster
# of .ci/slurm-up.sh (port 6817, /etc/slurm) is left alone. Clients reach it with SLURM_CONF=$base/slurm.conf.
# Idempotent: a second call finds every node up with the same configuration and returns at once. Needs root and .ci/slurm-up.sh's munge.
# Exits 3 where this machine cannot make the namespaces (no ip/nsenter/unshare, no veth or bridge): the 2-node
# Slurm test skips and says why; any other failure fails it.
#   bash .ci/slurm-2node-up.sh [down]
set -euo pipefail

log() { printf 'slurm-2node-up: %s\n' "$*" >&2; }
# shellcheck source=.ci/slurm-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm-common.sh"

base=/run/torchrelay-slurm2
conf=$base/slurm.conf
bridge=trs2br
nodes="1 2 3"
export SLURM_CONF=$conf

if [ "$(id -u)" != 0 ]; then
  log "needs root (network namespaces, daemons); skipping"
  exit 1
fi

stop_all() {
  for f in "$base"/slurmd-n1.pid "$base"/slurmd-n2.pid "$base"/slurmd-n3.pid "$base"/slurmctld.pid; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 1
  for n in $nodes; do ip netns del "trs2n$n" 2>/dev/null || true; done
  ip link del "$bridge" 2>/dev/null || true
}

if [ "${1:-}" = down ]; then
  stop_all
  log "down"
  exit 0
fi

# up: every node answers in one of the states $1 (idle, or running a job that must not be disturbed)
all_in() { [ "$(sinfo -h -N -p spare -o '%n %t' 2>/dev/null | grep -cE " ($1)$")" = 3 ]; }

ctl=$(hostname -s)
cpus=$(getconf _NPROCESSORS_ONLN) # not nproc: it answers OMP_NUM_THREADS (1 under the tests)
conf_text=$(
  cat <<CONF
# written by torchrelay .ci/slurm-2node-up.sh: two nodes in network namespaces, beside the one-node cluster
ClusterName=torchrelay2
SlurmctldHost=$ctl(10.214.0.254)
SlurmctldPort=6917
SlurmdPort=6818
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool-%n
SlurmctldPidFile=$base/slurmctld.pid
SlurmdPidFile=$base/slurmd-%n.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd-%n.log
$(slurm_common_conf)
NodeName=n1 NodeAddr=10.214.0.1 CPUs=$cpus RealMemory=2048 State=UNKNOWN
NodeName=n2 NodeAddr=10.214.0.2 CPUs=$cpus RealMemory=2048 State=UNKNOWN
NodeName=n3 NodeAddr=10.214.0.3 CPUs=1 RealMemory=1024 Weight=10 State=UNKNOWN
PartitionName=two Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=spare Nodes=n1,n2,n3 MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)

if [ -s "$conf" ] && [ "$(cat "$conf")" = "$conf_text" ] && all_in 'idle|mix|alloc|drain|drng'; then
  if [ -z "$(squeue -h 2>/dev/null)" ]; then
    # a node drained by a test that was killed before it resumed it would leave a two-node job pending
    for n in $(sinfo -h -N -p spare -t drain -o %n 2>/dev/null); do
      scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
    done
  fi
  log "already up: $(sinfo -h -N -p spare -o '%n %t' | tr '\n' ' ')"
  exit 0
fi
if [ -s "$conf" ] && [ -n "$(squeue -h 2>/dev/null)" ]; then
  log "up with an older configuration or a node not up, kept: a job runs there ($(squeue -h -o %i | tr '\n' ' '))"
  exit 0
fi
[ -s "$conf" ] && log "configuration changed or a node not up: restarting"

pgrep -u munge -x munged >/dev/null 2>&1 || {
  log "munged is not running: run .ci/slurm-up.sh first"
  exit 1
}
for tool in ip nsenter unshare; do
  command -v "$tool" >/dev/null 2>&1 || {
    log "cannot make nodes here: $tool is not installed"
    exit 3
  }
done
stop_all
mkdir -p "$base/state" "$base/log"

# The network: a bridge in this namespace (the controller's address), a veth from it into each node's namespace.
if ! err=$(ip link add "$bridge" type bridge 2>&1) || ! err=$(ip netns add trs2probe 2>&1); then
  log "cannot make nodes here: $err"
  stop_all
  exit 3
fi
ip netns del trs2probe
ip addr add 10.214.0.254/24 dev "$bridge"
ip link set "$bridge" up
for n in $nodes; do
  ns=trs2n$n
  ip netns add "$ns"
  ip link add "trs2h$n" type veth peer name "trs2c$n"
  ip link set "trs2h$n" master "$bridge"
  ip link set "trs2h$n" up
  ip link set "trs2c$n" netns "$ns"
  ip -n "$ns" addr add "10.214.0.$n/24" dev "trs2c$n"
  ip -n "$ns" link set "trs2c$n" up
  ip -n "$ns" link set lo up
done
printf '127.0.0.1 localhost\n10.214.0.254 %s\n10.214.0.1 n1\n10.214.0.2 n2\n10.214.0.3 n3\n' "$ctl" >"$base/hosts"

printf '%s\n' "$conf_text" >"$conf"
chmod 644 "$conf"

log "starting slurmctld (port 6917)"
/usr/sbin/slurmctld -f "$conf"
for n in $nodes; do
  mkdir -p "$base/spool-n$n" "$base/scratch"
  log "starting slurmd n$n in network namespace trs2n$n"
  # its own hostname, /etc/hosts and scratch, seen by slurmd and by every job step it starts
  # (nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the cgroup mounts under it)
  nsenter --net="/run/netns/trs2n$n" unshare --uts --mount --propagation private -- bash -c "
    hostname n$n
    mount --bind $base/hosts /etc/hosts
    mount -t tmpfs -o size=512m,mode=1777 scratch-n$n $base/scratch
    exec /usr/sbin/slurmd -f $conf -N n$n
  "
done

for i in $(seq 60); do
  if all_in 'idle|mix|alloc'; then
    log "up: n1, n2 and n3 after ${i}x0.5 s"
    exit 0
  fi
  for n in $nodes; do
    case "$(sinfo -h -n "n$n" -o %t 2>/dev/null || true)" in
      down* | drain*) scontrol update nodename="n$n" state=resume >/dev/null 2>&1 || true ;;
    esac
  done
  sleep 0.5
done
log "n1/n2/n3 did not become idle: $(sinfo -h -N -p spare -o '%n %t' 2>&1 | tr '\n' ' ')"
tail -n 20 "$base"/log/*.log >&2 || true
exit 1
