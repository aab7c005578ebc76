#!/usr/bin/env bash
# local-slurm.sh - run a real two-node Slurm cluster (node1, node2) on this
# single machine, for tests and contributors. Both "nodes" are slurmd daemons
# started with -N on 127.0.0.1, each in namespaces of its own (unshare: a private
# /dev/shm, its own PID numbers and host name), so their jobs share no more than
# two machines would; one slurmctld; auth via the local munged.
#
# Usage:
#   scripts/local-slurm.sh start          # idempotent; prints `export SLURM_CONF=...`
#   scripts/local-slurm.sh status         # sinfo and pending jobs with Slurm's reason,
#                                         # or "not running" (exit 3)
#   scripts/local-slurm.sh stop [--purge] # cancel jobs, stop daemons; --purge rm state dir
#
#   eval "$(scripts/local-slurm.sh start)"   # stdout is only the export line
#   sbatch --wait -N2 --ntasks-per-node=2 --wrap 'srun hostname'
#
# Environment:
#   FSDP2LAB_SLURM_DIR      state dir (default /tmp/fsdp2lab-slurm); conf is
#                           always $FSDP2LAB_SLURM_DIR/slurm.conf
#   FSDP2LAB_SLURM_CPUS     CPUs each node advertises (default max(nproc, 8): the
#                           sbatch scripts' defaults, 2 tasks x --cpus-per-task=4,
#                           fit one node; more than the cores is fine for tests)
#   FSDP2LAB_SLURM_TIMEOUT  seconds to wait for both nodes idle (default 60)
#   FSDP2LAB_SLURM_CRED_EXPIRE  AuthInfo cred_expire (default 10): step
#                           credential lifetime and the requeue restart delay
#
# Exit codes: 0 ok, 1 runtime failure, 2 prerequisites (not root, packages
# missing and not installable, bad usage), 3 `status` when not running.
# Requires root for start/stop (SlurmUser=root, munged, /etc/hosts).
set -euo pipefail

PATH=$PATH:/usr/sbin:/sbin
DIR=${FSDP2LAB_SLURM_DIR:-/tmp/fsdp2lab-slurm}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
DIR=${DIR%/}
CONF=$DIR/slurm.conf
NODES=(node1 node2)
TIMEOUT=${FSDP2LAB_SLURM_TIMEOUT:-60}
PORT_BASE=16817
export SLURM_CONF=$CONF

log() { printf 'local-slurm: %s\n' "$*" >&2; }
fail() { printf 'local-slurm: error: %s\n' "$1" >&2; exit "${2:-1}"; }

# --- process helpers ---------------------------------------------------------

# pid_alive PIDFILE NAME: true if the pid in PIDFILE is a live process NAME.
pid_alive() {
  local pid comm
  [[ -r $1 ]] || return 1
  pid=$(<"$1") || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ $comm == "$2" ]]
}

ctld_pidfile() { echo "$DIR/slurmctld.pid"; }
# The pid of a node's slurmd as this namespace sees it (slurmd's own pid file,
# SlurmdPidFile, holds its pid inside the node's namespace).
slurmd_pidfile() { echo "$DIR/$1/slurmd.host.pid"; }

# all_running: slurmctld and every slurmd process alive.
all_running() {
  local n
  pid_alive "$(ctld_pidfile)" slurmctld || return 1
  for n in "${NODES[@]}"; do
    pid_alive "$(slurmd_pidfile "$n")" slurmd || return 1
  done
}

any_running() {
  local n
  pid_alive "$(ctld_pidfile)" slurmctld && return 0
  for n in "${NODES[@]}"; do
    pid_alive "$(slurmd_pidfile "$n")" slurmd && return 0
  done
  return 1
}

any_alive() {
  local pid
  for pid in "$@"; do [[ -d /proc/$pid ]] && return 0; done
  return 1
}

