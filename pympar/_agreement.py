"""The agreement check every collective makes before its data call (private).

:mod:`pympar.collectives` calls :func:`post` before it packs a call's input and
:func:`settle` just before the data call; a gather of unknown extents learns them with
:func:`extents`; a rank refusing its own arguments calls :func:`refuse`. The words travel
through the group's board (:mod:`pympar._board`). :func:`label` names the code that runs
collectives, and its name is compared too; :func:`agree` makes one check on a caller's
key. Both are public as ``pympar.collectives.label`` and ``pympar.collectives.agree``.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

from mpi4py import MPI

from . import _board, debug
from ._plans import Plan

__all__ = ["label", "within", "agree", "post", "settle", "check", "mismatch", "refuse",
           "extents"]

# The label of the code running collectives (see label()); mappings pass theirs.
_label: str | None = None


def label(name: str) -> _Label:
    """Name the collectives called inside a ``with`` block, in statistics and errors.

    Also usable as a decorator (``@label("Linear3D.forward")``).

    Parameters
    ----------
    name : str
        E.g. ``"Linear3D.backward"``; statistics record each collective inside as
        ``"Linear3D.backward:all_gather"`` and so on. Part of the agreement check: ranks
        running the same collective under different labels raise
        :class:`~pympar.debug.CollectiveMismatchError`.
        Mappings label their own collectives (``"gather_from_sequence.forward"``).
    """
    return _Label(name)


class _Label(contextlib.ContextDecorator):
    """The block :func:`label` returns: a small class rather than a generator-based context
    manager, since layers enter one per forward and this costs a third as much."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        global _label
        _outer.append(_label)
        _label = self.name

    def __exit__(self, *exc: object) -> None:
        global _label
        _label = _outer.pop()


# The labels of the enclosing blocks, innermost last (a stack: blocks nest, and one
# decorator's label object is entered again by recursive calls).
_outer: list[str | None] = []


def within(name: str | None) -> str | None:
    """The label the agreement check compares: a mapping's own inside any ``label`` block.

    Statistics keep the mapping's label alone; the check also compares the enclosing
    block's, so that layers naming themselves (with their sizes) in a block make ranks
    that built different layers raise even when the collective itself looks alike.
    """
    if _label is None:
        return name
    return f"{_label}/{name}" if name else _label


def agree(group: Any, key: tuple, shown: str) -> None:
    """Check that every rank of ``group`` reaches this point with an equal ``key``.

    One agreement check of the collectives' own kind (see :mod:`pympar.collectives`), for
    communication they do not cover, such as a ring of point-to-point messages, or cover
    too coarsely, such as one flat buffer whose parts every rank must order alike. The
    check compares the enclosing :func:`label` too. Nothing happens on a group of one
    rank; ``PYMPAR_CHECK_BYTES`` does not apply.

    Parameters
    ----------
    group : Group
        The ranks that must agree.
    key : tuple
        What must be equal on every rank (hashable; shapes, dtypes as strings, flags).
    shown : str
        This rank's call in words, for the error message.

    Raises
    ------
    pympar.debug.CollectiveMismatchError
        On every rank, when two ranks' keys (or labels) differ.
    RuntimeError
        When ``group`` has been freed.
    """
    if group.size == 1:
        return
    if group.comm == MPI.COMM_NULL:
        raise RuntimeError(f"{shown}: group {group.name!r} has been freed (Group.free or "
                           f"manager.destroy_parallel); use the groups of the current state")
    # A plan of its own each time, not cached: keys that change every call (a learning
    # rate, a batch's key lengths) would fill the group's plan cache and evict the
    # collectives' plans.
    plan = Plan(key=("agree", key), shown=shown,
                sig=zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)
    name = within(None)
    check(group, plan, name, None)
    if debug.is_enabled():  # as for every collective: the full comparison after the check
        debug.verify(group, (plan.key, name), debug.describe(shown, name), None, None)


