# Sourced by the sbatch scripts: run_step runs the job step that may stop early and be requeued.
#   source examples/slurm/requeue.sh          (early in the script: it installs the trap)
#   run_step srun ... python -m mpi4py examples/burgers.py --checkpoint-dir DIR --resume ...
#
# The protocol (docs/howto/slurm.rst draws its timeline):
# 1. A stop request to the batch shell (SIGUSR1 from "#SBATCH --signal=B:USR1@<lead>" or
#    "scancel --batch --signal=USR1") creates the stop file $PYMPAR_STOP_FILE. The program's
#    pympar.preemption.Preemption looks for it at start-up and at every step boundary, so a
#    request made before the program has installed its signal handler is not lost. The
#    signal itself is not passed on: a rank still starting up would die of it.
# 2. A signal to the job steps ("--signal=USR1@<lead>" without B:, "scancel --signal=USR1")
#    reaches the ranks directly; Preemption's handler notes it.
# 3. Either way every rank saves at the same step, MPI finalizes, and the program exits 75
#    (pympar.preemption.REQUEUE_STATUS). run_step requeues the job exactly on that status,
#    after the step has ended: a requeue while the step runs would kill its ranks.
#    A finished run exits 0 and is not requeued; any other status is returned as it is.
# 4. When a requeued run sources this file (before its first step), it removes what MPICH's
#    shared memory of the previous run of this job left in /dev/shm (same job id, same step
#    ids, same names).

PYMPAR_REQUEUE_STATUS=75
echo "requeue.sh: job ${SLURM_JOB_ID:-(none)}, run ${SLURM_RESTART_COUNT:-0} starts" \
     "(${SLURM_RESTART_COUNT:-0} requeues so far)" >&2
# Where rank 0 of the program and this shell both see it (the submit directory is shared).
export PYMPAR_STOP_FILE=${PYMPAR_STOP_FILE:-${SLURM_SUBMIT_DIR:-$PWD}/.pympar-stop-${SLURM_JOB_ID:-$$}}
rm -f "$PYMPAR_STOP_FILE"   # a request of an earlier run of this job is not for this one

_run_step_stop() {
  echo "run_step: SIGUSR1: asking the program to stop ($PYMPAR_STOP_FILE)" >&2
  : >"$PYMPAR_STOP_FILE"
}
trap _run_step_stop USR1

# MPICH (ch4; checked with 5.0.2 under Slurm 22.05) names the shared memory of a job step
# mpich_shm_<FNV-1a of the PMI job id, hex>_<node>; Slurm's PMI job id is "<job>.<step>".
# A run killed before MPI_Finalize leaves it behind, and the requeued run (same job and step
# ids) would attach to it and fail or hang in MPI_Init.
mpich_shm_hash() {
  local key=$1 hash=2166136261 i code
  for ((i = 0; i < ${#key}; i++)); do
    printf -v code '%d' "'${key:i:1}"
    hash=$(( ((hash ^ code) * 16777619) & 0xFFFFFFFF ))
  done
  printf '%x\n' "$hash"
}

# remove_stale_mpich_shm JOB [STEPS]: delete this node's MPICH segments of steps
# 0..STEPS-1 (default 64) of job JOB. Only for a job none of whose steps runs now.
remove_stale_mpich_shm() {
  local job=$1 steps=${2:-64} step hash file
  for ((step = 0; step < steps; step++)); do
    hash=$(mpich_shm_hash "$job.$step")
    for file in /dev/shm/mpich_shm_"${hash}"_* /dev/shm/mpich_vci_"${hash}"_*; do
      [[ -e $file ]] || continue
      echo "run_step: removing $file, left by an earlier run of job $job (step $step)" >&2
      rm -f "$file"
    done
  done
}

# A requeued run starts with none of its steps running: clear the node(s) before the first.
if [[ -n ${SLURM_JOB_ID:-} && ${SLURM_RESTART_COUNT:-0} != 0 ]]; then
  if [[ ${SLURM_JOB_NUM_NODES:-1} == 1 ]]; then
    remove_stale_mpich_shm "$SLURM_JOB_ID"
  else  # every node of the job: one small task per node (--ntasks too: srun would take the
        # job's SLURM_NTASKS for the task count and ignore --ntasks-per-node)
    srun --mpi=none --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
      --ntasks-per-node=1 bash -c \
      "$(declare -f mpich_shm_hash remove_stale_mpich_shm); remove_stale_mpich_shm $SLURM_JOB_ID" \
      || echo "requeue.sh: could not clear /dev/shm on every node (srun failed)" >&2
  fi
fi

run_step() {
  local status pid
  "$@" &
  pid=$!
  # wait returns early (status > 128) whenever the trap runs: wait again until the step ends.
  while true; do
    status=0
    wait "$pid" || status=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  rm -f "$PYMPAR_STOP_FILE"
  if [[ $status == "$PYMPAR_REQUEUE_STATUS" && -n ${SLURM_JOB_ID:-} ]]; then
    echo "run_step: the program saved and stopped early (status $status); requeueing job" \
         "$SLURM_JOB_ID (this was run ${SLURM_RESTART_COUNT:-0})" >&2
    # The step has ended: the requeue ends this script, and nothing else of the job runs.
    if scontrol requeue "$SLURM_JOB_ID"; then
      return 0
    fi
    echo "run_step: scontrol requeue $SLURM_JOB_ID failed (is the job --requeue?)" >&2
  fi
  return "$status"
}
