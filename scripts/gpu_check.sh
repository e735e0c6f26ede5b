#!/usr/bin/env bash
# GPU check: a definitive answer, within 7 minutes, on one machine with one GPU and no network.
#
#   scripts/gpu_check.sh                    output in out/gpu_check (GPU_CHECK_OUT=dir to move it)
#
# It uses the CuPy already installed for $PYTHON (default python3; .venv/bin/python when it
# imports CuPy), and an MPI from, in order: $MPIEXEC with the mpi4py that $PYTHON imports,
# or the wheels in .whl/ at the repository root (git-ignored), installed offline into a
# scratch venv that sees the system's NumPy and CuPy (pip 22.3 or later). Fill .whl/
# beforehand, on a machine with network, for the GPU machine's Python (docs/howto/gpus.rst):
#   pip download --only-binary=:all: --python-version 3.12 -d .whl \
#       mpi4py mpich pytest pytest-mpi ml_dtypes
#
# Steps, one line each: the GPU, MPI, the CUDA-aware question (a real CUDA-aware MPI, or the
# aware path emulated: CuPy arrays in managed memory, which a host MPI can read), the probe of
# CuPy's premises (scripts/gpu_probe.py), every CuPy test staged and aware on 2 and 4 ranks
# sharing the GPU, the GPU benchmark (benchmarks/bench_gpu.py). The last line is
# "VERDICT: PASS", "VERDICT: FAIL (...)" or "VERDICT: NOT TESTED (...)". Logs and summary.txt
# go to the output folder. Without a GPU it ends within seconds with NOT TESTED.
# GPU_CHECK_TESTS="files" narrows the tests, GPU_CHECK_BENCH=0 leaves out the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${GPU_CHECK_OUT:-out/gpu_check}
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
start=$(date +%s)
failures=()

say() { echo "$*" | tee -a "$summary"; }
verdict() { say "VERDICT: $*"; exit 0; }
elapsed() { echo $(( $(date +%s) - start ))s; }
step() {  # step NAME TIMEOUT_S COMMAND...: one line, PASS or FAIL, with the log's last line
  local name=$1 limit=$2; shift 2
  local log="$out/${name// /_}.log" t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  if [[ $rc == 0 ]]; then
    say "STEP $name: PASS (${took}s) $(grep -E 'passed|stand-in|premise|VERDICT' "$log" | tail -1)"
  else
    [[ $rc == 124 || $rc == 137 ]] && local why="timed out after ${limit}s" || local why="exit $rc"
    say "STEP $name: FAIL ($why, ${took}s; $log) $(grep -vE '^\s*$' "$log" | tail -1 | cut -c1-200)"
    failures+=("$name")
  fi
  return $rc
}

# ---------------------------------------------------------------- a GPU and CuPy (seconds)
py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x .venv/bin/python ]] && timeout 4 .venv/bin/python -c "import cupy" 2>/dev/null; then
    py=.venv/bin/python
  else
    py=python3
  fi
fi
if ! command -v "$py" > /dev/null; then verdict "NOT TESTED (no Python: $py)"; fi
gpu=$(timeout 5 "$py" -c '
import cupy
n = cupy.cuda.runtime.getDeviceCount()
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
print(n, name.decode() if isinstance(name, bytes) else name, cupy.__version__)' 2>&1 | tail -1)
rc=$?
if [[ $rc != 0 ]] || ! [[ $gpu =~ ^[1-9] ]]; then
  say "STEP GPU: none ($py: ${gpu:-no answer within 5 s})"
  verdict "NOT TESTED (no CUDA GPU with CuPy on this machine: ${gpu:-no answer})"
fi
say "STEP GPU: PASS ($gpu; $py)"

# ---------------------------------------------------------------- MPI (installed offline)
if ! "$py" -c "import mpi4py.MPI, pytest, pytest_mpi" 2>/dev/null || [[ -z ${MPIEXEC:-} && \
     ! -x "$(dirname "$(command -v "$py")")/mpiexec" ]]; then
  if ! ls .whl/mpi4py-*.whl > /dev/null 2>&1; then
    say "STEP MPI: FAIL (no mpi4py + mpiexec for $py and no wheels in .whl/)"
    verdict "NOT TESTED (no MPI: fill .whl/ as docs/howto/gpus.rst says)"
  fi
  # A scratch venv that sees the system's NumPy and CuPy, filled by this Python's pip (a venv
  # without pip is made in a second): every project of .whl/ but NumPy, offline, no resolving.
  venv=${TMPDIR:-/tmp}/pympar-gpu-check-venv
  names=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort -u | grep -vx numpy)
  if ! step "MPI install" 90 bash -c "rm -rf '$venv' &&
       '$py' -m venv --without-pip --system-site-packages '$venv' &&
       '$py' -m pip --python '$venv/bin/python' install -q --no-index --no-deps \
         --find-links .whl $(echo $names)"; then
    verdict "NOT TESTED (the MPI wheels in .whl/ do not install for $py: $out/MPI_install.log)"
  fi
  py=$venv/bin/python
