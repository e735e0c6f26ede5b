"""Debug mode and timeouts for pympar collectives.

Without either switch, collectives already check, cheaply, that every rank makes the same
call (every call by default, see :data:`pympar.collectives.CHECK_BYTES` and
:mod:`pympar.collectives`).
Two independent switches, both off by default and both read once at import, go further:

``PYMPAR_DEBUG=1`` (or :func:`enable`)
    Before every collective and every mapping, the ranks of the group exchange
    a short description of the call (operation, shape, dtype, axis, ...). When
    the descriptions disagree every rank raises :class:`CollectiveMismatchError`
    naming the operation, the group and what each rank passed, instead of
    deadlocking or silently mixing up data. This costs one small allgather per
    call.

``PYMPAR_TIMEOUT=seconds`` (or :func:`set_timeout`)
    Collectives run as their non-blocking variants and are polled until done;
    one that is not complete in time raises :class:`CollectiveTimeoutError`
    naming the operation, the group and the rank. Every call is then checked for
    agreement, whatever its size. Every rank of a group must
    use the same setting: MPI never matches a non-blocking collective with a
    blocking one. After a timeout the group's communicator has a pending
    operation and cannot be used again; the error is meant to end the run
    (under ``python -m mpi4py`` an unhandled exception aborts every rank).

:func:`debug_mode` sets both for a ``with`` block. When both are off each
collective pays one branch (a module flag it also uses for statistics).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np
from mpi4py import MPI

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "enable",
    "disable",
    "is_enabled",
    "set_timeout",
    "get_timeout",
    "debug_mode",
    "check",
    "verify",
    "describe",
    "check_mapping",
    "parse_bytes",
    "wait",
    "timeout_error",
]

#: Bytes per rank in the signature exchange (fixed, so a timed, non-blocking
#: Iallgather can carry it).
SLOT_BYTES = 1024
_KEY_MAX = 256
_SHOWN_RANKS = 16
_SEPARATOR = "\x1f"


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives, or with different arguments."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout on this rank.

    Attributes
    ----------
    request : mpi4py.MPI.Request or None
        The still pending operation. It completes if the missing ranks join
        later (``request.Wait()``); until then the group must not be used. None when
        the wait was the shared-memory agreement check of a group on one node
        (nothing is pending in MPI then).
    """

    request: MPI.Request | None = None


def _parse_flag(value: str) -> bool:
    value = value.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"PYMPAR_DEBUG must be 0 or 1, not {value!r}")


