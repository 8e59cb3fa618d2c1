#!/usr/bin/env bash
# Single-node Slurm on localhost for CI and laptops (Debian/Ubuntu, no systemd needed).
#
#   scripts/slurm_local.sh up             install slurmctld/slurmd/munge if missing, start them by hand,
#                                         wait until the node accepts jobs (idempotent)
#   scripts/slurm_local.sh down           stop slurmctld, slurmd and munged (by pid file)
#   scripts/slurm_local.sh status         controller ping + node list
#   scripts/slurm_local.sh wait JOB [S]   poll JOB until it ends (at most S seconds, default 600); exit 0 when
#                                         COMPLETED, else the job's exit code (1 if none, 124 after cancel on timeout)
#
# Environment:
#   SLURM_LOCAL_DIR    state, spool, logs, pid files   (default: /tmp/nemo-longctx-slurm)
#   SLURM_LOCAL_CPUS   CPUs the node advertises         (default: nproc; may exceed the real core count)
#
# Needs root (re-executes itself with sudo when available). The generated config goes to /etc/slurm/slurm.conf,
# where sbatch/squeue/scontrol look for it by default.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -E bash "$0" "$@"; fi
  echo "slurm_local.sh: needs root (or sudo) to install and start slurm daemons" >&2
  exit 3
fi

cmd=${1:-up}
state_dir=${SLURM_LOCAL_DIR:-/tmp/nemo-longctx-slurm}
cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
node=localhost
conf=/etc/slurm/slurm.conf
munge_pidfile=/run/munge/munged.pid

say() { printf '[slurm_local] %s\n' "$*" >&2; }

# is the process in pid file $1 running (zombies count as gone)?
running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] || return 1
  [ -r "/proc/$pid/stat" ] || return 1
  [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

# retry "$@" every 0.25 s for up to $1 seconds; $2 names what we wait for
poll() {
  local seconds=$1 what=$2 i
  shift 2
  for ((i = 0; i < seconds * 4; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  say "gave up after ${seconds}s waiting for ${what}"
  return 1
}

show_logs() {
  local f
  for f in "$state_dir/log/slurmctld.log" "$state_dir/log/slurmd.log" /var/log/munge/munged.log; do
    if [ -f "$f" ]; then printf -- '--- %s (tail)\n' "$f" >&2; tail -n 25 "$f" >&2; fi
  done
}

have_slurm() {
  command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
    && command -v sbatch >/dev/null 2>&1 && command -v munged >/dev/null 2>&1
}

install_slurm() {
  have_slurm && return 0
  command -v apt-get >/dev/null 2>&1 || { say "slurm is not installed and apt-get is not available"; return 4; }
  say "installing slurmctld slurmd slurm-client munge (apt)"
  # Package postinst scripts would try to start the daemons through init scripts: forbid that while installing.
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
  fi
  local rc=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null; } || rc=$?
  if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  return "$rc"
}

munge_ok() { munge -n | unmunge; }

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile=/etc/munge/munge.key
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 755 /run/munge
  if munge_ok >/dev/null 2>&1; then return 0; fi
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged
  poll 10 munged munge_ok
}

# write slurm.conf; succeed (0) when its content changed
write_slurm_conf() {
  mkdir -p /etc/slurm "$state_dir/state" "$state_dir/spool" "$state_dir/log" "$state_dir/run"
  local mem_mb new
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  new=$(mktemp)
  cat >"$new" <<EOF
# written by nemo-longctx scripts/slurm_local.sh: one node on localhost
ClusterName=nemolongctx
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$state_dir/state
SlurmdSpoolDir=$state_dir/spool
SlurmctldPidFile=$state_dir/run/slurmctld.pid
SlurmdPidFile=$state_dir/run/slurmd.pid
SlurmctldLogFile=$state_dir/log/slurmctld.log
SlurmdLogFile=$state_dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  if cmp -s "$new" "$conf"; then
    rm -f "$new"
    return 1
  fi
  install -m 644 "$new" "$conf"
  rm -f "$new"
  return 0
}

stop_daemons() {
  if running "$state_dir/run/slurmctld.pid"; then scontrol shutdown >/dev/null 2>&1 || true; fi
  local d
  for d in slurmctld slurmd; do
    if running "$state_dir/run/$d.pid"; then
      if ! poll 15 "$d to exit" bash -c "! kill -0 \$(cat '$state_dir/run/$d.pid')"; then
        kill "$(cat "$state_dir/run/$d.pid")" 2>/dev/null || true
      fi
    fi
  done
}

node_accepts_jobs() {
  case "$(sinfo -h -n "$node" -o %T 2>/dev/null)" in
    idle | mixed | allocated | completing) return 0 ;;
    *) return 1 ;;
  esac
}

up() {
  install_slurm
  start_munge
  if write_slurm_conf; then
    if running "$state_dir/run/slurmctld.pid" || running "$state_dir/run/slurmd.pid"; then
      say "slurm.conf changed: restarting the daemons"
      stop_daemons
    fi
  fi
  if ! running "$state_dir/run/slurmctld.pid"; then
    say "starting slurmctld"
    slurmctld -c # -c: clear old job and node state
    poll 30 "slurmctld to answer" scontrol ping || { show_logs; return 1; }
  fi
  if ! running "$state_dir/run/slurmd.pid"; then
    say "starting slurmd"
    slurmd -N "$node"
  fi
  if ! poll 30 "node $node to accept jobs" node_accepts_jobs; then
    # a node left DOWN/DRAIN by an earlier run comes back with resume
    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
    poll 15 "node $node to accept jobs" node_accepts_jobs || { sinfo -N -l >&2 || true; show_logs; return 1; }
  fi
  sinfo >&2
}

down() {
  if command -v scontrol >/dev/null 2>&1; then stop_daemons; fi
  if running "$munge_pidfile"; then
    say "stopping munged"
    kill "$(cat "$munge_pidfile")" 2>/dev/null || true
    poll 10 "munged to exit" bash -c "! kill -0 \$(cat '$munge_pidfile')" || true
  fi
}

wait_job() {
  local job=$1 limit=${2:-600} info state code i
  for ((i = 0; i < limit * 4; i++)); do
    info=$(scontrol -o show job "$job" 2>/dev/null) || { say "job $job is unknown to slurmctld"; return 1; }
    state=$(sed -n 's/.* JobState=\([A-Z_]*\) .*/\1/p' <<<"$info")
    case "$state" in
      PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | REQUEUED | RESIZING | SIGNALING | STAGE_OUT)
        sleep 0.25
        ;;
      *)
        code=$(sed -n 's/.* ExitCode=\([0-9]*\):.*/\1/p' <<<"$info")
        say "job $job ended: $state exit code ${code:-?}"
        if [ "$state" = COMPLETED ]; then return 0; fi
        if [ -n "$code" ] && [ "$code" != 0 ]; then return "$code"; fi
        return 1
        ;;
    esac
  done
  say "job $job still $state after ${limit}s: cancelling it"
  scancel "$job" || true
  return 124
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) scontrol ping && sinfo -N -l ;;
  wait) wait_job "${2:?usage: slurm_local.sh wait JOBID [SECONDS]}" "${3:-600}" ;;
  *)
    echo "usage: slurm_local.sh up|down|status|wait JOBID [SECONDS]" >&2
    exit 2
    ;;
esac