fi
if [[ -z ${MPIEXEC:-} ]]; then
  MPIEXEC=$(dirname "$(command -v "$py")")/mpiexec
  [[ -x $MPIEXEC ]] || MPIEXEC=$(command -v mpiexec || true)
fi
if [[ -z $MPIEXEC || ! -x $MPIEXEC ]]; then
  say "STEP MPI: FAIL (no MPI launcher: set MPIEXEC)"
  verdict "NOT TESTED (no MPI launcher)"
fi
export MPIEXEC PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYMPAR_FAKE_CUPY=0
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYMPAR_LAUNCH_TIMEOUT=200
if ! step "MPI" 30 scripts/mpirun.sh 2 "$py" -c \
    "from mpi4py import MPI; c = MPI.COMM_WORLD; assert c.allreduce(1) == c.size == 2"; then
  verdict "NOT TESTED (MPI does not start 2 ranks: $out/MPI.log)"
fi

# ---------------------------------------------------------------- CUDA-aware: real or emulated
aware=$("$py" -c "from pympar import backend; print(backend.mpi_library_cuda_support())" 2>&1 |
        tail -1)
if [[ $aware == True ]]; then
  say "STEP CUDA-aware MPI: PASS (the MPI library reports CUDA support: device pointers go to it)"
else
  export PYMPAR_TEST_CUPY_MANAGED=1
  say "STEP CUDA-aware MPI: EMULATED (library answer: $aware; the aware path runs on CuPy" \
      "managed memory, which this host MPI can read)"
fi

# ---------------------------------------------------------------- the premises, the tests
step "probe of CuPy premises" 45 scripts/mpirun.sh 1 "$py" scripts/gpu_probe.py
grep -E "^premise" "$out/probe_of_CuPy_premises.log" | sed 's/^/  /' | tee -a "$summary"
tests=${GPU_CHECK_TESTS:-"tests/test_collectives.py tests/test_mappings.py
  tests/test_parallel_linear.py tests/test_attention.py tests/test_ring_attention.py
  tests/test_training.py tests/test_zero.py tests/test_cupy_paths.py"}
# The 2-rank run also compiles CuPy's kernels (cached on disk for the 4-rank run).
for n in 2 4; do
  # Both modes in one run: every CuPy test is parametrized cupy-staged and cupy-aware.
  step "CuPy tests on $n ranks (staged and aware)" $(( n == 2 ? 130 : 100 )) \
    scripts/mpirun.sh "$n" "$py" -m mpi4py \
    -m pytest --with-mpi -q -rs -p no:cacheprovider -k cupy $tests
  grep -E "^SKIPPED" "$out/CuPy_tests_on_${n}_ranks_(staged_and_aware).log" | sed 's/^/  /' |
    head -5 | tee -a "$summary"
done

# ---------------------------------------------------------------- the benchmark
# Whatever is left of the 7 minutes (410 s of steps), at most 60 s.
left=$(( 410 - $(date +%s) + start ))
if [[ ${GPU_CHECK_BENCH:-1} != 1 ]]; then
  say "STEP GPU benchmark: SKIPPED (GPU_CHECK_BENCH=0)"
elif (( left < 20 )); then
  say "STEP GPU benchmark: SKIPPED (only ${left}s left of the 7 minutes)"
else
  step "GPU benchmark on 2 ranks" $(( left < 60 ? left : 60 )) scripts/mpirun.sh 2 "$py" \
    benchmarks/bench_gpu.py --json "$out/bench_gpu.json"
  grep -E "^GPU " "$out/GPU_benchmark_on_2_ranks.log" | sed 's/^/  /' | tee -a "$summary"
fi

say "elapsed $(elapsed)"
if (( ${#failures[@]} )); then
  verdict "FAIL ($(printf '%s; ' "${failures[@]}")logs in $out)"
fi
verdict "PASS (aware path: $([[ $aware == True ]] && echo real CUDA-aware MPI || echo emulated on managed memory))"
