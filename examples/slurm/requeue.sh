# Sourced by the sbatch scripts: run_step runs one job step that ends well at the time limit.
#   source examples/slurm/requeue.sh
#   run_step srun ... python -m mpi4py examples/burgers.py --checkpoint-dir DIR --resume ...
# With "#SBATCH --signal=B:USR1@<lead>" Slurm sends SIGUSR1 <lead> seconds before the time
# limit to the batch shell only: neither srun nor the ranks get it. run_step therefore runs
# the step in the background and traps SIGUSR1 in the batch shell itself (so this file is
# sourced, not run), forwards it to srun, which passes it on to every rank: the program saves
# a checkpoint and exits 0. When the step has ended with status 0 after the signal, run_step
# asks Slurm to requeue the job ("#SBATCH --requeue"); the next run starts with --resume.

# One handler, installed when this file is sourced: a signal that comes before the step has
# started is remembered (not fatal to the script) and forwarded as soon as the step runs.
_run_step_signalled=0
_run_step_pid=
_run_step_forward() {
  _run_step_signalled=1
  if [[ -n $_run_step_pid ]]; then
    echo "run_step: SIGUSR1 received, forwarding it to the job step (pid $_run_step_pid)" >&2
    kill -USR1 "$_run_step_pid" 2>/dev/null || true
  fi
}
trap _run_step_forward USR1

run_step() {
  local status
  "$@" &
  _run_step_pid=$!
  if [[ $_run_step_signalled == 1 ]]; then _run_step_forward; fi
  # wait returns early (status > 128) whenever the trap runs: wait again until the step ends.
  while true; do
    status=0
    wait "$_run_step_pid" || status=$?
    kill -0 "$_run_step_pid" 2>/dev/null || break
  done
  _run_step_pid=
  if [[ $_run_step_signalled == 1 && $status == 0 && -n "${SLURM_JOB_ID:-}" ]]; then
    echo "run_step: the step saved and ended; requeueing job $SLURM_JOB_ID" \
         "(this was restart ${SLURM_RESTART_COUNT:-0})" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
