#!/usr/bin/env bash
# Start a one-node Slurm (munge + slurmctld + slurmd) on this machine, without systemd. Idempotent: a second call
# finds the node up with the same configuration and returns at once. Needs root (installs packages, runs daemons).
# Used by .ci/run before the tests; the Slurm tests (tests/test_slurm*.py) skip only where this cannot run.
set -euo pipefail

log() { printf 'slurm-up: %s\n' "$*" >&2; }
# shellcheck source=.ci/slurm-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm-common.sh"

if [ "$(id -u)" != 0 ]; then
  log "needs root (installs slurm-wlm and munge, starts daemons); skipping"
  exit 1
fi

node=$(hostname -s)

node_idle() { sinfo -h -n "$node" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }

# slurm.conf: one node with this machine's CPUs and memory.
cpus=$(getconf _NPROCESSORS_ONLN) # not nproc: it answers OMP_NUM_THREADS (1 under the tests)
mem_mb=$(free -m | awk '/^Mem:/{print $2}')
real_mb=$((mem_mb * 95 / 100))
conf=/etc/slurm/slurm.conf
new_conf=$(mktemp)
cat >"$new_conf" <<CONF
# written by torchrelay .ci/slurm-up.sh
ClusterName=torchrelay
SlurmctldHost=$node
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
$(slurm_common_conf)
NodeName=$node CPUs=$cpus RealMemory=$real_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

# Up with this very configuration: nothing to do. A changed one (a newer version of this script) is written below
# and the daemons restarted, so a machine where Slurm already runs gets it too, unless a job runs there.
if command -v sinfo >/dev/null 2>&1 && node_idle; then
  if cmp -s "$new_conf" "$conf"; then
    rm -f "$new_conf"
    log "already up: node $node is $(sinfo -h -n "$node" -o %t)"
    exit 0
  fi
  if [ -n "$(squeue -h 2>/dev/null)" ]; then
    rm -f "$new_conf"
    log "up with an older configuration, kept: a job runs there ($(squeue -h -o %i | tr '\n' ' '))"
    exit 0
  fi
  log "configuration changed: restarting the daemons"
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 || {
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
  }
fi

# munge: a key, a socket directory, the daemon as user munge.
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 755 /run/munge
if ! pgrep -u munge -x munged >/dev/null 2>&1; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --force
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
chown slurm:slurm /var/spool/slurmctld /var/log/slurm 2>/dev/null || true
if ! cmp -s "$new_conf" "$conf"; then
  mv "$new_conf" "$conf"
  restart=1
else
  rm -f "$new_conf"
  restart=0
fi
chmod 644 "$conf"

pid_of() { # name: this cluster's daemon, not .ci/slurm-2node-up.sh's (those run with -f <its conf>)
  cat "/run/slurm/$1.pid" 2>/dev/null || pgrep -fx "/usr/sbin/$1" | head -n 1
}
running() { # name
  local pid
  pid=$(pid_of "$1") && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}
start_daemon() { # name
  # A changed slurm.conf needs a restart: stop the daemon this script started, by its pid.
  if [ "$restart" = 1 ] && running "$1"; then
    kill "$(pid_of "$1")" || true
    for _ in $(seq 50); do running "$1" || break; sleep 0.1; done
  fi
  if ! running "$1"; then
    log "starting $1"
    "/usr/sbin/$1"
  fi
}
start_daemon slurmctld
start_daemon slurmd

for i in $(seq 60); do
  if node_idle; then
    log "up: node $node idle after ${i}x0.5 s"
    exit 0
  fi
  state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
  case "$state" in
    down* | drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 0.5
done
log "node $node did not become idle; state: $(sinfo -h -n "$node" -o %t 2>&1)"
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
