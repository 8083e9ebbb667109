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
#
# Namespaced nodes: every node in its own network namespace, as on a real cluster (needs root):
#
#   bash tools/slurm_local.sh start-netns [NODES] [CPUS_PER_NODE]
#   bash tools/slurm_local.sh stop-netns
#
# Node nI runs in namespace $GYRE_NETNS_PREFIX-nI (default gyre-nI) with its own loopback and
# the address $GYRE_NETNS_NET.I/24 (default 10.213.0.I) on a veth into the bridge
# $GYRE_NETNS_PREFIX-br, which holds $GYRE_NETNS_NET.254 for slurmctld (root namespace). No
# route leaves that /24. State in $GYRE_SLURM_DIR (default /tmp/gyre-slurm-netns); the
# controller listens on $GYRE_SLURM_PORT (default 6917) and the slurmds on the next port,
# so the plain cluster (6817/6818) can run at the same time. munged is shared: its socket is
# a file. `stop` (or `stop-netns`) also deletes the namespaces, veths and bridge it recorded.
set -euo pipefail
cmd="${1:-status}"
case "$cmd" in
  *-netns) netns=1; cmd="${cmd%-netns}"; dir="${GYRE_SLURM_DIR:-/tmp/gyre-slurm-netns}" ;;
  *) netns=0; dir="${GYRE_SLURM_DIR:-/tmp/gyre-slurm}" ;;
esac
nodes="${2:-4}"
cpus="${3:-4}"
prefix="${GYRE_NETNS_PREFIX:-gyre}"
net="${GYRE_NETNS_NET:-10.213.0}"
if ((netns)); then port="${GYRE_SLURM_PORT:-6917}"; else port="${GYRE_SLURM_PORT:-6817}"; fi

log() { printf '[slurm-local] %s\n' "$*" >&2; }

install() {
  local missing=()
  for p in slurmctld slurmd slurm-client munge; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((netns)) && ! command -v ip >/dev/null; then missing+=(iproute2); fi
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

write_conf() {
  local host ctld=127.0.0.1 nodeaddr=127.0.0.1 nodeports
  host="$(hostname -s)"
  nodeports="$((port + 4))-$((port + 3 + nodes))"
  if ((netns)); then  # one address per node: the same slurmd port on each
    ctld="$net.254"; nodeaddr="$net.[1-$nodes]"; nodeports="$((port + 1))"
  fi
  mkdir -p "$dir"/{state,spool,tmp,log}
  for i in $(seq 1 "$nodes"); do mkdir -p "$dir/spool/n$i" "$dir/tmp/n$i"; done
  cat >"$dir/slurm.conf" <<CONF
ClusterName=gyrelocal
SlurmctldHost=$host($ctld)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=10
# the controller pings nodes every SlurmdTimeout/3 s (at most 100). Backfill, the only scheduler
# that starts a het job, runs when something changed: a requeued het job whose begin time passed
# started only at the next ping (~100 s later by default; at most 5 s here)
SlurmdTimeout=15
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
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=$nodeaddr Port=$nodeports CPUs=$cpus State=UNKNOWN
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

# The bridge, and per node a namespace with its loopback up and one veth into the bridge.
# Every name is recorded in $dir/netns before it is made, so teardown removes exactly these.
make_netns() {
  local br="$prefix-br" i ns
  if ip link show "$br" >/dev/null 2>&1; then
    log "bridge $br exists (another namespaced cluster?): stop it or set GYRE_NETNS_PREFIX"; return 1
  fi
  mkdir -p "$dir"
  echo "link $br" >>"$dir/netns"
  ip link add "$br" type bridge
  ip addr add "$net.254/24" dev "$br"
  ip link set "$br" up
  for i in $(seq 1 "$nodes"); do
    ns="$prefix-n$i"
    echo "netns $ns" >>"$dir/netns"
    echo "link $prefix-v$i" >>"$dir/netns"
    ip netns add "$ns"
    ip link add "$prefix-v$i" type veth peer name eth0 netns "$ns"
    ip link set "$prefix-v$i" master "$br" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$net.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

remove_netns() {
  [ -f "$dir/netns" ] || return 0
  local kind name
  while read -r kind name; do  # veths go with their namespace; the bridge last
    if [ "$kind" = netns ]; then ip netns del "$name" 2>/dev/null || true; fi
  done <"$dir/netns"
  while read -r kind name; do
    if [ "$kind" = link ]; then ip link del "$name" 2>/dev/null || true; fi
  done <"$dir/netns"
  rm -f "$dir/netns"
}

start() {
  install
  stop_daemons quiet
  remove_netns
  write_conf
  start_munge
  export SLURM_CONF="$dir/slurm.conf"
  if ((netns)); then make_netns; fi
  slurmctld -f "$SLURM_CONF"
  for i in $(seq 1 "$nodes"); do
    if ((netns)); then
      # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs /sys/fs/cgroup
      nsenter --net="/run/netns/$prefix-n$i" slurmd -f "$SLURM_CONF" -N "n$i"
    else
      slurmd -f "$SLURM_CONF" -N "n$i"
    fi
  done
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
  stop) stop_daemons; remove_netns; rm -rf "$dir/state" ;;
  status) SLURM_CONF="$dir/slurm.conf" sinfo ;;
  *) echo "usage: $0 start[-netns] [NODES] [CPUS]|stop[-netns]|status[-netns]" >&2; exit 2 ;;
esac
