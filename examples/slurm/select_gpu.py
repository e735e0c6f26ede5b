#!/usr/bin/env python3
"""Give each rank its own GPU, chosen from its node-local rank, then run a program.

    srun python examples/slurm/select_gpu.py SCRIPT.py [ARGS...]
    srun python examples/slurm/select_gpu.py -m MODULE [ARGS...]

The node-local rank is read from the launcher's environment when the launcher
sets one, so the device is chosen before MPI starts (some CUDA-aware MPI
libraries want that); otherwise it comes from MPI itself, by splitting
``COMM_WORLD`` into one communicator per shared-memory node. The device is
``local_rank % visible GPUs``, made current with CuPy for the program that
follows. All GPUs of the node stay visible, so CUDA-aware transports can copy
between them directly.

Without CuPy, or where CUDA sees no GPU, it prints one line (from the job's
first task) and every task exits 1, before MPI has started.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NoReturn

#: Node-local rank variables, most specific launcher first. SLURM_LOCALID comes
#: last: an mpirun started inside an sbatch script inherits the batch step's
#: SLURM_LOCALID (0 on every rank) but sets its own variable, found first.
LOCAL_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI mpirun
    "MV2_COMM_WORLD_LOCAL_RANK",   # MVAPICH2 mpirun_rsh / mpiexec
    "MPI_LOCALRANKID",             # MPICH and Intel MPI (Hydra)
    "PALS_LOCAL_RANKID",           # HPE Cray PALS (mpiexec on PBS systems)
    "SLURM_LOCALID",               # srun
)
#: Global rank variables of the launchers: which task prints a refusal (MPI is not up yet).
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID")


def refuse(message: str) -> NoReturn:
    """Print ``select_gpu.py: error: message`` from the job's first task; exit 1 on every task."""
    rank = next((os.environ[v].strip() for v in RANK_VARIABLES if v in os.environ), "0")
    if rank in ("", "0"):
        print(f"select_gpu.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def local_rank() -> tuple[int, str]:
    """Return this process's rank among the ranks of its node, and where it came from."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    rank = node.Get_rank()
    node.Free()
    return rank, "MPI.COMM_TYPE_SHARED"


def select_gpu() -> int:
    """Make GPU ``local_rank % device_count`` current for CuPy; return its index.

    Refuses (:func:`refuse`) without CuPy or without a GPU.
    """
    try:
        import cupy
    except ImportError as err:
        refuse(f"CuPy is not installed here ({err}); on GPU nodes install pympar with "
               f"pip install -e '.[cuda]' (CuPy for CUDA 12)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError: no driver, no device
        refuse(f"CUDA finds no GPU on {os.uname().nodename} ({err}); ask Slurm for GPUs "
               f"(--gpus-per-node) and run on a GPU node")
    if count < 1:
        refuse(f"CuPy sees no GPU on {os.uname().nodename}; ask Slurm for GPUs "
               f"(--gpus-per-node)")
    rank, source = local_rank()
    device = rank % count
    cupy.cuda.Device(device).use()
    os.environ["SELECT_GPU_LOCAL_RANK"] = f"{source}={rank}"
    return device


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        sys.exit(__doc__)
    select_gpu()
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
