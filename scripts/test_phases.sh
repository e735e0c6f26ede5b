#!/usr/bin/env bash
# The phases of `make test`: the suite once without a launcher (a singleton MPI world), then on
# each rank count. Every phase runs even when an earlier one failed, and a table at the end says
# which phases passed, with their test counts and times; the status is 1 if any phase failed.
#   scripts/test_phases.sh PYTHON "RANKS" PYTEST_ARGS...
# e.g. scripts/test_phases.sh .venv/bin/python "2 4 8" -m pytest --with-mpi -q -rs tests
# python -m mpi4py aborts the whole job when one rank raises, instead of hanging: a failing phase
# ends in MPI_Abort, which is how it stops its ranks, not a crash of the suite.
# PYMPAR_LAUNCH_TIMEOUT (seconds, default 900) bounds each phase.
set -uo pipefail
if [[ $# -lt 3 ]]; then echo "usage: $0 PYTHON \"RANKS\" PYTEST_ARGS..." >&2; exit 2; fi
python=$1 ranks=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
limit=${PYMPAR_LAUNCH_TIMEOUT:-900}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
names=() results=() counts=() times=() cupy=()
any_failed=0
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
  local summary
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)' "$log" \
            | tail -n 1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*$//')
  counts+=("${summary:-no pytest summary}")
  cupy+=("$(grep -m 1 '^CuPy stand-in:' "$log")")
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

echo
echo "== make test: summary =="
for i in "${!names[@]}"; do
  printf '%-22s %s (%s, %s)\n' "${names[$i]}:" "${results[$i]}" "${counts[$i]}" "${times[$i]}"
done
for line in "${cupy[@]}"; do
  [[ -n "$line" ]] && echo "$line"
done
total="$((SECONDS - start_all)) s"
if [[ $any_failed -ne 0 ]]; then
  echo "make test: FAILED in $total (the phases above marked FAILED; their output is above)"
  exit 1
fi
echo "make test: all ${#names[@]} phases passed in $total"