def post(group: Any, plan: Plan, name: str | None) -> int:
    """Start the agreement check (:mod:`pympar._board`); return the token :func:`settle` takes.

    The call's signature is the plan's with the label's folded in, hashed to 32 bits and
    made odd (never :data:`~pympar._board.REFUSED`), built once per (plan, label). Started
    before packing and finished just before the data call, so that another rank's
    lateness, or the latency of the message board, overlaps the local work.
    """
    sig = plan.checks.get(name)
    if sig is None:
        s = plan.sig << 31 | (_LABELS.get(name) or _label_sig(name)) if name else plan.sig << 31
        sig = plan.checks[name] = zlib.crc32(s.to_bytes(8, "little")) | 1
    return group._board.publish(sig)


def settle(group: Any, plan: Plan, token: int, name: str | None, x: Any,
           timeout: float | None = None) -> None:
    """Finish the check started by :func:`post`; raise on every rank when ranks differ.

    ``timeout``: seconds to wait for the other ranks (``PYMPAR_TIMEOUT``, which the caller
    passes when it is on), else for ever.
    """
    if not group._board.wait(token, group, plan.shown, timeout):
        mismatch(group, plan.key, name, plan.shown, x)


def check(group: Any, plan: Plan, name: str | None, x: Any) -> None:
    """The whole agreement check at once (see :func:`post`)."""
    settle(group, plan, post(group, plan, name), name, x, debug.get_timeout())


_LABELS: dict[str, int] = {}


def _label_sig(name: str) -> int:
    sig = _LABELS[name] = zlib.crc32(name.encode()) & 0x7FFFFFFF or 1
    return sig


def mismatch(group: Any, key: tuple, name: str | None, shown: str, x: Any) -> None:
    """Raise the same CollectiveMismatchError on every rank, naming every rank's call."""
    debug.verify(group, (key, name), debug.describe(shown, name), None, x)
    raise debug.CollectiveMismatchError(f"ranks of group {group.name!r} disagree on {shown}")


def refuse(group: Any, what: str, error: Exception, name: str | None,
           others_check: bool) -> None:
    """Before this rank raises ``error`` about its own arguments, make the others raise too.

    When the other ranks are about to check their call (``others_check``), this rank joins
    that check with the signature :data:`~pympar._board.REFUSED`, which no call has, so
    that every rank raises :class:`~pympar.debug.CollectiveMismatchError` naming this
    rank's reason instead of waiting for it in MPI; when every rank refused, each returns
    to raise its own error.
    """
    board = getattr(group, "_board", None)
    if not others_check or board is None or group.comm == MPI.COMM_NULL:
        return
    shown = f"{what}, refused by this rank: {error}"
    token = board.publish(_board.REFUSED)
    if not board.wait(token, group, shown, debug.get_timeout()):
        mismatch(group, (what, "refused"), name, shown, None)


def extents(group: Any, key: tuple, name: str | None, shown: str, x: Any, extent: int,
            claim: int) -> tuple[int, ...]:
    """Every rank's ``extent`` along a gathered axis, learned in the call's own check.

    ``key`` is the call with that extent masked; ``claim`` is this rank's ``out`` extent
    there plus one (0: no ``out``). Raises on every rank when the ranks' calls differ, or
    when any rank's ``out`` does not fit the sum of the extents.
    """
    board = group._board
    token = board.publish(zlib.crc32(repr((key, name)).encode()) | 1, extent, claim, True)
    timeout = debug.get_timeout()
    if not board.wait(token, group, shown, timeout):
        mismatch(group, key, name, shown, x)
    sizes, claims = board.extents(token, group, shown, timeout)
    total = sum(sizes)
    wrong = [q for q, c in enumerate(claims) if c and c - 1 != total]
    if wrong:
        raise debug.CollectiveMismatchError(
            f"{shown} on group {group.name!r}: the out of rank(s) {wrong} has "
            f"{[claims[q] - 1 for q in wrong]} along the gathered axis, but the ranks' "
            f"blocks add up to {total}; every rank raises")
    return tuple(sizes)