# stop_pids NAME PIDFILE...: SIGTERM all, wait up to 15 s, then SIGKILL.
stop_pids() {
  local name=$1 f pid pids=() i
  shift
  for f in "$@"; do
    pid_alive "$f" "$name" && pids+=("$(<"$f")")
  done
  ((${#pids[@]})) || { rm -f "$@"; return 0; }
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for ((i = 0; i < 75; i++)); do
    any_alive "${pids[@]}" || break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do
    [[ -d /proc/$pid ]] || continue
    log "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -f "$@"
}

# kill_tree PID: SIGKILL PID and all its descendants.
kill_tree() {
  local c
  kill -STOP "$1" 2>/dev/null || true
  for c in $(pgrep -P "$1" || true); do kill_tree "$c"; done
  kill -KILL "$1" 2>/dev/null || true
}

# Kill slurmstepd processes of this cluster (they keep the node's slurmd.log
# open) that survived their slurmd, together with the job processes under them.
kill_stray_stepds() {
  local p f
  for p in /proc/[0-9]*; do
    [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
    for f in "$p"/fd/*; do
      if [[ $(readlink "$f" 2>/dev/null) == "$DIR"/* ]]; then
        log "killing slurmstepd ${p#/proc/} ($(tr -d '\0' <"$p/cmdline" 2>/dev/null)) and its children"
        kill_tree "${p#/proc/}"
        break
      fi
    done
  done
}

# start_node NAME: slurmd -N NAME in the foreground, as PID 1 of new mount, PID and
# UTS namespaces with a private tmpfs on /dev/shm and host name NAME: what another
# machine would give its jobs. Records slurmd's pid (as seen here).
start_node() {
  local n=$1 i pid=''
  # shellcheck disable=SC2016  # expanded by the inner shell
  setsid unshare -m -p -f -u --mount-proc sh -c \
    'mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && hostname "$1" && exec slurmd -D -f "$2" -N "$1"' \
    sh "$n" "$CONF" 9>&- </dev/null >>"$DIR/$n/console.log" 2>&1 &
  for ((i = 0; i < 50; i++)); do
    pid=$(pgrep -P "$!" -x slurmd || true)
    [[ -n $pid ]] && break
    sleep 0.1
  done
  [[ -n $pid ]] || return 1
  echo "$pid" >"$(slurmd_pidfile "$n")"
}

# --- prerequisites -----------------------------------------------------------

ensure_packages() {
  local -A want=()
  local c
  for c in slurmctld slurmd; do command -v "$c" >/dev/null || want[$c]=1; done
  for c in sinfo sbatch srun scontrol squeue scancel; do
    command -v "$c" >/dev/null || want[slurm-client]=1
  done
  for c in munged mungekey munge unmunge; do
    command -v "$c" >/dev/null || want[munge]=1
  done
  ((${#want[@]} == 0)) && return 0

  local pkgs=("${!want[@]}")
  ((EUID == 0)) || fail "missing packages: ${pkgs[*]} (run as root to auto-install, or: apt-get install -y ${pkgs[*]})" 2
  command -v apt-get >/dev/null || fail "missing packages: ${pkgs[*]} and no apt-get to install them" 2
  mkdir -p "$DIR"
  log "installing ${pkgs[*]} (log: $DIR/apt.log)"
  export DEBIAN_FRONTEND=noninteractive
  # Keep package postinst scripts from starting system-wide daemons.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
  fi
  local ok=0 lists
  lists=$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -print -quit 2>/dev/null || true)
  if [[ -n $lists ]] && apt-get install -y -q -o DPkg::Lock::Timeout=120 "${pkgs[@]}" >"$DIR/apt.log" 2>&1 9>&-; then
    ok=1
  elif apt-get update -q >>"$DIR/apt.log" 2>&1 9>&- &&
    apt-get install -y -q -o DPkg::Lock::Timeout=120 "${pkgs[@]}" >>"$DIR/apt.log" 2>&1 9>&-; then
    ok=1
  fi
  ((made_policy)) && rm -f "$policy"
  ((ok)) || fail "apt-get install ${pkgs[*]} failed (see $DIR/apt.log)" 2
}

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
  munge_ok && return 0
  local key=/etc/munge/munge.key i
  if [[ ! -e $key ]]; then
    log "creating munge key $key"
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile="$key"
    chown munge:munge "$key"
    chmod 0400 "$key"
  fi
  # /run/munge normally comes from systemd-tmpfiles; containers lack it.
  install -d -o munge -g munge -m 0755 /run/munge
  for i in /var/lib/munge /var/log/munge; do
    [[ -d $i ]] || install -d -o munge -g munge -m 0700 "$i"
  done
  log "starting munged"
  if command -v runuser >/dev/null; then
    runuser -u munge -- munged 9>&- || true
  else
    su -s /bin/sh munge -c munged 9>&- || true
  fi
  for ((i = 0; i < 50; i++)); do
    munge_ok && return 0
    sleep 0.1
  done
  tail -n 5 /var/log/munge/munged.log >&2 2>/dev/null || true
  fail "munged did not come up (see /var/log/munge/munged.log)"
}

ensure_hosts() {
  local n
  for n in "${NODES[@]}"; do
    getent hosts "$n" >/dev/null && continue
    log "adding '127.0.0.1 ${NODES[*]}' to /etc/hosts"
    printf '127.0.0.1 %s  # fsdp2lab local-slurm\n' "${NODES[*]}" >>/etc/hosts ||
      log "warning: cannot write /etc/hosts; ${NODES[*]} will not resolve"
    return 0
  done
}

# --- config ------------------------------------------------------------------

# port_in_use PORT: any TCP socket (any state) bound to PORT?
port_in_use() {
  local hex
  hex=$(printf '%04X' "$1")
  if [[ -r /proc/net/tcp ]]; then
    awk -v p="$hex" 'FNR > 1 { sub(/.*:/, "", $2); if (toupper($2) == p) f = 1 }
                     END { exit !f }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
  else
    (: <"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

# pick_ports: sets PORTS=(ctld node1 node2); reuses the previous conf's ports
# when still free so SLURM_CONF stays identical across restarts.
pick_ports() {
  local old=() p
  PORTS=()
  if [[ -r $CONF ]]; then
    mapfile -t old < <(sed -nE 's/^SlurmctldPort=([0-9]+).*/\1/p; s/^NodeName=.* Port=([0-9]+).*/\1/p' "$CONF")
  fi
  for p in "${old[@]}"; do
    port_in_use "$p" || PORTS+=("$p")
  done
  ((${#PORTS[@]} == 3)) && return 0
  PORTS=()
  for ((p = PORT_BASE; p < PORT_BASE + 1000 && ${#PORTS[@]} < 3; p++)); do
    port_in_use "$p" || PORTS+=("$p")
  done
  ((${#PORTS[@]} == 3)) || fail "no free TCP ports in $PORT_BASE-$((PORT_BASE + 999))"
}

write_conf() {
  local host cpus mem n i ver first_id
  host=$(hostname -s 2>/dev/null || hostname)
  cpus=${FSDP2LAB_SLURM_CPUS:-$(nproc)}
  # Each node must take the scripts' defaults (--ntasks-per-node=2 x --cpus-per-task=4), else
  # a plain `sbatch slurm/train.sbatch` pends for ever (reason PartitionConfig). The CPUs are
  # advertised (config_overrides), not bound: jobs share the real cores.
  [[ -n ${FSDP2LAB_SLURM_CPUS:-} ]] || ((cpus >= 8)) || cpus=8
  ((cpus >= 2)) || cpus=2
  # Memory is not a consumable resource (CR_CPU); advertise half of RAM.
  mem=$(awk '/^MemTotal:/ { m = int($2 / 2048); print (m > 0 ? m : 1) }' /proc/meminfo)
  pick_ports
  first_id=$(((PORTS[0] - PORT_BASE) * 1000 + 1))
  mkdir -p "$DIR/state" "${NODES[@]/#/$DIR/}"
  for n in "${NODES[@]}"; do mkdir -p "$DIR/$n/spool"; done
  {
    cat <<EOF
# Generated by scripts/local-slurm.sh on every start; edits are overwritten.
ClusterName=fsdp2lab
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${PORTS[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may restart
# (Slurm default 120 s).
AuthInfo=cred_expire=${FSDP2LAB_SLURM_CRED_EXPIRE:-10}
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdSpoolDir=$DIR/%n/spool
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmdLogFile=$DIR/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# Use the configured CPUs/memory, not what the hardware reports.
SlurmdParameters=config_overrides
# No systemd/cgroups in a container.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# One line per finished run (requeued runs included); no sacct without slurmdbd.
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
MpiDefault=none
JobRequeue=1
# Job ids (and so the default rendezvous ports, 20000 + id % 20000) differ between clusters
# running at the same time: they start at 1 + 1000 x (port offset).
FirstJobId=$first_id
ReturnToService=2
KillOnBadExit=1
KillWait=10
InactiveLimit=0
MessageTimeout=5
SlurmdTimeout=60
MailProg=/bin/true
EOF
    i=1
    for n in "${NODES[@]}"; do
      echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=${PORTS[i]} CPUs=$cpus RealMemory=$mem State=UNKNOWN"
      i=$((i + 1))
    done
    echo "PartitionName=debug Nodes=node[1-${#NODES[@]}] Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  # Slurm >= 24.05 loads a cgroup plugin in slurmd regardless of
  # ProctrackType/TaskPlugin unless told otherwise (22.05 needs no cgroup.conf).
  ver=$(slurmd -V 2>/dev/null | awk '{ split($2, v, "."); print v[1] * 100 + v[2] }')
  if [[ -n $ver ]] && ((ver >= 2405)); then
    echo "CgroupPlugin=disabled" >"$DIR/cgroup.conf"
  else
    rm -f "$DIR/cgroup.conf"
  fi
}

# --- readiness ---------------------------------------------------------------

# nodes_up: both nodes answer (idle, or busy with jobs recovered from state).
nodes_up() {
  local out n
  out=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    grep -Eq "^$n (idle|mix|alloc|comp)\$" <<<"$out" || return 1
  done
}

dump_logs() {
  local f
  for f in slurmctld.log "${NODES[@]/%//slurmd.log}"; do
    f=$DIR/$f
    [[ -r $f ]] || continue
    printf '==> %s <==\n' "$f" >&2
    tail -n 15 "$f" >&2
  done
  sinfo -N >&2 2>/dev/null || true
}

wait_ready() {
  local t0=$SECONDS n
  until nodes_up; do
    if ((SECONDS - t0 >= TIMEOUT)); then
      dump_logs
      fail "nodes not idle after ${TIMEOUT}s (logs above; '$0 stop' to clean up)"
    fi
    pid_alive "$(ctld_pidfile)" slurmctld || { dump_logs; fail "slurmctld exited (see $DIR/slurmctld.log)"; }
    for n in "${NODES[@]}"; do
      pid_alive "$(slurmd_pidfile "$n")" slurmd || { dump_logs; fail "slurmd $n exited (see $DIR/$n/slurmd.log)"; }
    done
    sleep 0.5
  done
}

print_env() { printf 'export SLURM_CONF=%q\n' "$CONF"; }

# --- commands ----------------------------------------------------------------

cmd_start() {
  ensure_packages
  ((EUID == 0)) || fail "start must run as root (SlurmUser=root, munged, /etc/hosts)" 2
  mkdir -p "$DIR"
  exec 9>"$DIR/.lock"
  flock -w 120 9 || fail "timed out waiting for lock $DIR/.lock"
  local t0=$SECONDS n
  if all_running && nodes_up; then
    log "already running ($CONF)"
    print_env
    return 0
  fi
  ensure_munge
  ensure_hosts
  # Regenerate the conf only if no daemon from a previous start is alive.
  any_running || write_conf
  if ! pid_alive "$(ctld_pidfile)" slurmctld; then
    log "starting slurmctld"
    slurmctld -i -f "$CONF" 9>&- || { dump_logs; fail "slurmctld failed to start"; }
  fi
  for n in "${NODES[@]}"; do
    pid_alive "$(slurmd_pidfile "$n")" slurmd && continue
    log "starting slurmd $n in namespaces of its own"
    start_node "$n" || { dump_logs; fail "slurmd $n failed to start"; }
  done
  wait_ready
  log "up in $((SECONDS - t0))s: $(sinfo -h -o '%P %D %t %N' | tr '\n' ' ')"
  print_env
}

cmd_stop() {
  local purge=0 n ids i slurmd_pids=()
  for n in "${NODES[@]}"; do slurmd_pids+=("$(slurmd_pidfile "$n")"); done
  case ${1:-} in --purge) purge=1 ;; '') ;; *) fail "usage: $0 stop [--purge]" 2 ;; esac
  # .lock is created only by `start`: it marks the dir as ours.
  [[ -e $DIR/.lock ]] || { log "not running (no $DIR/.lock)"; return 0; }
  if any_running || ((purge)); then
    ((EUID == 0)) || fail "stop must run as root" 2
  fi
  exec 9>"$DIR/.lock"
  flock -w 120 9 || fail "timed out waiting for lock $DIR/.lock"
  if any_running; then
    # Cancel jobs so their state is recorded as CANCELLED. Any scancel (even
    # --signal=KILL) gives tasks SIGTERM and KillWait seconds before SIGKILL;
    # don't wait for that: kill the remaining slurmstepds (slurmd would wait
    # for them on shutdown).
    if pid_alive "$(ctld_pidfile)" slurmctld; then
      ids=$(squeue -h -o %i 2>/dev/null || true)
      if [[ -n $ids ]]; then
        log "cancelling jobs: $(echo "$ids" | tr '\n' ' ')"
        # shellcheck disable=SC2086  # word-split job ids on purpose
        scancel $ids 2>/dev/null || true
        for ((i = 0; i < 6; i++)); do
          [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
          sleep 0.5
        done
      fi
    fi
    kill_stray_stepds
    stop_pids slurmd "${slurmd_pids[@]}"
    stop_pids slurmctld "$(ctld_pidfile)"
    kill_stray_stepds
    log "stopped"
  else
    log "not running"
  fi
  if ((purge)); then
    [[ -n $DIR && $DIR != / ]] || fail "refusing to purge '$DIR'"
    rm -rf "$DIR"
    log "purged $DIR"
  fi
}

cmd_status() {
  local pending
  if pid_alive "$(ctld_pidfile)" slurmctld && sinfo 2>/dev/null; then
    # A job that cannot start says why here (e.g. PartitionConfig: it asks more CPUs per node
    # than a node has; Resources: waiting for running jobs).
    pending=$(squeue -h -t PENDING -o '%i %j %r' 2>/dev/null || true)
    if [[ -n $pending ]]; then
      echo "pending jobs (id name reason):"
      echo "$pending"
    fi
    return 0
  fi
  echo "not running"
  return 3
}

case ${1:-} in
start) cmd_start ;;
stop) cmd_stop "${2:-}" ;;
status) cmd_status ;;
*) fail "usage: $0 start|stop [--purge]|status" 2 ;;
esac
