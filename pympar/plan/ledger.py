"""What one rank communicates in a step: a list of :class:`Call` s, and the groups they use.

A :class:`Call` is one collective (or one ring transfer, one halo axis) as
:mod:`pympar.stats` records it: the group, the operation's label, and this rank's bytes in and
out. Layers and models (:mod:`pympar.plan.layers`, :mod:`pympar.plan.models`) produce these
lists by the same arithmetic their code does, from the layout alone, so a ledger can be
compared with a recorder's rows call for call (:func:`rows`). Labels are kept in their
*canonical* form (:func:`canonical`): what a layer's label says about its settings (the parts
in parentheses and brackets) is left out, the operation kept.

:class:`Site` places one rank in a layout: its coordinates on the mesh and, for every group
role (``"tp"``, ``"dp-cp"``, ``"ulysses"``, ...), the group's size, this rank's position and the
group's name as :class:`pympar.mesh.Mesh` names it. Only rank arithmetic, no communicator.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from ..mesh import parse_order

__all__ = ["Call", "GroupAt", "Site", "canonical", "rows", "PRIMITIVES"]

#: The kinds of communication a call can be (what :mod:`pympar.plan.costs` prices).
PRIMITIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
              "ring_transfer", "halo")

_SETTINGS = re.compile(r"\([^()]*\)|\[[^\[\]]*\]")


def canonical(label: str) -> str:
    """A recorded operation label without the settings a layer writes into it.

    ``"Linear3D(8->16, bias=True, dtype=float64).forward:all_gather"`` becomes
    ``"Linear3D.forward:all_gather"``; ``"allreduce_gradients[3 params, layout 1c2f9e0a]
    sum:all_reduce"`` becomes ``"allreduce_gradients sum:all_reduce"``. Mapping labels
    (``"copy_to_all.backward"``) have none and stay as they are.

    Parameters
    ----------
    label : str
        The operation as :class:`pympar.stats.Recorder` keys it.

    Returns
    -------
    str
    """
    previous = None
    while previous != label:  # nested parentheses, innermost first
        previous, label = label, _SETTINGS.sub("", label)
    return label


@dataclass(frozen=True)
class Call:
    """One communication call of one rank.

    Attributes
    ----------
    role : str
        The group's role in the layout (a key of :attr:`Site.groups`).
    operation : str
        The canonical label (:func:`canonical`).
    primitive : str
        One of :data:`PRIMITIVES`.
    bytes_in, bytes_out : int
        This rank's bytes given to and received from the call (as the recorders count them).
    """

    role: str
    operation: str
    primitive: str
    bytes_in: int
    bytes_out: int


@dataclass(frozen=True)
class GroupAt:
    """A group as seen from one rank.

    Attributes
    ----------
    name : str
        ``key-<global ranks>``, as :meth:`pympar.mesh.Mesh.group` names it.
    size : int
        Members.
    rank : int
        This rank's position in it.
    ranks : tuple of int
        The members' global ranks, in group order.
    """

    name: str
    size: int
    rank: int
    ranks: tuple[int, ...]


def mesh_group(sizes: Mapping[str, int], order: str, world_rank: int, axes: tuple[str, ...],
               key: str | None = None) -> GroupAt:
    """The group along ``axes`` that holds ``world_rank`` (named with ``key`` or the axes).

    The members are :func:`pympar.mesh.group_ranks`' row of ``world_rank``, found without
    building the whole table: the ranks that share its coordinates off ``axes``, ascending
    (the mesh order, innermost fastest).

    Parameters
    ----------
    sizes, order
        The mesh (see :func:`pympar.mesh.group_ranks`).
    world_rank : int
        The rank whose group it is.
    axes : tuple of str
        The axes the group spans.
    key : str, optional
        The name's prefix; the axes joined by ``-`` by default.
    """
    mesh_axes = parse_order(order, sizes)
    unknown = [a for a in axes if a not in sizes]
    if unknown or not 0 <= world_rank < math.prod(sizes.values()):
        raise ValueError(f"rank {world_rank} or axes {axes} do not fit the mesh {dict(sizes)}")
    stride, members, rest = 1, np.zeros(1, np.int64), world_rank
    for axis in mesh_axes:
        rest, here = divmod(rest, sizes[axis])
        if axis in axes:
            members = (members[None, :] + stride * np.arange(sizes[axis])[:, None]).ravel()
        else:
            members = members + stride * here
        stride *= sizes[axis]
    ranks = tuple(sorted(int(r) for r in members))
    prefix = key or "-".join(axes) or "self"
    return GroupAt("-".join([prefix, *map(str, ranks)]), len(ranks), ranks.index(world_rank),
                   ranks)


def sub_group(parent: GroupAt, key: str, members: list[int]) -> GroupAt:
    """A group cut from ``parent`` (its members given by their positions in ``parent``)."""
    ranks = tuple(parent.ranks[i] for i in members)
    me = parent.ranks[parent.rank]
    return GroupAt("-".join([key, *map(str, ranks)]), len(ranks), ranks.index(me), ranks)


@dataclass
class Site:
    """One rank of a layout: its world rank, the mesh, and its groups by role.

    Attributes
    ----------
    world_rank : int
    sizes : dict of str to int
        The mesh's axes and sizes.
    order : str
        The mesh order, innermost first.
    groups : dict of str to GroupAt
        Every group the model uses, by role.
    """

    world_rank: int
    sizes: dict[str, int]
    order: str
    groups: dict[str, GroupAt] = field(default_factory=dict)

    def add(self, role: str, axes: tuple[str, ...], key: str | None = None) -> GroupAt:
        """Add (and return) the group of ``axes`` under ``role``."""
        group = mesh_group(self.sizes, self.order, self.world_rank, axes, key)
        self.groups[role] = group
        return group

    def coord(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (0 for an axis the mesh lacks)."""
        rank = self.world_rank
        for name in self.order.split("-"):
            rank, here = divmod(rank, self.sizes[name])
            if name == axis:
                return here
        return 0

    def size(self, role: str) -> int:
        """The size of the group of ``role``."""
        return self.groups[role].size

    def rank(self, role: str) -> int:
        """This rank's position in the group of ``role``."""
        return self.groups[role].rank


def rows(calls: Iterable[Call], site: Site) -> dict[tuple[str, str], list[int]]:
    """``(group name, operation) -> [calls, bytes in, bytes out]``, as a recorder's rows.

    Parameters
    ----------
    calls : iterable of Call
        One rank's ledger.
    site : Site
        That rank (for the group names).
    """
    table: dict[tuple[str, str], list[int]] = {}
    for call in calls:
        row = table.setdefault((site.groups[call.role].name, call.operation), [0, 0, 0])
        row[0] += 1
        row[1] += call.bytes_in
        row[2] += call.bytes_out
    return table
