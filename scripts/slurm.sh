#!/usr/bin/env bash
# A throwaway single-node Slurm cluster for the tests (idempotent): prints its slurm.conf's path, alone, on
# stdout; Slurm's commands find it through SLURM_CONF.
#
#   export SLURM_CONF=$(bash scripts/slurm.sh)    # start (or reuse) it: sinfo, sbatch, squeue now work
#   bash scripts/slurm.sh stop                    # stop its daemons (the files stay for reuse)
#
# As root: installs Debian's slurm-wlm and munge with apt-get when sbatch is missing, then runs munged,
# slurmctld and slurmd on this machine, all from $GPUFORGE_SLURM_DIR (default /tmp/gpuforge-slurm): its
# own munge key and socket, state, spool, logs, and one partition `debug` with this machine as its one
# node (its CPUs and memory), on ports 6917/6918 (not Slurm's defaults, so a real cluster's are left
# alone). Process tracking by /proc and no cgroups: it runs in a container too. Test jobs only.
set -euo pipefail

log() { echo "slurm.sh: $*" >&2; }

DIR=${GPUFORGE_SLURM_DIR:-${TMPDIR:-/tmp}/gpuforge-slurm}
CONF=$DIR/slurm.conf
SOCKET=$DIR/munge/munge.socket

kill_from() {  # the daemons whose pid files are named, waited for (their ports free again)
  local pids=()
  for pidfile in "$@"; do
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      pids+=("$(cat "$pidfile")")
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
}

if [ "${1:-}" = "stop" ]; then
  kill_from "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"
  log "stopped ($DIR)"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  log "needs root: slurmd runs jobs as their users, and this cluster's daemons run as root"
  exit 1
fi

mkdir -p "$DIR"
exec 9>"$DIR.lock"
flock 9  # two test workers starting it at once: the second waits (installing too), then finds it up

# --- the binaries ----------------------------------------------------------------------------------
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || { log "no Slurm found and no apt-get to install it"; exit 1; }
  log "installing slurm-wlm and munge (apt-get) ..."
  export DEBIAN_FRONTEND=noninteractive
  APT=(apt-get -y -qq -o DPkg::Lock::Timeout=300)  # a fresh machine's own apt run may hold the lock
  "${APT[@]}" install --no-install-recommends slurm-wlm munge >&2 2>/dev/null \
    || { "${APT[@]}" update >&2 && "${APT[@]}" install --no-install-recommends slurm-wlm munge >&2; }
fi

export SLURM_CONF=$CONF
up() { timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated|completing)'; }
if [ -f "$CONF" ] && up; then
  log "running already ($DIR)"
  echo "$CONF"
  exit 0
fi

# --- munge: its own key and socket -----------------------------------------------------------------
mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/log"
chmod 700 "$DIR/munge"
[ -f "$DIR/munge/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none; }
chmod 400 "$DIR/munge/munge.key"
if ! { [ -f "$DIR/munge/munged.pid" ] && kill -0 "$(cat "$DIR/munge/munged.pid")" 2>/dev/null; }; then
  munged --force --key-file="$DIR/munge/munge.key" --socket="$SOCKET" --pid-file="$DIR/munge/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" 9>&-
fi

# --- slurm.conf: this machine, one partition ------------------------------------------------------
HOST=$(hostname -s)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours both: the node is every core
MEMORY_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$CONF" <<EOF
ClusterName=gpuforge-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6917
SlurmdPort=6918
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MessageTimeout=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=2048
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
ReturnToService=2
MinJobAge=600
KillWait=10
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

# --- the daemons ------------------------------------------------------------------------------------
kill_from "$DIR/slurmd.pid" "$DIR/slurmctld.pid"  # an earlier start's, half up
# 9>&-: the daemons must not keep the lock's descriptor, or the next call waits for them for ever
slurmctld -f "$CONF" 9>&-
slurmd -f "$CONF" 9>&-
for _ in $(seq 1 60); do
  if up; then
    log "started: node $HOST, $CPUS CPUs, partition debug ($DIR; logs in $DIR/log)"
    echo "$CONF"
    exit 0
  fi
  state=$(timeout 5 sinfo -h -o %T 2>/dev/null || true)
  if [ "$state" = "down" ] || [ "$state" = "drained" ] || [ "$state" = "down*" ]; then
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  fi
  sleep 0.5
done
log "the node did not come up within 30 s: $(sinfo 2>&1 | tail -n 2 | tr '\n' ' ')"
tail -n 5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
exit 1
