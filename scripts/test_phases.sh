#!/usr/bin/env bash
# The phases of `make test`: the suite once without a launcher (a singleton MPI world), then on
# each rank count. Every phase runs even when an earlier one failed, and a table at the end says
# which phases passed, with their test counts and times; the status is 1 if any phase failed.
#   scripts/test_phases.sh PYTHON "RANKS" PYTEST_ARGS...
# e.g. scripts/test_phases.sh .venv/bin/python "2 4 8" -m pytest --with-mpi -q -rs tests
# python -m mpi4py aborts the whole job when one rank raises, instead of hanging: a failing phase
# ends in MPI_Abort, which is how it stops its ranks, not a crash of the suite.
# PYMPAR_LAUNCH_TIMEOUT (seconds, default 900) bounds each phase.
#
# With TEST_NODES_PHASE=1 (make test sets it) two cross-node phases follow, on one machine:
# MPICH's MPIR_CVAR_ODD_EVEN_CLIQUES=1 makes COMM_TYPE_SHARED put the even and the odd ranks
# on two emulated nodes, so a group with ranks of both takes pympar's agreement check across
# nodes (pympar/_board.py), and its data moves through MPICH's network module, not its
# shared memory. PYMPAR_TEST_NODES=2 tells tests/test_multinode.py, which fails unless that
# path is taken; elsewhere it skips.
#   "4 ranks, 2 emulated nodes"     NODES_TESTS on 4 ranks (ranks 0, 2 | 1, 3);
#   "2-rank jobs, 2 emulated nodes" NODES_JOBS without a launcher: their tests start 2-rank
#       jobs of their own (the lone exit, the watchdog, mismatches said once), rank 0 and rank
#       1 each on a node. Those tests drop MPIR_* from their jobs' environment: the variable
#       reaches them as MPICH_ODD_EVEN_CLIQUES=1, MPICH's other name for the same setting.
# Only the NumPy variants run there (-k "not cupy"): the CuPy stand-in's take the same
# agreement and MPI paths. Where the launcher is Open MPI's, or a probe finds that the MPI's
# COMM_TYPE_SHARED ignores the variable, both phases say SKIPPED and why.
#   scripts/test_phases.sh --nodes-tests    prints NODES_TESTS (scripts/slurm_check.py runs
#                                           them under srun -N2)
set -uo pipefail
NODES_TESTS=(tests/test_multinode.py tests/test_agreement.py tests/test_collectives.py
             tests/test_mappings.py tests/test_parallel_linear.py tests/test_layers_3d.py
             tests/test_halo.py tests/test_stencil.py tests/test_fft.py tests/test_checkpoint.py
             tests/test_watchdog.py tests/test_faults.py)
NODES_JOBS=(tests/test_multinode.py tests/test_watchdog.py tests/test_faults.py
            tests/test_debug.py)
