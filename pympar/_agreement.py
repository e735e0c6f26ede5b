"""The agreement check, one per collective call, and the label it compares (private).

Every collective of more than one rank writes its signature (its key and :func:`label`
hashed) to the group's board (:mod:`pympar._board`) and reads every rank's; when they
differ every rank raises (:func:`pympar.debug.report`). A rank refusing its arguments
joins with :data:`~pympar._board.REFUSED` (:func:`refuse`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from mpi4py import MPI

from . import debug
from ._board import REFUSED
from ._comm_state import freed_error
from ._plans import signature
from .errors import CollectiveMismatchError, wait, where

# The label of the code running collectives (see label()), and those it is nested in.
_label: str | None = None
_outer: list[str | None] = []


def label(name: str) -> Label:
    """Name the collectives called inside a ``with`` block (or a decorated function).

    ``name`` (``"bucket-0.step"``) appears in statistics (``"bucket-0.step:all_gather"``)
    and errors, and is part of the agreement check: ranks running the same collective
    under different labels raise :class:`~pympar.errors.CollectiveMismatchError`. Blocks
    nest (``outer/inner``). Layers label themselves (:meth:`pympar.modules.Module.agreement`).
    """
    return Label(name)


class Label(contextlib.ContextDecorator):
    """The block :func:`label` returns; entering it gives ``sizes`` (a small class: layers
    enter one per call, and a generator-based context manager costs three times as much)."""

    __slots__ = ("name", "sizes")

    def __init__(self, name: str, sizes: tuple[int, ...] | None = None) -> None:
        self.name, self.sizes = name, sizes

    def __enter__(self) -> tuple[int, ...] | None:
        global _label
        _outer.append(_label)
        _label = self.name if _label is None else f"{_label}/{self.name}"
        return self.sizes

    def __exit__(self, *exc: object) -> None:
        global _label
        _label = _outer.pop()


def within(name: str | None) -> str | None:
    """The label the check compares: ``name`` (a mapping's own) inside any ``label`` block."""
    if _label is None:
        return name
    return f"{_label}/{name}" if name else _label


def check(group: Any, sig: int, shown: str, name: str | None, hint: str = "") -> None:
    """The agreement check: raise on every rank of ``group`` unless every rank passes ``sig``
    (``hint``: what must hold, see :func:`pympar.debug.report`; ``RuntimeError`` for a
    freed group)."""
    board = group._state.board
    if board is None or not board.agree(sig, group, shown, debug._timeout):
        failed(group, board, shown, name, hint)


def failed(group: Any, board: Any, shown: str, name: str | None, hint: str = "") -> None:
    """Raise for a check that did not pass: ``board`` None, the group was freed (this rank
    alone); else every rank of ``group`` raises the same report (:func:`pympar.debug.report`)."""
    if board is None:
        raise freed_error(shown, group)
    debug.report(group, f"{shown} in {name}" if name else shown, hint)


def refuse(group: Any, what: str, error: Exception) -> None:
    """Before this rank raises ``error`` about its own arguments (to ``what``), join the
    others' check with a signature no call has: every rank raises
    :class:`~pympar.errors.CollectiveMismatchError` naming it, unless every rank refused."""
    state = getattr(group, "_state", None)
    if state is not None and state.board is not None:  # None: one rank, or freed
        check(group, REFUSED, f"{what}, refused by this rank: {error}", within(None))


def agree(group: Any, key: tuple, shown: str) -> None:
    """Check that every rank of ``group`` reaches this point with an equal ``key``.

    The collectives' own check (with the enclosing :func:`label`; ``key`` hashed through its
    ``repr``, ``shown`` the call in words) for what they do not cover (a ring of messages)
    or too coarsely (a flat buffer whose parts every rank must order alike): every rank raises
    :class:`~pympar.errors.CollectiveMismatchError` when the keys differ (RuntimeError: freed).
    """
    if group.size > 1:
        name = within(None)
        check(group, signature(key, name), shown, name)


def extents(group: Any, sig: int, shown: str, name: str | None, extent: int,
            claim: int = 0, hint: str = "") -> tuple[int, ...]:
    """Every rank's ``extent``, learned after the check of ``sig`` in one small exchange;
    every rank raises when an ``out`` does not fit the total on any rank (``claim``: its
    extent along the gathered axis plus one, 0 without one; ``hint`` goes to the report)."""
    check(group, sig, shown, name, hint)
    shown = shown.replace(debug._DETAIL, " with ")
    mine = np.array([extent, claim], np.int64)
    table = np.empty((group.size, 2), np.int64)
    wait(group.comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]),
         f"the extents of {shown}", group, debug._timeout)
    sizes, claims = table[:, 0].tolist(), table[:, 1].tolist()
    total = sum(sizes)
    wrong = [q for q, c in enumerate(claims) if c and c - 1 != total]
    if wrong:
        raise CollectiveMismatchError(
            f"{shown} on group {group.name!r}: the out of {where(group, *wrong)} has "
            f"{[claims[q] - 1 for q in wrong]} along the gathered axis, but the ranks' "
            f"blocks add up to {total}; every rank raises")
    return tuple(sizes)
