#!/usr/bin/env bash
# pympar on machines you reach by ssh, without Slurm: one mpirun/mpiexec over a hostfile.
#   examples/slurm/mpirun.sh [more arguments for examples/burgers.py]
# Needs passwordless ssh between the machines, and the repository and its venv at the same
# path on every machine (a shared file system). Every line to adapt is marked "EDIT:".
set -euo pipefail

HOSTFILE=$HOME/hosts            # EDIT: Open MPI lines "node01 slots=8", MPICH lines "node01:8"
NODES=2                         # EDIT: how many machines of the hostfile to use
RANKS_PER_NODE=8                # EDIT: MPI ranks per machine (at most its cores)
REPO=$HOME/pympar               # EDIT: the repository, same path on every machine
TP=2                            # EDIT: tensor-parallel size (at most RANKS_PER_NODE)
CP=2                            # EDIT: context-parallel size; dp = ranks / (TP * CP)
LIMIT=3600                      # EDIT: wall-clock limit in seconds

source "$REPO/.venv/bin/activate"  # EDIT: if your venv lives elsewhere
cd "$REPO"
ranks=$((NODES * RANKS_PER_NODE))
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

if mpirun --version 2>&1 | grep -qiE 'open ?mpi|open-rte|prrte'; then
  # Open MPI starts remote ranks with a bare environment: forward what they need with -x.
  launch=(mpirun -n "$ranks" --hostfile "$HOSTFILE" --map-by "ppr:$RANKS_PER_NODE:node"
          --bind-to core)
  for name in PATH LD_LIBRARY_PATH VIRTUAL_ENV PYTHONPATH OMP_NUM_THREADS OPENBLAS_NUM_THREADS \
              MKL_NUM_THREADS PYMPAR_CUDA_AWARE PYMPAR_DEBUG PYMPAR_TIMEOUT; do
    if [[ -n "${!name+set}" ]]; then launch+=(-x "$name"); fi
  done
else
  # MPICH and Intel MPI (Hydra) forward the whole environment by default.
  launch=(mpiexec -n "$ranks" -f "$HOSTFILE" -ppn "$RANKS_PER_NODE")
fi

# Consecutive ranks share a machine, so each TP group stays on one machine.
timeout --kill-after=30 "$LIMIT" "${launch[@]}" python -m pympar info --tp "$TP" --cp "$CP"
timeout --kill-after=30 "$LIMIT" "${launch[@]}" python -m mpi4py examples/burgers.py \
    --tp "$TP" --cp "$CP" --out "out/burgers-$(date +%Y%m%d-%H%M%S)" "$@"
