#!/usr/bin/env bash
# `make test-system-mpi`: pympar on the machine's own MPI (MPI=system: mpi4py built from
# source against the mpicc on PATH, in .venv-system, launched by the mpiexec on PATH), as a
# cluster's `module load` gives it. The phase CI runs:
#   1. the build (make install MPI=system);
#   2. python -m pympar info without a launcher, then on 2 ranks;
#   3. tests/test_mappings.py on 2 ranks;
#   4. the tests whose jobs end by an error (tests/test_watchdog.py, test_faults.py,
#      test_error_messages.py, test_debug.py), in the pass without a launcher: they start
#      their own jobs under this MPI's launcher.
# SYSTEM_MPI_FULL=1 runs the whole `make test MPI=system` instead of 3 and 4.
# Where mpicc or mpiexec is missing from PATH, as root on a Debian-like machine it installs
# Debian's Open MPI (apt-get install libopenmpi-dev openmpi-bin); elsewhere it says
# "test-system-mpi: SKIPPED: <why>" and exits 0 (.ci/run reports the skip).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
skip() { echo "test-system-mpi: SKIPPED: $*"; exit 0; }
step() { echo "== test-system-mpi: $* =="; }

if ! command -v mpicc >/dev/null || ! command -v mpiexec >/dev/null; then
  [[ $(id -u) == 0 ]] || skip "no mpicc/mpiexec on PATH, and not root to install Debian's Open MPI"
  command -v apt-get >/dev/null || skip "no mpicc/mpiexec on PATH, and no apt-get to install one"
  step "apt-get install libopenmpi-dev openmpi-bin"
  # Other jobs on this machine may run apt-get at the same time: one at a time.
  apt=(flock /tmp/apt.lock env DEBIAN_FRONTEND=noninteractive apt-get -q -y)
  log=/tmp/pympar-apt.log
  { "${apt[@]}" update && "${apt[@]}" install libopenmpi-dev openmpi-bin; } >"$log" 2>&1 \
    || skip "apt-get could not install libopenmpi-dev openmpi-bin: $(tail -n 1 "$log")"
fi
mpiexec=$(command -v mpiexec)
echo "system MPI: mpicc $(command -v mpicc), mpiexec $mpiexec" \
     "($(MPIEXEC=$mpiexec scripts/mpirun.sh --kind))"

status=0
failed() { echo "test-system-mpi: FAILED ($*) in $((SECONDS - start)) s" >&2; exit 1; }
step "build: make install MPI=system"
make install MPI=system || failed "the build"
py=.venv-system/bin/python
export MPIEXEC=$mpiexec PYMPAR_FAKE_CUPY=${PYMPAR_FAKE_CUPY:-1}
step "python -m pympar info (no launcher, then 2 ranks)"
$py -m pympar info || failed "pympar info without a launcher"
scripts/mpirun.sh 2 $py -m pympar info || failed "pympar info on 2 ranks"

if [[ ${SYSTEM_MPI_FULL:-0} == 1 ]]; then
  step "make test MPI=system"
  make test MPI=system || status=$?
else
  step "tests/test_mappings.py on 2 ranks"
  scripts/mpirun.sh 2 $py -m mpi4py -m pytest --with-mpi -q -rs tests/test_mappings.py \
    || status=$?
  step "the jobs that end by an error, started without a launcher"
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    timeout --kill-after=10 "${PYMPAR_LAUNCH_TIMEOUT:-900}" $py -m mpi4py -m pytest --with-mpi \
    -q -rs tests/test_watchdog.py tests/test_faults.py tests/test_error_messages.py \
    tests/test_debug.py || status=$?
fi
if [[ $status != 0 ]]; then failed "status $status: the tests above"; fi
library=$($py -c 'from mpi4py import MPI; print(MPI.Get_library_version().split(",")[0])')
echo "test-system-mpi: passed in $((SECONDS - start)) s ($library)"