def _check_timeout(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    seconds = float(seconds)
    if not seconds > 0:  # also rejects NaN
        raise ValueError(f"a collective timeout must be > 0 seconds (or None), got {seconds!r}")
    return seconds


def _parse_timeout(value: str) -> float | None:
    value = value.strip().lower()
    if value in ("", "0", "none", "off"):
        return None
    try:
        return _check_timeout(float(value))
    except ValueError:
        raise ValueError(f"PYMPAR_TIMEOUT must be a number of seconds > 0, "
                         f"not {value!r}") from None


def parse_bytes(variable: str, default: str) -> int:
    """Read a byte count >= 0 from the environment ``variable`` (``default`` when unset).

    Raises
    ------
    ValueError
        When the value is not a whole number >= 0.
    """
    value = os.environ.get(variable, default).strip() or default
    if not value.isdigit():
        raise ValueError(f"{variable} must be a number of bytes >= 0, not {value!r}")
    return int(value)


_enabled: bool = _parse_flag(os.environ.get("PYMPAR_DEBUG", ""))
_timeout: float | None = _parse_timeout(os.environ.get("PYMPAR_TIMEOUT", ""))

#: Called with no argument whenever a switch changes (the collectives keep one
#: combined flag so that their fast path has a single branch).
_listeners: list[Callable[[], None]] = []


def _notify() -> None:
    for listener in _listeners:
        listener()


def enable() -> None:
    """Turn debug mode on: every collective first compares its call across the group.

    Every rank of a group must have the same setting, or the comparison itself
    is a collective that only some ranks join.
    """
    global _enabled
    _enabled = True
    _notify()


def disable() -> None:
    """Turn debug mode off."""
    global _enabled
    _enabled = False
    _notify()


def is_enabled() -> bool:
    """Return whether debug mode is on."""
    return _enabled


def set_timeout(seconds: float | None) -> None:
    """Set the collective timeout in seconds; ``None`` turns it off.

    Set it alike on every rank of a group (timed collectives are MPI's
    non-blocking variants, which never match the blocking ones).

    Raises
    ------
    ValueError
        When ``seconds`` is not ``None`` and not > 0.
    """
    global _timeout
    _timeout = _check_timeout(seconds)
    _notify()


def get_timeout() -> float | None:
    """Return the collective timeout in seconds, or ``None`` when off."""
    return _timeout


_KEEP: Any = object()


@contextlib.contextmanager
def debug_mode(enabled: bool = True, timeout: float | None = _KEEP) -> Iterator[None]:
    """Set debug mode (and optionally the timeout) inside a ``with`` block.

    Parameters
    ----------
    enabled : bool, default True
        Debug mode inside the block.
    timeout : float or None, optional
        Timeout inside the block; unchanged when not given.

    Examples
    --------
    >>> with debug_mode(timeout=30.0):
    ...     pass
    """
    global _enabled, _timeout
    saved = (_enabled, _timeout)
    try:
        (enable if enabled else disable)()
        if timeout is not _KEEP:
            set_timeout(timeout)
        yield
    finally:
        _enabled, _timeout = saved
        _notify()


def _where(group: Any, rank: int) -> str:
    return f"rank {rank} (global {group.ranks[rank]})"


def wait(request: MPI.Request, operation: str, group: Any, timeout: float,
         start: float) -> None:
    """Poll ``request`` until it completes or ``timeout`` seconds after ``start`` pass.

    Parameters
    ----------
    request : mpi4py.MPI.Request
        A started non-blocking collective.
    operation : str
        Its name, for the error message.
    group : Group
        The group it runs on.
    timeout : float
        Seconds allowed.
    start : float
        ``time.monotonic()`` when the operation began.

    Raises
    ------
    CollectiveTimeoutError
        When the request is still pending at the deadline. It stays pending:
        the group cannot be used again.
    """
    if request.Test():
        return
    deadline = start + timeout
    delay = 1e-5
    while True:
        # Back off from 10 us to 1 ms: short collectives finish with little added
        # latency, long ones do not burn a core another rank may need.
        time.sleep(delay)
        if request.Test():
            return
        if time.monotonic() >= deadline:
            raise timeout_error(operation, group, timeout, request)
        delay = min(2 * delay, 1e-3)


def timeout_error(operation: str, group: Any, timeout: float,
                  request: MPI.Request | None) -> CollectiveTimeoutError:
    """The error of a collective ``operation`` on ``group`` still pending after ``timeout`` s.

    Parameters
    ----------
    operation : str
        The call in words.
    group : Group
        The group it runs on.
    timeout : float
        Seconds allowed.
    request : mpi4py.MPI.Request or None
        The pending operation (None for the shared-memory agreement check).
    """
    error = CollectiveTimeoutError(
        f"{operation} on group {group.name!r} did not complete within {timeout:g} s "
        f"on {_where(group, group.rank)} of {group.size}: another rank of the group "
        f"has not reached it (skipped it, called a different collective, or is "
        f"stuck); the group's communicator is no longer usable")
    error.request = request
    return error


def _encode(signature: tuple, display: str) -> np.ndarray:
    key = repr(signature)
    if len(key) > _KEY_MAX:
        # The comparison needs equality only; a digest keeps it within the slot.
        key = "sha1:" + hashlib.sha1(key.encode()).hexdigest()
    data = (key + _SEPARATOR + display).encode("utf-8", "replace")[:SLOT_BYTES]
    buffer = np.zeros(SLOT_BYTES, np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    return buffer


def _decode(row: np.ndarray) -> tuple[str, str]:
    text = row.tobytes().rstrip(b"\0").decode("utf-8", "replace")
    key, _, display = text.partition(_SEPARATOR)
    return key, display


def check(group: Any, signature: tuple, display: str, timeout: float | None = None) -> None:
    """Compare this rank's ``signature`` with every other rank of ``group``.

    Collective over the group. Every rank receives every description, so every
    rank raises the same error.

    Parameters
    ----------
    group : Group
        The group the call is about to run on.
    signature : tuple
        What must be equal on every rank (operation, shape with any per-rank
        extent masked, dtype, axis, ...); compared through its ``repr``.
    display : str
        What this rank passed, in words, for the error message.
    timeout : float, optional
        Poll the exchange and raise :class:`CollectiveTimeoutError` after this
        many seconds (a rank that skips the call never joins the exchange).

    Raises
    ------
    CollectiveMismatchError
        On every rank, when any two ranks' signatures differ.
    """
    mine = _encode(signature, display)
    table = np.empty((group.size, SLOT_BYTES), np.uint8)
    if timeout is None:
        group.comm.Allgather([mine, MPI.BYTE], [table, MPI.BYTE])
    else:
        start = time.monotonic()
        wait(group.comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE]),
             f"debug check before {display}", group, timeout, start)
    rows = [_decode(row) for row in table]
    reference = rows[0][0]
    differ = [r for r, (key, _) in enumerate(rows) if key != reference]
    if not differ:
        return
    # Rank 0 and the ranks that differ from it; in a large group, the first few.
    shown_ranks = [0] + differ[:_SHOWN_RANKS]
    calls = "; ".join(f"{_where(group, r)}: {rows[r][1]}" for r in shown_ranks)
    if len(differ) > _SHOWN_RANKS:
        calls += f"; ... ({len(differ) - _SHOWN_RANKS} more ranks differ)"
    raise CollectiveMismatchError(
        f"ranks of group {group.name!r} disagree on a collective (this is "
        f"{_where(group, group.rank)}, calling {display}); ranks {differ} differ from "
        f"rank 0. Calls: {calls}")


