"""Cartesian decompositions of an n-d field: which block each rank holds, and its neighbours.

A field of ``n`` dimensions (the trailing ``n`` axes of an array; any leading axes, such as
batch and channels, are held whole by every rank) is cut into blocks on a grid of ranks:
axis ``a`` is split over the group ``groups[a]`` by the balanced rule of
:func:`numpy.array_split` (:mod:`pympar.partition`), and a rank's block along ``a`` is
block ``groups[a].rank``. Axes without a group are not split. The groups of different
axes come from different mesh axes (``mesh.group("x")``, ``mesh.group("y")``), so every
combination of coordinates is one rank; a group over several mesh axes may split one
field axis.

Creating a :class:`Decomposition` is collective over each of its groups: the ranks agree
on the global shape and the periodicity, and every rank checks with its neighbours along
each axis that they hold the adjacent blocks (so that groups which do not form a grid, such
as one group given for two axes, raise on every rank instead of exchanging wrong halos).
"""

from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from . import _agreement, collectives, debug
from .group import Group
from .partition import balanced_sizes, block_slice

__all__ = ["Decomposition", "agree_all", "check_all"]

_CHECK_TAG = 29  # the neighbour check's messages


def agree_all(groups: Sequence[Group], key: tuple, shown: str,
              error: Exception | None = None) -> None:
    """One agreement check in each of ``groups``, so that a refusal reaches every rank.

    Every rank calls this with its groups in the same (axis) order. A rank with ``error``
    (its own input refused), or whose check failed in an earlier group, joins the later
    groups' checks refusing, so the failure spreads along every axis of the grid instead
    of leaving the ranks of other groups waiting.

    Parameters
    ----------
    groups : sequence of Group
        This rank's groups (those of one rank are skipped).
    key : tuple
        What must be equal on every rank.
    shown : str
        This rank's call in words, for the error message.
    error : Exception, optional
        This rank's own refusal; raised after the checks when no check failed first.

    Raises
    ------
    pympar.debug.CollectiveMismatchError
        On every rank of the grid, when some rank's key differs or some rank refused.
    Exception
        ``error``, on the ranks that refused (every rank raises ``error`` when all did).
    """
    failure = error
    for group in groups:
        if group.size == 1:
            continue
        if failure is None:
            try:
                collectives.agree(group, key, shown)
            except debug.CollectiveMismatchError as err:
                failure = err
        else:
            try:
                collectives.refuse(group, shown, failure)
            except debug.CollectiveMismatchError:
                pass  # the others of this group raise; this rank goes on to the next group
    if failure is not None:
        raise failure




def check_all(groups: Sequence[Group], sig: int, shown: str, name: str | None) -> None:
    """:func:`agree_all` of a key whose signature ``sig`` (:func:`pympar._plans.signature`)
    is known (a repeated call: no hashing), every group of more than one rank: the one
    check of each group (:func:`pympar._agreement.check`), a failure spreading as in
    :func:`agree_all`.
    """
    for at, group in enumerate(groups):
        try:
            _agreement.check(group, sig, shown, name)
        except debug.CollectiveMismatchError as err:
            agree_all(groups[at + 1:], (), shown, err)


def _grid(global_shape: Sequence[int], groups: Mapping[Any, Any]
          ) -> tuple[tuple[int, ...], list[Group | None]]:
    """The shape and the group of each axis (None where not split), or the error of
    this rank's arguments."""
    try:
        shape = tuple(operator.index(n) for n in global_shape)
    except TypeError:
        raise TypeError(f"Decomposition: global_shape {global_shape!r} needs int extents") \
            from None
    if not shape:
        raise ValueError("Decomposition: global_shape needs at least one axis")
    if min(shape) < 1:
        raise ValueError(f"Decomposition: global_shape {shape} needs every extent >= 1")
    ndim = len(shape)
    per_axis: list[Group | None] = [None] * ndim
    for axis, group in groups.items():
        axis = operator.index(axis)
        if not -ndim <= axis < ndim:
            raise ValueError(f"Decomposition: axis {axis} is out of range for a field of "
                             f"{ndim} dimensions")
        if not isinstance(group, Group):
            raise TypeError(f"Decomposition: groups[{axis}] must be a pympar Group, not "
                            f"{type(group).__name__}")
        if per_axis[axis % ndim] is not None:
            raise ValueError(f"Decomposition: axis {axis % ndim} is given twice")
        per_axis[axis % ndim] = group
    return shape, per_axis


def _periodic(periodic: Any, ndim: int) -> tuple[bool, ...]:
    if isinstance(periodic, (bool, np.bool_)):
        return (bool(periodic),) * ndim
    flags = tuple(bool(p) for p in periodic)
    if len(flags) != ndim:
        raise ValueError(f"Decomposition: periodic has {len(flags)} entries for a field of "
                         f"{ndim} dimensions (give one bool, or one per axis)")
    return flags


