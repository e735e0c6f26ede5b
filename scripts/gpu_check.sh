#!/usr/bin/env bash
# GPU check: the CuPy-parametrized collective and mapping tests on 1 and 2 ranks, with
# pinned-host staging (PYMPAR_CUDA_AWARE=0) and device buffers handed to MPI (=1; those
# tests skip themselves when the MPI library does not report CUDA support).
#   scripts/gpu_check.sh [python]      default: .venv/bin/python, else python3
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
"$py" -c "import cupy" 2>/dev/null || "$py" -m pip install -q cupy-cuda12x
"$py" -c "import cupy; n = cupy.cuda.runtime.getDeviceCount(); assert n, 'no CUDA device'"
[[ -z "${MPIEXEC:-}" && -x "$(dirname "$py")/mpiexec" ]] && export MPIEXEC="$(dirname "$py")/mpiexec"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
for aware in 0 1; do
  mode=$([[ $aware == 1 ]] && echo cupy-aware || echo cupy-staged)
  for n in 1 2; do
    echo "== $n rank(s), PYMPAR_CUDA_AWARE=$aware ($mode)"
    PYMPAR_CUDA_AWARE=$aware scripts/mpirun.sh "$n" "$py" -m mpi4py -m pytest --with-mpi -q \
      -k "$mode" -rs tests/test_collectives.py tests/test_mappings.py
  done
done
# The layers on CuPy arrays (the "cupy" parameters), staged: 3D layers need 8 ranks.
for n in 2 4; do
  echo "== layers on CuPy, $n ranks"
  PYMPAR_CUDA_AWARE=0 scripts/mpirun.sh "$n" "$py" -m mpi4py -m pytest --with-mpi -q -k cupy -rs \
    tests/test_parallel_linear.py tests/test_attention.py tests/test_training.py
done
echo "== 3D layers on CuPy, 8 ranks"
PYMPAR_CUDA_AWARE=0 scripts/mpirun.sh 8 "$py" -m mpi4py -m pytest --with-mpi -q -k cupy -rs \
  tests/test_layers_3d.py
