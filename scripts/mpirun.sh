#!/usr/bin/env bash
# Launch N ranks of a command with whichever MPI the environment provides, under a timeout.
#   scripts/mpirun.sh N command [args...]
#   scripts/mpirun.sh --kind      prints the launcher's kind: openmpi, mpich, srun or other
# MPIEXEC (default: mpiexec on PATH, the venv's first) and PYMPAR_LAUNCH_TIMEOUT (seconds,
# default 900) can be overridden. Open MPI (4's mpirun says "OpenRTE", 5's "Open MPI" or
# "PRRTE") needs --oversubscribe to run more ranks than cores and refuses root without its
# two opt-in variables; MPICH needs neither. MPIEXEC=srun runs a job step of N tasks under
# Slurm (--mpi=pmi2 unless SRUN_MPI names another plugin: pmix for Open MPI, with PMIx's
# native security unless PMIX_MCA_psec says otherwise).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${MPIEXEC:-}" ]]; then
  if [[ -x "$here/.venv/bin/mpiexec" ]]; then MPIEXEC="$here/.venv/bin/mpiexec"; else MPIEXEC=mpiexec; fi
fi
kind() {
  local version
  if [[ $(basename "$MPIEXEC") == srun ]]; then echo srun; return; fi
  version=$("$MPIEXEC" --version 2>&1 || true)
  if grep -qiE 'open ?mpi|open-?rte|prrte|open-mpi\.org' <<<"$version"; then echo openmpi
  elif grep -qiE 'hydra|mpich' <<<"$version"; then echo mpich
  else echo other; fi
}
if [[ ${1:-} == --kind ]]; then kind; exit 0; fi
if [[ $# -lt 2 ]]; then echo "usage: $0 N command [args...] | --kind" >&2; exit 2; fi
n=$1; shift
flags=()
case $(kind) in
  openmpi)
    flags+=(--oversubscribe)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ;;
  srun)
    flags+=("--mpi=${SRUN_MPI:-pmi2}")
    # Slurm offers PMIx clients munge security first; the Open MPI wheel's PMIx has none and
    # says so in four help blocks per rank, then takes native.
    [[ ${SRUN_MPI:-} == pmix ]] && export PMIX_MCA_psec=${PMIX_MCA_psec:-native} ;;
esac
# Ranks share this node's cores: one BLAS thread each, or they fight over cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} \
       MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
exec timeout --kill-after=10 "${PYMPAR_LAUNCH_TIMEOUT:-900}" "$MPIEXEC" "${flags[@]}" -n "$n" "$@"
