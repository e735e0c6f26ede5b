"""Assertions that every rank reaches together, so one rank's failure fails all.

A plain ``assert`` that fails on one rank lets the other ranks walk on into the
next collective and hang. These helpers gather every rank's verdict first and
raise the same ``AssertionError`` on every rank.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def to_numpy(x: Any) -> np.ndarray:
    """Host copy of a NumPy or CuPy array."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def agree(ok: bool, message: str = "", comm: MPI.Comm = WORLD) -> None:
    """Raise on every rank when ``ok`` is False on any rank."""
    verdicts = comm.allgather((bool(ok), str(message)))
    bad = [f"rank {rank}: {msg}" for rank, (good, msg) in enumerate(verdicts) if not good]
    if bad:
        raise AssertionError("; ".join(bad))


def assert_close(actual: Any, expected: Any, rtol: float = 1e-12, atol: float = 1e-12,
                 what: str = "", comm: MPI.Comm = WORLD) -> None:
    """Collective ``numpy.testing.assert_allclose`` (shape and dtype-agnostic values)."""
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        agree(False, f"{what}: shape {a.shape} != expected {e.shape}", comm)
        return
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    ok = np.allclose(a64, e64, rtol=rtol, atol=atol)
    err = float(np.max(np.abs(a64 - e64))) if a.size else 0.0
    agree(ok, f"{what}: max abs error {err:.3g} (rtol={rtol}, atol={atol})", comm)


def assert_equal(actual: Any, expected: Any, what: str = "", comm: MPI.Comm = WORLD) -> None:
    """Collective exact equality of values and shapes (bitwise for arrays)."""
    a, e = to_numpy(actual), to_numpy(expected)
    ok = a.shape == e.shape and a.dtype == e.dtype and a.tobytes() == e.tobytes()
    agree(ok, f"{what}: {a!r} != {e!r}" if a.size < 64 else f"{what}: arrays differ", comm)


def raises_everywhere(error: type[BaseException], match: str, func: Callable[..., Any],
                      *args: Any, comm: MPI.Comm = WORLD, **kwargs: Any) -> BaseException:
    """Call ``func`` and check that it raised ``error`` matching ``match`` on every rank."""
    caught: BaseException | None = None
    try:
        func(*args, **kwargs)
    except BaseException as err:  # noqa: BLE001 - the test inspects whatever was raised
        caught = err
    ok = isinstance(caught, error) and re.search(match, str(caught)) is not None
    agree(ok, f"expected {error.__name__} matching {match!r}, got {caught!r}", comm)
    assert caught is not None
    return caught
