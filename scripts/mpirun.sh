#!/usr/bin/env bash
# Launch N ranks of a command with whichever MPI the environment provides, under a timeout.
#   scripts/mpirun.sh N command [args...]
# MPIEXEC (default: mpiexec on PATH, the venv's first) and PYMPAR_LAUNCH_TIMEOUT (seconds,
# default 900) can be overridden. Open MPI needs --oversubscribe to run more ranks than cores
# and refuses root without its two opt-in variables; MPICH needs neither.
set -euo pipefail
if [[ $# -lt 2 ]]; then echo "usage: $0 N command [args...]" >&2; exit 2; fi
n=$1; shift
here=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${MPIEXEC:-}" ]]; then
  if [[ -x "$here/.venv/bin/mpiexec" ]]; then MPIEXEC="$here/.venv/bin/mpiexec"; else MPIEXEC=mpiexec; fi
fi
flags=()
if "$MPIEXEC" --version 2>&1 | grep -qiE 'open ?mpi|open-rte|prrte'; then
  flags+=(--oversubscribe)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Ranks share this node's cores: one BLAS thread each, or they fight over cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} \
       MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
exec timeout --kill-after=10 "${PYMPAR_LAUNCH_TIMEOUT:-900}" "$MPIEXEC" "${flags[@]}" -n "$n" "$@"
