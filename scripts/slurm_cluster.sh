#!/usr/bin/env bash
# A two-node Slurm on this machine, for `make test-slurm`: installed from the distribution's
# packages, configured in a directory of its own, started and stopped again. The two nodes,
# n1 and n2, are two slurmd on this host (`slurmd -N n1`, `slurmd -N n2`, each on a port of its
# own): a job of --nodes=2 gets tasks on both, and an MPI under srun sees two nodes (PMI's
# process mapping), though they share the host's cores and /dev/shm. Where the second slurmd
# cannot run (or SLURM_CI_NODES=1), n1 alone: $SLURM_CI_DIR/one-node says why.
#   scripts/slurm_cluster.sh up      install slurm-wlm and munge (apt), write slurm.conf, start
#                                    munged, slurmctld and both slurmd; prints the SLURM_CONF
#   scripts/slurm_cluster.sh down    stop the daemons that `up` started (and only those)
# `up` exits 3 (after saying why) where Slurm cannot be installed or started: not root, no
# apt-get, no package, a daemon that does not come up. Needs root; writes only under
# SLURM_CI_DIR (default /tmp/pympar-slurm) besides the packages and munge's key.
set -euo pipefail

DIR=${SLURM_CI_DIR:-/tmp/pympar-slurm}
CONF=$DIR/etc/slurm.conf
# Other jobs on this machine may run apt-get at the same time: one at a time.
APT=(flock /tmp/apt.lock env DEBIAN_FRONTEND=noninteractive apt-get -q -y)

skip() { echo "slurm_cluster: cannot run a Slurm here: $*" >&2; exit 3; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v munged >/dev/null && command -v sbatch >/dev/null; then
    return
  fi
  [[ $(id -u) == 0 ]] || skip "installing slurm-wlm needs root"
  command -v apt-get >/dev/null || skip "no apt-get (not a Debian-like machine)"
  echo "slurm_cluster: installing slurm-wlm and munge from apt"
  "${APT[@]}" update >/dev/null || skip "apt-get update failed"
  "${APT[@]}" install --no-install-recommends slurm-wlm munge >"$DIR/apt.log" 2>&1 \
    || skip "apt-get install slurm-wlm munge failed (see $DIR/apt.log)"
}

write_config() {
  local host cpus
  host=$(hostname -s)
  # 16 CPUs per node whatever the machine has (config_overrides): the check's jobs of 4 ranks
  # each run side by side, their ranks sharing the real cores.
  cpus=$(( $(nproc) > 16 ? $(nproc) : 16 ))
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/one-node"  # a fresh cluster each time ...
  # ... whose job ids never repeat an earlier one's, as on a real cluster: a job id and step
  # id name MPICH's shared memory, and a killed earlier job of the same id would have left
  # its segment behind for the new one to hang on.
  local first=$(( $(date +%s) / 10 % 60000000 + 1000 ))
  mkdir -p "$DIR/etc" "$DIR/state" "$DIR/spool" "$DIR/log"
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: two nodes on this host, daemons as root.
ClusterName=pympar-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s (BeginTime) before it may start again: until then
# slurmd still refuses the revoked credential of the run that ended. 120 s by default; 20 s
# keeps the check short.
AuthInfo=cred_expire=20
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
KillWait=30
# Ended jobs stay known to slurmctld for an hour: the check asks about the GPU job, which
# fails at once, when the others have ended (with 600 s it had been forgotten under load).
MinJobAge=3600
FirstJobId=$first
InactiveLimit=0
NodeName=n1 NodeHostname=$host NodeAddr=$host Port=16818 CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=$host Port=16819 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=ci Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemons() {
  export SLURM_CONF=$CONF
  if ! munge -n </dev/null >/dev/null 2>&1; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    if command -v runuser >/dev/null && id munge >/dev/null 2>&1; then
      runuser -u munge -- munged || skip "munged did not start"
    else
      munged --force || skip "munged did not start"
    fi
    echo munged >"$DIR/started"
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null >/dev/null 2>&1 || skip "munged does not answer"
  fi
  slurmctld -c -f "$CONF" || skip "slurmctld did not start (see $DIR/log/slurmctld.log)"
  echo slurmctld >>"$DIR/started"
  # n1 is needed; without n2 the cluster runs on one node and says why in $DIR/one-node
  # (scripts/slurm_check.py then skips its two-node checks, saying so).
  slurmd -f "$CONF" -N n1 || skip "slurmd -N n1 did not start (see $DIR/log/slurmd-n1.log)"
  echo "slurmd n1" >>"$DIR/started"
  if [[ ${SLURM_CI_NODES:-2} == 1 ]]; then
    echo "SLURM_CI_NODES=1: the cluster has one node" >"$DIR/one-node"
  elif slurmd -f "$CONF" -N n2 2>"$DIR/log/slurmd-n2.err"; then
    echo "slurmd n2" >>"$DIR/started"
  else
    echo "a second slurmd (slurmd -N n2) did not start on this host: $(tail -n 1 \
      "$DIR/log/slurmd-n2.err") (see $DIR/log/slurmd-n2.log)" >"$DIR/one-node"
  fi
  local idle
  for _ in $(seq 150); do
    idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle" {print $1}' | sort | xargs) \
      || true
    if [[ $idle == "n1 n2" ]] || [[ $idle == n1* && -f $DIR/one-node ]]; then break; fi
    sleep 0.2
  done
  if [[ $idle != n1* ]]; then
    sinfo -N -l >&2 || true
    skip "node n1 did not become idle (see $DIR/log/)"
  elif [[ $idle != "n1 n2" && ! -f $DIR/one-node ]]; then
    echo "node n2 (a second slurmd on this host) did not become idle: $(sinfo -h -n n2 \
      -o '%T %E' 2>/dev/null) (see $DIR/log/slurmd-n2.log)" >"$DIR/one-node"
  fi
  if [[ -f $DIR/one-node ]]; then
    echo "slurm_cluster: one node only: $(cat "$DIR/one-node")" >&2
  fi
  echo "slurm_cluster: Slurm $(sinfo -V | cut -d' ' -f2) up: node(s) $idle on $(hostname -s);" \
       "export SLURM_CONF=$CONF"
}

stop_one() {  # pid file, name
  local pid
  [[ -f $1 ]] || return 0
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  echo "slurm_cluster: $2 (pid $pid) did not stop; killing it" >&2
  kill -9 "$pid" 2>/dev/null || true
}

stop_daemons() {
  export SLURM_CONF=$CONF
  [[ -f $DIR/started ]] || return 0
  if grep -q slurmctld "$DIR/started" && [[ -f $DIR/slurmctld.pid ]]; then
    scancel --state=RUNNING --user="$(id -un)" 2>/dev/null || true
    scancel --user="$(id -un)" 2>/dev/null || true
  fi
  local node
  for node in $(sed -n 's/^slurmd //p' "$DIR/started"); do
    stop_one "$DIR/slurmd-$node.pid" "slurmd -N $node"
  done
  grep -qx slurmd "$DIR/started" && stop_one "$DIR/slurmd.pid" slurmd   # an older one-node up
  grep -q slurmctld "$DIR/started" && stop_one "$DIR/slurmctld.pid" slurmctld
  if grep -q munged "$DIR/started"; then
    stop_one /run/munge/munged.pid munged
  fi
  rm -f "$DIR/started"
  echo "slurm_cluster: stopped the Slurm daemons on $(hostname -s)"
}

case "${1:-}" in
  up)
    mkdir -p "$DIR"
    if [[ -f $DIR/started ]]; then stop_daemons; fi
    install_packages
    write_config
    start_daemons ;;
  down) stop_daemons ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
