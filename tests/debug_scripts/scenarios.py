"""Two-rank misuse scenarios that debug mode or the timeout must turn into errors.

Launched by ``tests/test_debug.py`` as::

    scripts/mpirun.sh 2 python -m mpi4py tests/debug_scripts/scenarios.py SCENARIO

with ``PYMPAR_DEBUG=1``, ``PYMPAR_TIMEOUT=seconds`` or nothing in the environment. Every
rank prints ``[rank R] ErrorName: message`` when it catches a pympar error, waits until the
other ranks have printed theirs (every scenario fails on every rank or on none), then
re-raises; ``python -m mpi4py`` turns the unhandled exception into an abort of the whole job,
so the run ends with a non-zero status instead of hanging, and every rank's line is out
before the first abort, whichever launcher kills the other ranks then.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from pympar import mappings
from pympar.debug import CollectiveMismatchError, CollectiveTimeoutError
from pympar.mesh import Mesh

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank


def shapes(group: Any, other: Any) -> None:
    """Rank 1 passes a (4, 4) array where rank 0 passes (4, 3)."""
    group.all_reduce(np.zeros((4, 3 + RANK)))


def dtypes(group: Any, other: Any) -> None:
    """Rank 1 passes float32 where rank 0 passes float64."""
    group.all_reduce(np.zeros(4, np.float64 if RANK == 0 else np.float32))


def mappings_differ(group: Any, other: Any) -> None:
    """Rank 0 calls copy_to_all's backward, rank 1 reduce_from_all: the same all-reduce."""
    mapping = mappings.copy_to_all.backward if RANK == 0 else mappings.reduce_from_all
    mapping(np.ones((2, 2)), group)


def skipped(group: Any, other: Any) -> None:
    """Rank 1 skips the all_reduce and goes on to an all_gather on another group."""
    if RANK == 0:
        group.all_reduce(np.ones(4))
    else:
        other.all_gather(np.ones(4), sizes=[4] * other.size)


def timed_rows(group: Any, other: Any) -> None:
    """With only PYMPAR_TIMEOUT set, ranks pass batches of 32 and 16 rows to reduce_from_all."""
    mappings.reduce_from_all(np.ones((32 >> RANK, 8), np.float32), group)


def big_dtypes(group: Any, other: Any) -> None:
    """No setting at all: float32 against int32 (same item size) in a 1 MiB all_reduce."""
    group.all_reduce(np.zeros(2**18, np.float32 if RANK == 0 else np.int32))


def matching(group: Any, other: Any) -> None:
    """Legal uneven calls: debug mode must let them through."""
    x = np.ones((3 - RANK, 3))  # balanced split of 5 rows
    y = group.all_gather(x)
    z = mappings.gather_from_sequence.backward(y, group)
    assert z.shape == x.shape


SCENARIOS: dict[str, Callable[[Any, Any], None]] = {
    f.__name__: f for f in (shapes, dtypes, mappings_differ, skipped, timed_rows,
                             big_dtypes, matching)}


#: Seconds a rank that caught its error waits for the others to have printed theirs.
MEET_SECONDS = 60.0


def meet(comm: MPI.Comm, seconds: float) -> None:
    """Wait until every rank of ``comm`` is here, at most ``seconds``."""
    request, deadline = comm.Ibarrier(), time.monotonic() + seconds
    while not request.Test() and time.monotonic() < deadline:
        time.sleep(1e-3)


def main() -> None:
    scenario = SCENARIOS[sys.argv[1]]
    ending = WORLD.Dup()  # never matched with what a scenario leaves pending
    mesh = Mesh(WORLD, {"w": WORLD.size})
    group, other = mesh.group("w"), mesh.group("w", key="aux")
    try:
        scenario(group, other)
    except (CollectiveMismatchError, CollectiveTimeoutError) as err:
        print(f"[rank {RANK}] {type(err).__name__}: {err}", flush=True)
        # The first rank to re-raise aborts the job (and a launcher may kill the others):
        # every rank says its error first.
        meet(ending, MEET_SECONDS)
        raise
    print(f"[rank {RANK}] completed", flush=True)


if __name__ == "__main__":
    main()
