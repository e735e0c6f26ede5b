"""The errors of pympar's collectives and the timed wait that raises one.

Both errors are raised the same way on every rank (a mismatch is seen by every rank of
the check, see :mod:`pympar._agreement`); a timeout is raised by the rank that waited.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from mpi4py import MPI

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "wait", "timeout_error", "where"]


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives, or with different arguments."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout on this rank.

    Attributes
    ----------
    request : mpi4py.MPI.Request or None
        The still pending operation. It completes if the missing ranks join later
        (``request.Wait()``); until then the group must not be used. None when the wait
        was the shared-memory agreement check (nothing is pending in MPI then).
    """

    request: MPI.Request | None = None


def where(group: Any, rank: int) -> str:
    """Rank ``rank`` of ``group`` in words, with its global rank."""
    return f"rank {rank} (global {group.ranks[rank]})"


def timeout_error(operation: str, group: Any, timeout: float,
                  request: MPI.Request | None) -> CollectiveTimeoutError:
    """The error of ``operation`` (in words) on ``group`` still pending after ``timeout``
    seconds; ``request`` is the pending operation (None for the shared-memory check)."""
    error = CollectiveTimeoutError(
        f"{operation} on group {group.name!r} did not complete within {timeout:g} s "
        f"on {where(group, group.rank)} of {group.size}: another rank of the group "
        f"has not reached it (skipped it, called a different collective, or is "
        f"stuck); the group's communicator is no longer usable")
    error.request = request
    return error


def wait(request: MPI.Request, operation: str, group: Any, timeout: float | None,
         error: Callable[..., CollectiveTimeoutError] = timeout_error) -> None:
    """Complete ``request``: at once without a timeout, else polled for ``timeout`` seconds,
    then raise ``error(operation, group, timeout, request)`` (the request stays pending)."""
    if timeout is None:
        request.Wait()
        return
    deadline, delay = time.monotonic() + timeout, 1e-5
    while not request.Test():
        if time.monotonic() >= deadline:
            raise error(operation, group, timeout, request)
        # Back off from 10 us to 1 ms: short calls finish with little added latency,
        # long ones do not burn a core another rank may need.
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
