#!/usr/bin/env bash
# make gpu-rehearsal: the GPU machine's Python layout, built here, and scripts/gpu_check.sh run
# on it as a developer holding that machine would, so that a lent GPU ends in a verdict about
# the GPU and not about the script.
#
# The layout (docs/howto/gpus.rst): a Python 3.12 venv holding NumPy, pytest, ml_dtypes,
# xxhash and an mpi4py that finds no MPI library; CuPy, here the project's stand-in installed
# as the packages cupy and cupyx; .whl/ filled by scripts/gpu_wheels.sh. The check then runs
# every step (the GPU line, the MPI install, MPI, the CUDA-aware question, the probe, the CuPy
# tests on 2 and 4 ranks, a small benchmark) and must end "VERDICT: PASS".
# Says "gpu-rehearsal: SKIPPED (why)" where no Python 3.12 can be found (PYTHON312=path), or where
# this host has an MPI library that no private mount namespace can hide (not root).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
dir=${GPU_REHEARSAL_DIR:-out/gpu_rehearsal}

py312=
candidates=("${PYTHON312:-}" python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12)
if command -v pyenv > /dev/null; then
  candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
fi
for candidate in "${candidates[@]}"; do
  if [[ -n $candidate ]] && "$candidate" -c \
      'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2> /dev/null; then
    py312=$(command -v "$candidate"); break
  fi
done
if [[ -z $py312 ]]; then
  echo "gpu-rehearsal: SKIPPED (no Python 3.12 with venv here, the GPU machine's version;" \
       "PYTHON312=path names one)"
  exit 0
fi

echo "gpu-rehearsal: the GPU machine's layout in $dir/venv ($py312)"
rm -rf "$dir"
mkdir -p "$dir"
venv=$dir/venv
"$py312" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check numpy pytest ml_dtypes xxhash \
  mpi4py
# The GPU machine has no MPI library. Where this host has one (Debian's Open MPI, which make
# test-system-mpi installs), the check runs in a mount namespace of its own in which every
# MPI library the loader knows, and every launcher on PATH, reads as /dev/null.
hidden=()
if "$venv/bin/python" -c "from mpi4py import MPI" 2> /dev/null; then
  mapfile -t hidden < <({ ldconfig -p | awk '$1 ~ /^lib(mpi|mpich|pmpi)[.-]/ {print $NF}'
                          for launcher in mpiexec mpirun; do type -aP "$launcher"; done; } |
                        xargs -r readlink -f | sort -u)
fi
in_layout() {  # COMMAND...: run as on the GPU machine, the host's MPI hidden
  if (( ${#hidden[@]} == 0 )); then "$@"; return; fi
  unshare --mount --propagation private bash -c \
    'n=$1; shift; for f in "${@:1:n}"; do mount --bind /dev/null "$f" || exit 97; done
     shift "$n"; exec "$@"' _ "${#hidden[@]}" "${hidden[@]}" "$@"
}
if (( ${#hidden[@]} )) && ! in_layout true 2> /dev/null; then
  echo "gpu-rehearsal: SKIPPED (this host's MPI (${hidden[*]}) must be hidden from the venv, as" \
       "the GPU machine has none, and unshare --mount, which would hide it, is not allowed here)"
  exit 0
fi
if in_layout "$venv/bin/python" -c "from mpi4py import MPI" 2> /dev/null; then
  echo "gpu-rehearsal: FAIL (the venv's mpi4py found an MPI library; the GPU machine's finds none)"
  exit 1
fi
(( ${#hidden[@]} )) && echo "gpu-rehearsal: this host's MPI hidden from the check: ${hidden[*]}"
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
cp -r tests/fakecupy/cupy tests/fakecupy/cupyx "$site/"
scripts/gpu_wheels.sh .whl

echo "gpu-rehearsal: scripts/gpu_check.sh on that layout ($(( $(date +%s) - start ))s of set-up)"
# As on the GPU machine: no MPI of this project's venv, nothing on PYTHONPATH.
in_layout env -u MPIEXEC -u PYTHONPATH -u PYMPAR_FAKE_CUPY PATH="$venv/bin:$PATH" \
  PYTHON="$venv/bin/python" GPU_CHECK_OUT="$dir/check" \
  GPU_CHECK_BENCH_ARGS="--sizes 4KiB,64KiB --repeats 3 --mlp 64x128" \
  scripts/gpu_check.sh | tee "$dir/check.txt"

missing=()
for step in "GPU: PASS" "MPI install: PASS" "MPI: PASS" "CUDA-aware MPI: " \
            "CUDA support of the Open MPI wheel: PASS" "probe of CuPy premises: PASS" \
            "CuPy tests on 2 ranks (staged and aware): PASS" \
            "CuPy tests on 4 ranks (staged and aware): PASS" "GPU benchmark on 2 ranks: PASS"; do
  grep -qF "STEP $step" "$dir/check.txt" || missing+=("$step")
done
took=$(( $(date +%s) - start ))
if ! tail -1 "$dir/check.txt" | grep -q '^VERDICT: PASS' || (( ${#missing[@]} )); then
  echo "gpu-rehearsal: FAIL after ${took}s ($(tail -1 "$dir/check.txt");" \
       "steps not run or not passed: ${missing[*]:-none}; logs in $dir/check)"
  exit 1
fi
echo "gpu-rehearsal: PASS in ${took}s, every step run (logs in $dir/check)"
