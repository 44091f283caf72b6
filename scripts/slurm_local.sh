#!/usr/bin/env bash
# A one-machine Slurm cluster of its own (munged, slurmctld and slurmd on loopback), so that the
# README's sbatch script runs for real (tests/dist/test_slurm.py).
#
#   scripts/slurm_local.sh up   DIR   start it (key, config, state, logs, pid files all in DIR)
#   scripts/slurm_local.sh down DIR   stop them BY THEIR PIDS and remove DIR
#
# Commands then need SLURM_CONF=DIR/slurm.conf. Nothing outside DIR is touched (not /etc/slurm, not
# /etc/munge). Needs slurmctld, slurmd, slurm-client and munge (Debian: slurmctld slurmd
# slurm-client munge; .ci/run installs them) and root (slurmd runs jobs as their users).
set -euo pipefail

cmd=${1:?usage: slurm_local.sh up|down DIR}
DIR=${2:?usage: slurm_local.sh up|down DIR}

ours() {  # the pid is alive and runs with a file of DIR on its command line
  local pid=${1:-}
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' </proc/"$pid"/cmdline | grep -q -- "$DIR/"
}

if [[ $cmd == down ]]; then
  for name in slurmd slurmctld munged; do
    f=$DIR/$name.pid
    [[ -f $f ]] || continue
    pid=$(cat "$f")
    if ours "$pid"; then
      kill -TERM "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
  done
  rm -rf -- "$DIR"
  exit 0
fi

[[ $cmd == up ]] || { echo "usage: slurm_local.sh up|down DIR" >&2; exit 2; }
for b in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged sbatch scontrol; do
  command -v "$b" >/dev/null || { echo "slurm_local: $b is missing (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 3; }
done
mkdir -p "$DIR/state" "$DIR/spool"
chmod 700 "$DIR"
dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$DIR/munge.key"
/usr/sbin/munged --key-file="$DIR/munge.key" --socket="$DIR/munge.sock" --pid-file="$DIR/munged.pid" \
  --log-file="$DIR/munged.log" --seed-file="$DIR/munge.seed" --force
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
HOST=$(hostname -s)
CPUS=$(nproc)
# cred_expire=10 and sched_interval=2: a requeued job waits its credential lifetime (default 120 s)
# and pending jobs are tested every sched_interval (default 60 s); on one machine neither need be long.
cat >"$DIR/slurm.conf" <<EOF
ClusterName=trainer
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$(port)
SlurmdPort=$(port)
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.sock,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF=$DIR/slurm.conf
setsid /usr/sbin/slurmctld -D -f "$SLURM_CONF" </dev/null >"$DIR/slurmctld.out" 2>&1 &
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
setsid /usr/sbin/slurmd -D -f "$SLURM_CONF" </dev/null >"$DIR/slurmd.out" 2>&1 &
for _ in $(seq 150); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 0.2; done
sinfo -h -o %t | grep -q idle || { echo "slurm_local: the node did not come up; see $DIR/*.log" >&2; exit 1; }
echo "slurm_local: munged, slurmctld, slurmd up on $HOST; SLURM_CONF=$SLURM_CONF"
