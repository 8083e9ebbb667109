#!/usr/bin/env bash
# A real Slurm cluster on this one machine: munged, slurmctld and K slurmd "nodes" (n1..nK)
# on 127.0.0.1, for tests and for trying Gyre's heterogeneous job without a cluster.
#
#   bash tools/slurm_local.sh start [NODES] [CPUS_PER_NODE]   # installs Debian's slurm + munge if needed
#   bash tools/slurm_local.sh stop
#   bash tools/slurm_local.sh status
#
# State lives in $GYRE_SLURM_DIR (default /tmp/gyre-slurm); `source $GYRE_SLURM_DIR/env.sh`
# points sbatch/srun/squeue at this cluster (SLURM_CONF). A heterogeneous job needs its
# components on different nodes, hence several virtual nodes sharing this machine's CPUs.
set -euo pipefail
dir="${GYRE_SLURM_DIR:-/tmp/gyre-slurm}"
cmd="${1:-status}"
nodes="${2:-4}"
cpus="${3:-4}"

log() { printf '[slurm-local] %s\n' "$*" >&2; }

install() {
  local missing=()
  for p in slurmctld slurmd slurm-client munge; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

write_conf() {
  local host; host="$(hostname -s)"
  mkdir -p "$dir"/{state,spool,tmp,log}
  for i in $(seq 1 "$nodes"); do mkdir -p "$dir/spool/n$i" "$dir/tmp/n$i"; done
  cat >"$dir/slurm.conf" <<CONF
ClusterName=gyrelocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=15
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
TmpFS=$dir/tmp/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
KillWait=5
MinJobAge=600
InactiveLimit=0
Waittime=0
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=6821-$((6820 + nodes)) CPUs=$cpus State=UNKNOWN
PartitionName=gyre Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  printf 'export SLURM_CONF=%s/slurm.conf\n' "$dir" >"$dir/env.sh"
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
  su -s /bin/sh munge -c /usr/sbin/munged
}

start() {
  install
  stop_daemons quiet
  write_conf
  start_munge
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  for i in $(seq 1 "$nodes"); do slurmd -f "$SLURM_CONF" -N "n$i"; done
  for _ in $(seq 1 60); do
    idle=$(sinfo -h -t idle -o '%D' 2>/dev/null | awk '{s+=$1} END {print s+0}')
    if [ "$idle" -ge "$nodes" ]; then log "$nodes nodes idle ($dir)"; return 0; fi
    sleep 0.5
  done
  log "nodes did not become idle; see $dir/log"; sinfo >&2 || true; return 1
}

# Stop only the daemons this script started, by the pids in their pid files.
stop_daemons() {
  [ -f "$dir/slurm.conf" ] && SLURM_CONF="$dir/slurm.conf" timeout 10 scancel --quiet --user=root 2>/dev/null || true
  local pids=() f p
  for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
    [ -s "$f" ] || continue
    p="$(cat "$f")"
    if kill -0 "$p" 2>/dev/null; then pids+=("$p"); fi
  done
  if ((${#pids[@]})); then
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 40); do
      local alive=0
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 0.25
    done
    kill -9 "${pids[@]}" 2>/dev/null || true
  fi
  rm -f "$dir"/slurmd-*.pid "$dir/slurmctld.pid"
  [ "${1:-}" = quiet ] || log "stopped"
}

case "$cmd" in
  start) start ;;
  stop) stop_daemons; rm -rf "$dir/state" ;;
  status) SLURM_CONF="$dir/slurm.conf" sinfo ;;
  *) echo "usage: $0 start [NODES] [CPUS]|stop|status" >&2; exit 2 ;;
esac
