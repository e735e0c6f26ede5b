"""A halo exchange's agreement, with its neighbours only, and what a failure tells them
(private to :mod:`pympar.halo`).

Each call checks along each exchanged axis with the neighbours there
(:class:`~pympar._neighbours.NeighbourBoard`); a rank whose check failed on one axis refuses
on the later ones, so the failure spreads along every axis of its neighbourhood. The ranks of
a pair that differ raise :class:`~pympar.errors.CollectiveMismatchError` and exchange nothing
with each other.

A rank that raises may still owe faces to neighbours that agreed with it and are about to
exchange, and those owe it theirs. It *poisons* them instead: it receives their faces into
scratch and sends each an empty message where a face was due. The receive completes, with
fewer elements than its face, which the exchange reads in the receive's status
(:class:`~pympar._halo_plan.Receipt`): a message shorter than the receive is valid MPI,
where a longer one (``MPI_ERR_TRUNCATE``) is an error whose handling MPIs differ on (Open
MPI 4.1 completes a persistent receive in error silently in ``Testall``, and its
``Waitall`` may never return). A rank whose exchange meets a short face poisons its own
remaining messages in the same way and raises :class:`~pympar.errors.PeerEndedError`: its
ghosts are incomplete. An empty face (a zero width) cannot tell poison from data, and needs
no telling: nothing was due there. So no rank waits for a
face that does not come, and no rank keeps ghosts that a failure left wrong; a rank that
finished its messages before any poison reached it got only good faces.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from . import debug
from ._board import REFUSED
from ._comm_state import freed_error
from ._halo_plan import DOWN, UP, Axis, Plan, count
from ._neighbours import REPORT_TAG
from .errors import CollectiveMismatchError, PeerEndedError, wait, where, yield_core

__all__ = ["check", "units", "poisoned", "settle", "Poison"]


class Poison(Exception):
    """A face came short: the neighbour that owed it failed and sent poison instead."""

_REPORT_BYTES = 512
_EMPTY = np.zeros(1, np.uint8)  # the buffer of the empty messages sent as poison


def check(checks: list, sig: int, shown: str, name: str | None, plan: Plan | None,
          direction: str, error: Exception | None = None, first: list | None = None) -> None:
    """The call's check with the neighbours along each axis of ``checks`` (``(axis, group,
    board)``, in axis order): returns when every neighbour agrees; else poisons the
    neighbours that agreed (when this rank has a ``plan``) and raises the mismatch, or
    ``error``, this rank's own refusal of its input. ``first``: the neighbours that differ
    in the first axis's check, already made."""
    failure, agreed = error, {}
    for axis, group, board in checks:
        if group._state.board is None:
            raise freed_error(shown, group)
        mine = REFUSED if failure is not None else sig
        if first is not None:
            differ, first = first, None
        else:
            differ = board.agree(mine, group, shown, debug._timeout)
        if differ:
            said = shown if failure is None else f"{shown}, refused by this rank: {failure}"
            report = _report(group, differ, said, name)
            failure = failure or report
        if mine != REFUSED:
            agreed[axis] = set(board.neighbours) - set(differ)
    if failure is None:
        return
    if plan is not None and any(agreed.values()):
        _poison(plan, [(ax, tag, kind) for ax, tag in units(plan, direction)
                       for kind in ("send", "recv")
                       if _peer(ax, tag, kind) in agreed.get(ax.axis, ())])
    raise failure


def units(plan: Plan, direction: str) -> list[tuple[Axis, int]]:
    """The messages of a call in the order it makes them: per axis a face sent to ``dest``
    while one comes from ``source`` (tag ``UP``: to the upper neighbour, from the lower)."""
    if direction in ("exchange", "forward"):
        return [(ax, tag) for ax in plan.axes if ax.comm is not None for tag in (UP, DOWN)]
    return [(ax, tag) for ax in reversed(plan.axes) if ax.comm is not None
            for tag in (DOWN, UP)]


