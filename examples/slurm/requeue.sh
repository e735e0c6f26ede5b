# Sourced by the sbatch scripts: run_step runs one job step that ends well at the time limit.
#   source examples/slurm/requeue.sh
#   run_step srun ... python -m mpi4py examples/burgers.py --checkpoint-dir DIR --resume ...
# With "#SBATCH --signal=B:USR1@<lead>" Slurm sends SIGUSR1 <lead> seconds before the time
# limit to the batch shell only: neither srun nor the ranks get it. run_step therefore runs
# the step in the background and traps SIGUSR1 in the batch shell itself (so this file is
# sourced, not run), forwards it to srun, which passes it on to every rank: the program saves
# a checkpoint and exits 0. When the step has ended with status 0 after the signal, run_step
# asks Slurm to requeue the job ("#SBATCH --requeue"); the next run starts with --resume.

# A signal that comes before run_step starts the step is remembered, not fatal to the script.
_run_step_signalled=0
trap '_run_step_signalled=1' USR1

run_step() {
  local step status
  "$@" &
  step=$!
  if [[ $_run_step_signalled == 1 ]]; then kill -USR1 "$step" 2>/dev/null || true; fi
  trap '_run_step_signalled=1
        echo "run_step: SIGUSR1 received, forwarding it to the job step (pid '"$step"')" >&2
        kill -USR1 '"$step"' 2>/dev/null || true' USR1
  # wait returns early (status > 128) whenever the trap runs: wait again until the step ends.
  while true; do
    status=0
    wait "$step" || status=$?
    kill -0 "$step" 2>/dev/null || break
  done
  trap - USR1
  if [[ $_run_step_signalled == 1 && $status == 0 && -n "${SLURM_JOB_ID:-}" ]]; then
    echo "run_step: the step saved and ended; requeueing job $SLURM_JOB_ID" \
         "(this was restart ${SLURM_RESTART_COUNT:-0})" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
