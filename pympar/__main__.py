"""Command line: ``mpiexec -n N python -m pympar info [--tp --cp --order --mode]``."""

from __future__ import annotations

import argparse
import socket
import sys

from mpi4py import MPI

from . import __version__, backend, manager


def _info(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    state = manager.initialize_parallel(args.tp, args.cp, args.order, comm, args.mode)
    try:
        row = (comm.Get_rank(), socket.gethostname(), state.mesh.coords,
               [g.name for g in state.all_groups()])
        rows = comm.gather(row, root=0)
        if comm.Get_rank() == 0:
            aware = backend.mpi_library_cuda_support()
            print(f"pympar {__version__}")
            print(f"world size        {comm.Get_size()}")
            print(f"MPI library       {MPI.Get_library_version().splitlines()[0].strip()}")
            print(f"MPI standard      {'.'.join(map(str, MPI.Get_version()))}, "
                  f"mpi4py {__import__('mpi4py').__version__}")
            print(f"CUDA-aware MPI    {'unknown' if aware is None else aware} "
                  f"(PYMPAR_CUDA_AWARE={backend.cuda_aware() and 'on' or 'off'} in use)")
            print(f"layout            {state.mesh!r}, mode {state.tensor_parallel_mode}")
            names = ["tensor", "context", "data", "data_context", *[m.value for m in state.groups_3d]]
            print("rank  host  coords  " + "  ".join(names))
            for rank, host, coords, groups in rows:
                coord_text = ",".join(f"{a}={c}" for a, c in coords.items())
                print(f"{rank:4d}  {host}  {coord_text}  " + "  ".join(groups))
            sys.stdout.flush()
    finally:
        manager.destroy_parallel()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the pympar command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m pympar", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="print the MPI setup and the parallel layout")
    info.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    info.add_argument("--cp", type=int, default=1, help="context-parallel size")
    info.add_argument("--order", default="tp-cp-dp", help="axes innermost first")
    info.add_argument("--mode", default="1d", choices=manager.TENSOR_PARALLEL_MODES,
                      help="tensor-parallel mode")
    info.set_defaults(run=_info)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as err:
        print(f"pympar {args.command}: error on rank {MPI.COMM_WORLD.Get_rank()}: {err}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