def describe(call: str, label: str | None) -> str:
    """A call in words for error messages: ``call`` plus the label it ran under, if any."""
    return f"{call} in {label}" if label else call


def verify(group: Any, signature: tuple, display: str, out: Any, x: Any) -> None:
    """The full debug-mode check of a collective: :func:`check`, plus an overlapping ``out``.

    Whether ``out`` overlaps the input is a fact only this rank can see; it goes into the
    compared signature, so that a rank about to refuse it makes every rank raise instead
    of leaving the others waiting.

    Parameters
    ----------
    group : Group
        The group the call is about to run on.
    signature : tuple
        What must be equal on every rank.
    display : str
        The call in words (:func:`describe`).
    out, x : array or None
        The call's ``out`` and input.

    Raises
    ------
    CollectiveMismatchError
        On every rank, when the ranks' signatures differ.
    ValueError
        When ``out`` overlaps ``x`` without being ``x``.
    """
    overlap = (out is not None and out is not x and type(out) is type(x)
               and bool(sys.modules[type(x).__module__.split(".")[0]].may_share_memory(out, x)))
    check(group, (signature, overlap), f"{display}, out overlaps input: {overlap}", _timeout)
    if overlap:
        raise ValueError(f"{display} on group {group.name!r}: out overlaps the input without "
                         f"being the input itself")


def check_mapping(group: Any, name: str, x: Any, options: dict[str, Any]) -> None:
    """Compare the mapping every rank of ``group`` calls, before its step runs.

    Parameters
    ----------
    group : Group
        The mapping's group.
    name : str
        The mapping and direction, e.g. ``"copy_to_all.forward"``.
    x : array or any
        The mapping's input (its dtype and number of dimensions are compared; anything
        that is not an array is compared by its type).
    options : dict
        Its keywords (``global_size``, ``seq_axis``, ...); None values are left out.

    Raises
    ------
    CollectiveMismatchError
        On every rank, when two ranks call different mappings or pass different options.
    """
    given = tuple(sorted((k, v) for k, v in options.items() if v is not None))
    shown = "".join(f", {k}={v!r}" for k, v in given)
    # Compared before the input is validated, so that a rank passing a list meets the
    # others here (and every rank raises) instead of leaving them waiting.
    dtype = str(getattr(x, "dtype", f"not an array: {type(x).__name__}"))
    check(group, ("mapping", name, dtype, getattr(x, "ndim", None), repr(given)),
          f"{name}(shape={getattr(x, 'shape', '?')}, dtype={dtype}{shown})", _timeout)