def poisoned(plan: Plan, direction: str, done: int, error: Exception,
             started: list[MPI.Request]) -> None:
    """After a short face (a neighbour's poison) or an MPI error in message unit ``done - 1``
    of the call, whose requests are ``started``: complete those (an MPI may return from the
    wait at the first error), poison every later unit, then raise
    :class:`~pympar.errors.PeerEndedError`."""
    settle(started)
    later = units(plan, direction)[done:]
    _poison(plan, [(ax, tag, kind) for ax, tag in later for kind in ("send", "recv")])
    raise PeerEndedError(
        f"{plan.shown}: a neighbour raised in this exchange instead of sending its face (its "
        f"own error says why), so this rank's ghosts are incomplete ({error})")


def _peer(ax: Axis, tag: int, kind: str) -> int:
    """Whom a unit's send goes to, or its receive comes from."""
    return (ax.upper if (tag == UP) == (kind == "send") else ax.lower)


def _poison(plan: Plan, messages: list[tuple[Axis, int, str]]) -> None:
    """Post ``messages`` (each a unit's send or receive) as poison, and complete them: an
    empty message for each send, scratch for each receive."""
    requests, scratch = [], []
    for ax, tag, kind in messages:
        peer = _peer(ax, tag, kind)
        if peer == MPI.PROC_NULL:
            continue
        if kind == "send":
            requests.append(ax.comm.Isend([_EMPTY, 0, plan.mpi_type], peer, tag))
            continue
        # As large as any face of the axis, either way.
        n = max(count(getattr(ax, name), plan.shape)
                for name in ("send_up", "send_down", "recv_lo", "recv_hi"))
        buf = np.zeros(n * plan.mpi_type.Get_size(), np.uint8)
        scratch.append(buf)
        requests.append(ax.comm.Irecv([buf, n, plan.mpi_type], peer, tag))
    settle(requests)


def settle(requests: list[MPI.Request]) -> None:
    """Complete ``requests`` whatever errors they end in (a neighbour that failed too sends
    poison here as well); give up after the watchdog's timeout (this rank raises anyway)."""
    timeout = debug._timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(requests)
    while pending:
        for request in list(pending):
            try:
                done = request.Test()
            except MPI.Exception:
                done = True
            if done:
                pending.remove(request)
        if pending:
            if deadline is not None and time.monotonic() >= deadline:
                return
            yield_core()


def _report(group: Any, differ: list[int], said: str, name: str | None) -> CollectiveMismatchError:
    """The mismatch with the neighbours ``differ`` (each sends this rank its call in words,
    as this rank sends its own: a pair that differs sees it on both sides)."""
    mine = np.zeros(_REPORT_BYTES, np.uint8)
    data = (f"{said} in {name}" if name else said).encode("utf-8", "replace")[:_REPORT_BYTES]
    mine[:len(data)] = np.frombuffer(data, np.uint8)
    theirs = [np.zeros(_REPORT_BYTES, np.uint8) for _ in differ]
    requests = [group.comm.Irecv(buf, r, REPORT_TAG) for buf, r in zip(theirs, differ)]
    requests += [group.comm.Isend(mine, r, REPORT_TAG) for r in differ]
    wait(requests, f"the mismatch report of {said}", group, debug._timeout)
    calls = [(group.rank, data.decode("utf-8", "replace"))] + [
        (r, buf.tobytes().rstrip(b"\0").decode("utf-8", "replace"))
        for r, buf in zip(differ, theirs)]
    listing = "; ".join(f"{where(group, r)}: {call}" for r, call in sorted(calls))
    return CollectiveMismatchError(
        f"neighbours in a halo exchange on group {group.name!r} disagree: {listing}; "
        f"neighbours must make the same call (operation, leading shape, dtype, label), and "
        f"the ranks beyond them learn of it from their neighbours (PeerEndedError)")