class Decomposition:
    """A Cartesian split of an n-d field over groups of ranks; collective over the groups.

    Parameters
    ----------
    global_shape : sequence of int
        The field's global extents (the trailing axes of the arrays it describes).
    groups : mapping of int to Group, optional
        Field axis (negative counts from the end) -> the group it is split over. Axes
        left out are not split. Groups of different axes must be cut from different mesh
        axes, so that the ranks form a grid.
    periodic : bool or sequence of bool, default False
        Whether each axis wraps around (one flag for all axes, or one per axis).

    Attributes
    ----------
    global_shape : tuple of int
    ndim : int
    groups : tuple of (Group or None)
        Per axis; None for an axis that is not split.
    periodic : tuple of bool
    parts, coords : tuple of int
        Per axis: the number of blocks, and this rank's block.
    sizes : tuple of tuple of int
        Per axis: every block's extent (balanced rule).
    blocks : tuple of slice
        Per axis: where this rank's block sits in the global field.
    local_shape : tuple of int

    Raises
    ------
    TypeError
        For groups that are not :class:`~pympar.group.Group` s or axes that are not ints.
    ValueError
        For an extent < 1, an axis out of range or given twice, a wrong number of
        periodic flags; or on every rank, when the groups do not form a grid of adjacent
        blocks. A rank that refuses its arguments raises this, and the other ranks of its
        groups :class:`~pympar.debug.CollectiveMismatchError` naming it.
    pympar.debug.CollectiveMismatchError
        On every rank, when ranks pass different shapes, periodicity or group sizes.
    """

    def __init__(self, global_shape: Sequence[int], groups: Mapping[int, Group] | None = None,
                 periodic: bool | Sequence[bool] = False) -> None:
        given = dict(groups or {})
        try:
            shape, per_axis = _grid(global_shape, given)
            self.periodic = _periodic(periodic, len(shape))
        except (TypeError, ValueError) as error:
            # Refused before the others agree: they raise too, in the groups given here
            # (the same, in the same order, on every rank of a correct call).
            groups_given = [g for g in given.values() if isinstance(g, Group) and g.size > 1]
            agree_all(list(dict.fromkeys(groups_given)), (), "Decomposition", error)
            raise
        ndim = len(shape)
        self.global_shape = shape
        self.ndim = ndim
        self.groups = tuple(per_axis)
        self.parts = tuple(1 if g is None else g.size for g in self.groups)
        self.coords = tuple(0 if g is None else g.rank for g in self.groups)
        self.sizes = tuple(balanced_sizes(n, p) for n, p in zip(shape, self.parts))
        self.blocks = tuple(block_slice(n, p, c)
                            for n, p, c in zip(shape, self.parts, self.coords))
        self.local_shape = tuple(b.stop - b.start for b in self.blocks)
        shown = (f"Decomposition(global_shape={shape}, parts={self.parts}, "
                 f"periodic={self.periodic})")
        agree_all(self.split_groups(), ("Decomposition", shape, self.parts, self.periodic), shown)
        self._check_neighbours(shown)

    def split_groups(self) -> tuple[Group, ...]:
        """The groups of the split axes (more than one rank), in axis order."""
        return tuple(g for g in self.groups if g is not None and g.size > 1)

    def neighbours(self, axis: int) -> tuple[int, int]:
        """This rank's lower and upper neighbour along ``axis``, as ranks of its group.

        ``MPI.PROC_NULL`` where the field ends (a non-periodic axis); this rank itself
        along a periodic axis of one block.
        """
        parts, coord = self.parts[axis], self.coords[axis]
        if self.periodic[axis]:
            return (coord - 1) % parts, (coord + 1) % parts
        return (coord - 1 if coord > 0 else MPI.PROC_NULL,
                coord + 1 if coord < parts - 1 else MPI.PROC_NULL)

    def take(self, full: Any) -> Any:
        """This rank's block of a full field (any leading axes kept whole), as a new array."""
        if tuple(full.shape[full.ndim - self.ndim:]) != self.global_shape:
            raise ValueError(f"Decomposition.take: expected an array ending in the global "
                             f"shape {self.global_shape}, got shape {tuple(full.shape)}")
        return full[(Ellipsis, *self.blocks)].copy()

    def _check_neighbours(self, shown: str) -> None:
        """Check with the neighbours along each split axis that they hold adjacent blocks.

        Each rank sends its block coordinates to both ring neighbours of every split axis
        (one message each way); a neighbour along axis ``a`` must differ in coordinate
        ``a`` alone, by one. Every rank's verdict then spreads over the groups, axis after
        axis, so that every rank of the grid raises alike.
        """
        mine = np.array(self.coords, np.int64)
        bad = np.zeros(1, np.int64)
        for axis, group in enumerate(self.groups):
            if group is None or group.size == 1:
                continue
            lo, hi = (group.rank - 1) % group.size, (group.rank + 1) % group.size
            for dest, source, step in ((hi, lo, -1), (lo, hi, 1)):
                seen = np.empty_like(mine)
                group.comm.Sendrecv(mine, dest, _CHECK_TAG, seen, source, _CHECK_TAG)
                want = mine.copy()
                want[axis] = (mine[axis] + step) % group.size
                bad[0] |= int(not np.array_equal(seen, want))
        for group in self.split_groups():
            group.all_reduce(bad, "max", out=bad)
        if bad[0]:
            raise ValueError(
                f"{shown}: the groups do not form a grid: along some axis a rank's "
                f"neighbour in its group does not hold the adjacent block (its other "
                f"coordinates differ). Give each split axis a group cut from other mesh "
                f"axes, e.g. {{0: mesh.group('x'), 1: mesh.group('y')}}")

    def __repr__(self) -> str:
        return (f"Decomposition(global_shape={self.global_shape}, parts={self.parts}, "
                f"coords={self.coords}, periodic={self.periodic})")
