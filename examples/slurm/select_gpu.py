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
"""

from __future__ import annotations

import os
import runpy
import sys

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
    """Make GPU ``local_rank % device_count`` current for CuPy; return its index."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError("select_gpu.py: CuPy sees no GPU on this node")
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
