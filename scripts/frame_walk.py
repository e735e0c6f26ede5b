"""List the pympar frames one warm call visits, file:line by file:line (run on 2 ranks).

    scripts/mpirun.sh 2 .venv/bin/python scripts/frame_walk.py

Each call is made a few times first (plans, scratch and signatures cached), then once
under ``sys.setprofile``; every Python function entered inside the package is listed in
order of entry. A rank that waits for the other in the agreement check also enters
``Board._spin``, which rank 0 shows when it came first.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pympar  # noqa: E402
from pympar import manager, mappings  # noqa: E402
from pympar.modules import ColumnParallelLinear  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(pympar.__file__))


def walk(call: Callable[[], Any]) -> list[str]:
    """The pympar functions ``call`` enters, as ``file:line function`` (first line of each)."""
    for _ in range(5):
        call()
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE):
            where = os.path.relpath(code.co_filename, os.path.dirname(PACKAGE))
            seen.append(f"{where}:{code.co_firstlineno} {code.co_qualname}")

    MPI.COMM_WORLD.Barrier()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    state = manager.initialize_parallel(tensor_parallel_size=MPI.COMM_WORLD.size)
    group = state.tensor
    x = np.ones((256,), np.float32)
    out = np.empty_like(x)
    layer = ColumnParallelLinear(16, 16, group=group)
    h = np.ones((4, 2, 16), np.float32)
    for name, call in (("reduce_from_all(x, group, out=out)",
                        lambda: mappings.reduce_from_all(x, group, out=out)),
                       ("ColumnParallelLinear.forward(x)", lambda: layer.forward(h))):
        frames = walk(call)
        if MPI.COMM_WORLD.rank == 0:
            print(f"{name}: {len(frames)} pympar frames")
            for i, frame in enumerate(frames, 1):
                print(f"  {i:2d}. {frame}")
    manager.destroy_parallel()


if __name__ == "__main__":
    main()
