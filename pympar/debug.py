"""Debug mode, the watchdog and the mismatch report of pympar collectives.

Ranks whose calls differ raise :class:`CollectiveMismatchError` on every rank, naming each
rank's call (:func:`report`). Two settings, alike on every rank, go further
(:func:`debug_mode` sets both for a ``with`` block):

``PYMPAR_DEBUG=1`` (or :func:`enable`)
    The report names where each rank made its call; an uncaught error shows its traceback.
``PYMPAR_TIMEOUT=seconds`` (:func:`set_timeout`; :data:`DEFAULT_TIMEOUT` if unset, 0: never)
    Every wait for other ranks to arrive (not the data call: every rank passed its check)
    raises :class:`CollectiveTimeoutError` after it, naming the ranks missing within a node.
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
    if value in ("none", "off"):
        return None
    try:
        return _check_timeout(float(value)) if value else DEFAULT_TIMEOUT
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
    """Set debug mode (``enabled``) and, when given, the timeout inside a ``with`` block."""
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


# Separates a call's subject from this rank's detail in ``report``'s ``shown``
# (``"Layer.forward" + _DETAIL + "input (32, 16) float32"``): when every rank's subject is
# the same the report names it once and lists only the details.
_DETAIL = "\x1f"
# What a refusing rank's call says (pympar._agreement.refuse, Module.agreement).
_REFUSED = "refused by this rank"


def report(group: Any, shown: str, hint: str = "") -> None:
    """Raise :class:`CollectiveMismatchError` naming every rank's call ``shown`` (in debug mode
    with where it was made): every rank of ``group`` calls it once their check failed, and
    raises the same one-line error, each distinct call once with the ranks that made it.

    ``shown`` may be ``subject + "\\x1f" + detail``: when every rank names the same subject it
    is said once, then each rank's detail and ``hint`` (what must hold, alike on every rank).
    """
    if _enabled:
        shown = f"{shown} at {_call_site()}"
    data = shown.encode("utf-8", "replace")[:SLOT_BYTES]
    mine = np.zeros(SLOT_BYTES, np.uint8)
    mine[:len(data)] = np.frombuffer(data, np.uint8)
    table = np.empty((group.size, SLOT_BYTES), np.uint8)
    wait(group.comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE]),
         f"the mismatch report of {shown.replace(_DETAIL, ' with ')}", group, _timeout)
    calls = [row.tobytes().rstrip(b"\0").decode("utf-8", "replace") for row in table]
    ranks_of: dict[str, list[int]] = {}
    for r, call in enumerate(calls):
        ranks_of.setdefault(call, []).append(r)
    subjects = {call.partition(_DETAIL)[0] for call in ranks_of}
    same = len(subjects) == 1 and _DETAIL in calls[0]
    listing = "; ".join(
        f"{where(group, *ranks)}: "
        f"{call.partition(_DETAIL)[2] if same else call.replace(_DETAIL, ' with ')}"
        for call, ranks in list(ranks_of.items())[:_SHOWN_RANKS])
    if len(ranks_of) > _SHOWN_RANKS:
        listing += f"; ... ({len(ranks_of) - _SHOWN_RANKS} more distinct calls)"
    if any(_REFUSED in call for call in ranks_of):
        hint = "every rank raises: fix the input that a rank refused"
    must = hint or ("every rank must pass the same" if same else "every rank of the group "
                    "must make the same call (operation, dtype, extents, label) in the same order")
    subject = subjects.pop() if same else "a collective"
    raise CollectiveMismatchError(
        f"ranks of group {group.name!r} disagree on {subject}: {listing}; {must}")
