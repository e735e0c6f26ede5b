"""Debug mode and the watchdog of pympar collectives.

Every collective checks, cheaply, that every rank makes the same call
(:mod:`pympar.collectives`); ranks that differ raise :class:`CollectiveMismatchError` on
every rank, naming each rank's call. Two settings, read once at import and alike on every
rank (compared when a mesh or group is made), go further; :func:`debug_mode` sets both
for a ``with`` block.

``PYMPAR_DEBUG=1`` (or :func:`enable`)
    The report also names where each rank made its call (the first frame outside pympar,
    ``file:line in function``), and an uncaught error shows its traceback. Free until then.

``PYMPAR_TIMEOUT=seconds`` (:func:`set_timeout`; :data:`DEFAULT_TIMEOUT` if unset, 0: never)
    The watchdog: every wait for other ranks to arrive (the agreement check, the exchanges
    after it, the settings agreement, the end of the program) raises
    :class:`CollectiveTimeoutError` after it, naming the operation, the group and (within
    a node) the ranks that did not arrive. The data call stays blocking: it starts only
    once every rank passed the same check.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import numpy as np
from mpi4py import MPI

from .errors import CollectiveMismatchError, CollectiveTimeoutError, wait, where

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "enable", "disable", "is_enabled",
           "set_timeout", "get_timeout", "debug_mode", "report", "DEFAULT_TIMEOUT"]

#: The watchdog's timeout in seconds without ``PYMPAR_TIMEOUT`` (NCCL's default in torch).
DEFAULT_TIMEOUT = 600.0

#: Bytes per rank of the mismatch report (fixed, so a timed Iallgather can carry it).
SLOT_BYTES = 1024
_SHOWN_RANKS = 16
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _parse_flag(value: str) -> bool:
    value = value.strip().lower()
    if value not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ValueError(f"PYMPAR_DEBUG must be 0 or 1, not {value!r}")
    return value in ("1", "true", "yes", "on")


def _check_timeout(seconds: float | None) -> float | None:
    if seconds is None or seconds == 0:
        return None
    seconds = float(seconds)
    if not seconds > 0:  # also rejects NaN
        raise ValueError(f"a collective timeout must be >= 0 s (0, None: never), got {seconds!r}")
    return seconds


def _parse_timeout(value: str) -> float | None:
    value = value.strip().lower()
    if value == "":
        return DEFAULT_TIMEOUT
    if value in ("none", "off"):
        return None
    try:
        return _check_timeout(float(value))
    except ValueError:
        raise ValueError(f"PYMPAR_TIMEOUT must be a number of seconds > 0, "
                         f"or 0 (never), not {value!r}") from None


_enabled: bool = _parse_flag(os.environ.get("PYMPAR_DEBUG", ""))
_timeout: float | None = _parse_timeout(os.environ.get("PYMPAR_TIMEOUT", ""))


def enable() -> None:
    """Turn debug mode on: mismatch reports name where each rank made its call."""
    global _enabled
    _enabled = True


def disable() -> None:
    """Turn debug mode off."""
    global _enabled
    _enabled = False


def is_enabled() -> bool:
    """Return whether debug mode is on."""
    return _enabled


def set_timeout(seconds: float | None) -> None:
    """Set the watchdog's timeout in seconds (``0`` or ``None``: never), alike on every rank
    (compared when a mesh or group is made)."""
    global _timeout
    _timeout = _check_timeout(seconds)


def get_timeout() -> float | None:
    """Return the watchdog's timeout in seconds, or ``None`` when off."""
    return _timeout


_KEEP: Any = object()


@contextlib.contextmanager
def debug_mode(enabled: bool = True, timeout: float | None = _KEEP) -> Iterator[None]:
    """Set debug mode (``enabled``) and, when given, the timeout inside a ``with`` block.

    Examples
    --------
    >>> with debug_mode(timeout=30.0):
    ...     pass
    """
    global _enabled, _timeout
    saved = (_enabled, _timeout)
    try:
        _enabled = bool(enabled)
        if timeout is not _KEEP:
            set_timeout(timeout)
        yield
    finally:
        _enabled, _timeout = saved


def _call_site() -> str:
    """Where the program called into pympar: the innermost frame outside the package."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def report(group: Any, shown: str) -> None:
    """Raise :class:`CollectiveMismatchError` naming every rank's call ``shown`` (with, in
    debug mode, where it was made); collective: every rank of ``group`` calls it once the
    agreement check found that their calls differ, so every rank raises the same error."""
    if _enabled:
        shown = f"{shown} at {_call_site()}"
    data = shown.encode("utf-8", "replace")[:SLOT_BYTES]
    mine = np.zeros(SLOT_BYTES, np.uint8)
    mine[:len(data)] = np.frombuffer(data, np.uint8)
    table = np.empty((group.size, SLOT_BYTES), np.uint8)
    wait(group.comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE]),
         f"the mismatch report of {shown}", group, _timeout)
    calls = [row.tobytes().rstrip(b"\0").decode("utf-8", "replace") for row in table]
    differ = [r for r, call in enumerate(calls) if call != calls[0]]
    shown_ranks = [0] + differ[:_SHOWN_RANKS]
    listing = "; ".join(f"{where(group, r)}: {calls[r]}" for r in shown_ranks)
    if len(differ) > _SHOWN_RANKS:
        listing += f"; ... ({len(differ) - _SHOWN_RANKS} more ranks differ)"
    raise CollectiveMismatchError(
        f"ranks of group {group.name!r} disagree on a collective (this is "
        f"{where(group, group.rank)}, calling {shown}); ranks {differ} differ from rank 0. "
        f"Calls: {listing}")
