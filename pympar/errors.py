"""The errors of pympar's collectives and the timed wait that raises one.

A timeout is raised by the rank that waited; a mismatch alike on every rank of the check,
as is every exception whose ``raised_alike`` attribute is true (of its class or instance):
uncaught, such an error is printed once, as one line (:mod:`pympar.faults`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from mpi4py import MPI

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "PeerEndedError", "wait",
           "timeout_error", "ended_error", "where", "yield_core", "doze"]

#: Give the core to another runnable process (time.sleep(0) where the OS has no sched_yield).
yield_core = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
#: Polls a waiting rank makes in a tight spin before it starts to yield its core: a short
#: call completes within them, as fast as a blocking wait. 1 once :func:`share_cores` has
#: been called: where ranks outnumber cores, the rank waited for may need this rank's core,
#: and every poll that does not yield it delays that rank (4 ranks on 2 cores across two
#: nodes: a check of 45 us took 200 us when both node leaders shared a core).
SPINS = 200


def share_cores() -> None:
    """Make every later wait of this process yield its core from its first poll."""
    global SPINS
    SPINS = 1


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives, or with different arguments."""

    raised_alike = True


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout on this rank.

    Attributes
    ----------
    request : mpi4py.MPI.Request, list of them, or None
        The still pending operation. It completes if the missing ranks join later
        (``request.Wait()``, or ``MPI.Request.Waitall(request)`` for a list: the words a
        node's leader sends each other leader); until then the group must not be used. None
        when the wait was in shared memory (nothing is pending in MPI then).
    """

    request: MPI.Request | list[MPI.Request] | None = None


class PeerEndedError(CollectiveTimeoutError):
    """A rank this one waits for in a collective has ended (returned, ``sys.exit``, error)."""


def where(group: Any, *ranks: int) -> str:
    """Ranks of ``group`` in words: ``"rank 1 (global 5)"``, ``"ranks 0, 2-3 (global 4, 6-7)"``."""
    def spans(v: list[int]) -> str:  # [0, 2, 3] -> "0, 2-3"
        starts = [i for i in range(len(v)) if i == 0 or v[i - 1] != v[i] - 1]
        return ", ".join(str(v[a]) if a == b - 1 else f"{v[a]}-{v[b - 1]}"
                         for a, b in zip(starts, starts[1:] + [len(v)]))

    s = "s" if len(ranks) > 1 else ""
    return f"rank{s} {spans(list(ranks))} (global {spans([group.ranks[r] for r in ranks])})"


def ended_error(operation: str, group: Any, ranks: list[int]) -> PeerEndedError:
    """The error of ``operation`` on ``group`` whose group ranks ``ranks`` have ended."""
    return PeerEndedError(
        f"{operation} on group {group.name!r}: {where(group, *ranks)} ended the program "
        f"(returned, sys.exit or an error) while {where(group, group.rank)} waits for it there")


def timeout_error(operation: str, group: Any, timeout: float, request: MPI.Request | None,
                  missing: list[int] | None = None,
                  across: bool = False) -> CollectiveTimeoutError:
    """The error of ``operation`` on ``group`` still pending after ``timeout`` s (``request``;
    ``missing``: the group ranks that did not arrive, None when unknown; ``across``: they
    are the leaders of other nodes, which wait for their node's ranks)."""
    who = (f"{where(group, *missing)}"
           f"{', or a rank of its node,' if across and len(missing) == 1 else ''}"
           f"{', or ranks of their nodes,' if across and len(missing) > 1 else ''}"
           f" did not arrive" if missing else
           "another rank of the group has not reached it (a group across nodes cannot tell which)")
    error = CollectiveTimeoutError(
        f"{operation} on group {group.name!r} did not complete within {timeout:g} s "
        f"on {where(group, group.rank)} of {group.size}: {who} (it skipped the call, called "
        f"a different collective, or is stuck); the group's communicator is no longer usable")
    error.request = request
    return error


def doze(delay: float, waited: float) -> float:
    """Sleep ``delay`` s between two polls of a wait that has lasted ``waited`` s, and return
    the next sleep: doubling, at most 1 ms and at most 1 % of the time waited, so that waking
    up after the message came adds at most about 1 % to any wait (a pipeline stage waits
    for its neighbour's whole micro-batch, many times a step)."""
    time.sleep(delay)
    return min(2 * delay, 1e-3, max(1e-5, 0.01 * waited))


def wait(request: MPI.Request | list[MPI.Request], operation: str, group: Any,
         timeout: float | None,
         error: Callable[..., CollectiveTimeoutError] = timeout_error) -> None:
    """Complete ``request`` (or every request of a list): at once without a timeout, else
    polled for ``timeout`` seconds, then raise ``error(operation, group, timeout, request)``
    (the request stays pending).

    The poll spins, then yields the core between tests (a rank it waits for may need that
    core: ranks sharing cores), then after 10 ms sleeps between them (:func:`doze`), so
    that a long wait does not burn a core."""
    several = isinstance(request, list)
    if timeout is None:
        MPI.Request.Waitall(request) if several else request.Wait()
        return
    test = (lambda: MPI.Request.Testall(request)) if several else request.Test
    for _ in range(SPINS):  # a short call completes here, as fast as Wait()
        if test():
            return
    now = time.monotonic
    start = now()
    deadline, yielding, delay = start + timeout, start + 0.01, 1e-5
    while not test():
        t = now()
        if t >= deadline:
            raise error(operation, group, timeout, request)
        if t < yielding:
            yield_core()
        else:
            delay = doze(delay, t - start)