if [[ ${1:-} == --nodes-tests ]]; then echo "${NODES_TESTS[*]}"; exit 0; fi
if [[ $# -lt 3 ]]; then echo "usage: $0 PYTHON \"RANKS\" PYTEST_ARGS..." >&2; exit 2; fi
python=$1 ranks=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
limit=${PYMPAR_LAUNCH_TIMEOUT:-900}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
names=() results=() counts=() times=() cupy=()
any_failed=0 skipped=0
start_all=$SECONDS

run_phase() {  # run_phase NAME COMMAND...: run it, its output both shown and kept
  local name=$1 log="$logs/${#names[@]}.log" start=$SECONDS status
  shift
  echo "== pytest: $name =="
  "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  names+=("$name")
  times+=("$((SECONDS - start)) s")
  # pytest -q ends with a line like "812 passed, 9 skipped in 95.1s" (rank 0's, under MPI).
  # Under Open MPI's mpirun the log holds NUL bytes (grep -a) and pytest's colours (removed).
  local summary
  summary=$(sed -E $'s/\x1b\\[[0-9;]*m//g' "$log" \
            | grep -aE '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)' \
            | tail -n 1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*$//')
  counts+=("${summary:-no pytest summary}")
  cupy+=("$(grep -a -m 1 '^CuPy stand-in:' "$log")")
  if [[ $status -eq 0 ]]; then
    results+=("passed")
  else
    any_failed=1
    if [[ $status -eq 124 || $status -eq 137 ]]; then
      results+=("FAILED (timed out after $limit s)")
    else
      results+=("FAILED (status $status)")
    fi
  fi
}

run_phase "no launcher (1 rank)" env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  timeout --kill-after=10 "$limit" "$python" -m mpi4py "$@"
for n in $ranks; do
  run_phase "$n ranks" "$here/scripts/mpirun.sh" "$n" "$python" -m mpi4py "$@"
done

skip_phase() {  # skip_phase NAME WHY
  echo "== pytest: $1: SKIPPED ($2) =="
  names+=("$1") results+=("SKIPPED ($2)") counts+=("") times+=("") cupy+=("")
  skipped=$((skipped + 1))
}

# Why the emulated nodes cannot be had here, or nothing when they can.
nodes_unavailable() {
  local launcher=${MPIEXEC:-} out
  if [[ -z $launcher ]]; then
    if [[ -x "$here/.venv/bin/mpiexec" ]]; then launcher="$here/.venv/bin/mpiexec"; else launcher=mpiexec; fi
  fi
  if [[ $(MPIEXEC=$launcher "$here/scripts/mpirun.sh" --kind) == openmpi ]]; then
    echo "Open MPI has no cliques variable: its COMM_TYPE_SHARED always follows the real host"
    return
  fi
  out=$(MPIR_CVAR_ODD_EVEN_CLIQUES=1 PYMPAR_LAUNCH_TIMEOUT=120 \
        "$here/scripts/mpirun.sh" 4 "$python" -c '
from mpi4py import MPI
w = MPI.COMM_WORLD
node = w.Split_type(MPI.COMM_TYPE_SHARED)
lowest = w.allgather(node.allreduce(w.Get_rank(), op=MPI.MIN))
if w.Get_rank() == 0:
    print("emulated nodes:", *lowest)' 2>&1) \
    || { echo "the probe, a 4-rank job, failed: $(tail -n 1 <<<"$out")"; return; }
  if ! grep -qx 'emulated nodes: 0 1 0 1' <<<"$out"; then
    echo "this MPI's COMM_TYPE_SHARED ignores MPIR_CVAR_ODD_EVEN_CLIQUES=1 (4 ranks, the" \
         "lowest rank of each one's node: $(grep -m 1 '^emulated nodes:' <<<"$out" | cut -d: -f2-))"
  fi
}

if [[ ${TEST_NODES_PHASE:-0} == 1 ]]; then
  options=()   # the pytest arguments less the paths to test (make test's "tests")
  for arg in "$@"; do [[ -e $arg ]] || options+=("$arg"); done
  why=$(nodes_unavailable)
  if [[ -n $why ]]; then
    skip_phase "4 ranks, 2 emulated nodes" "$why"
    skip_phase "2-rank jobs, 2 emulated nodes" "$why"
  else
    run_phase "4 ranks, 2 emulated nodes" env MPIR_CVAR_ODD_EVEN_CLIQUES=1 PYMPAR_TEST_NODES=2 \
      "$here/scripts/mpirun.sh" 4 "$python" -m mpi4py "${options[@]}" -k "not cupy" \
      "${NODES_TESTS[@]}"
    run_phase "2-rank jobs, 2 emulated nodes" env MPIR_CVAR_ODD_EVEN_CLIQUES=1 \
      MPICH_ODD_EVEN_CLIQUES=1 PYMPAR_TEST_NODES=2 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
      timeout --kill-after=10 "$limit" "$python" -m mpi4py "${options[@]}" -k "not cupy" \
      "${NODES_JOBS[@]}"
  fi
fi

echo
echo "== make test: summary =="
for i in "${!names[@]}"; do
  if [[ -z ${times[$i]} ]]; then   # skipped
    printf '%-31s %s\n' "${names[$i]}:" "${results[$i]}"
  else
    printf '%-31s %s (%s, %s)\n' "${names[$i]}:" "${results[$i]}" "${counts[$i]}" "${times[$i]}"
  fi
done
for line in "${cupy[@]}"; do
  [[ -n "$line" ]] && echo "$line"
done
total="$((SECONDS - start_all)) s"
if [[ $any_failed -ne 0 ]]; then
  echo "make test: FAILED in $total (the phases above marked FAILED; their output is above)"
  exit 1
fi
if [[ $skipped -ne 0 ]]; then
  echo "make test: all $(( ${#names[@]} - skipped )) phases passed in $total ($skipped SKIPPED, above)"
else
  echo "make test: all ${#names[@]} phases passed in $total"
fi
