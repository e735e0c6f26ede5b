"""Balanced partitions of an axis, and where a sharded array's pieces sit in the full array.

Index arithmetic only: no communication. Every balanced split in
pympar (collectives, mappings, weight init, 3D layouts, checkpoints, sharded optimizer state)
goes through this module, so there is exactly one rule: ``n`` items over ``parts`` ranks as
:func:`numpy.array_split` does it, the first ``n % parts`` ranks holding one item more.

A :class:`Placement` describes one rank's shard of a logical (serial) array: the full shape
and the chain of :class:`Split` s that cut it. :meth:`Placement.pieces` turns that into index
slices, ``(global, local)`` pairs, which is all that weight init, checkpoints and the sharded
optimizer need to know about a layout.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

from .backend import array_module

__all__ = ["balanced_sizes", "block_slice", "strided_slices", "Split", "Placement"]


@functools.lru_cache(maxsize=4096)
def balanced_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Split ``n`` items over ``parts`` ranks like :func:`numpy.array_split`.

    Parameters
    ----------
    n : int
        Number of items (>= 0).
    parts : int
        Number of ranks (>= 1).

    Returns
    -------
    tuple of int
        Items per rank; the first ``n % parts`` ranks hold one more.

    Examples
    --------
    >>> balanced_sizes(5, 3)
    (2, 2, 1)
    """
    q, r = divmod(int(n), int(parts))
    return (q + 1,) * r + (q,) * (int(parts) - r)


def block_slice(n: int, parts: int, index: int) -> slice:
    """Block ``index`` of ``n`` items split over ``parts`` like :func:`numpy.array_split`.

    Parameters
    ----------
    n : int
        Number of items (>= 0).
    parts : int
        Number of ranks (>= 1).
    index : int
        The rank whose block is wanted (``0 <= index < parts``).

    Returns
    -------
    slice
        The block's range of items (empty when ``n < parts`` leaves the rank none).

    Examples
    --------
    >>> block_slice(5, 3, 2)
    slice(4, 5, None)
    """
    q, r = divmod(int(n), int(parts))
    start = index * q + min(index, r)
    return slice(start, start + q + (index < r))


def strided_slices(n: int, parts: int, index: int, stride: int = 1) -> list[slice]:
    """Ranges of an axis of ``n`` items held by rank ``index`` of ``parts`` under fusion.

    The axis is first cut into ``stride`` fused sub-arrays (e.g. 3 for a fused QKV weight) by
    the balanced rule, then each sub-array is split over the ``parts`` ranks by the same rule;
    a rank stores its piece of every sub-array, concatenated in order. ``stride=1`` is
    ``[block_slice(n, parts, index)]``.

    Parameters
    ----------
    n : int
        Number of items along the axis.
    parts : int
        Number of ranks.
    index : int
        This rank.
    stride : int, default 1
        Number of fused sub-arrays.

    Returns
    -------
    list of slice
        The rank's range in each sub-array, in order.

    Examples
    --------
    >>> strided_slices(10, 2, 1, stride=2)
    [slice(3, 5, None), slice(8, 10, None)]
    """
    out = []
    for fused in range(stride):
        whole = block_slice(n, stride, fused)
        mine = block_slice(whole.stop - whole.start, parts, index)
        out.append(slice(whole.start + mine.start, whole.start + mine.stop))
    return out


@dataclass(frozen=True)
class Split:
    """One cut of one axis: the axis split ``parts`` ways, this rank holding piece ``index``.

    Attributes
    ----------
    axis : int
        The array axis that is cut (non-negative).
    parts : int
        Number of pieces (the size of the group that shares the axis).
    index : int
        This rank's piece (its rank in that group).
    stride : int, default 1
        Fused sub-arrays along the axis; see :func:`strided_slices`.
    sizes : tuple of int, default ()
        Explicit extents of the ``parts`` pieces, in order, instead of the balanced rule
        (stride 1 only). :class:`pympar.zero.ZeroRedundancyOptimizer` uses it: its shares
        are balanced over the whole optimizer state, not parameter by parameter.
    """

    axis: int
    parts: int
    index: int
    stride: int = 1
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        if self.parts < 1 or self.stride < 1 or not 0 <= self.index < self.parts or self.axis < 0:
            raise ValueError(f"invalid {self!r}: need axis >= 0, parts >= 1, stride >= 1 and "
                             "0 <= index < parts")
        if self.sizes and (len(self.sizes) != self.parts or self.stride != 1
                           or min(self.sizes) < 0):
            raise ValueError(f"invalid {self!r}: explicit sizes need one extent >= 0 per part "
                             "and stride 1")

    @classmethod
    def over(cls, group: Any, axis: int, stride: int = 1) -> "Split":
        """The split of ``axis`` over a pympar ``Group`` (its size and this rank's position).

        Parameters
        ----------
        group : pympar.group.Group
            The group that shares the axis.
        axis : int
            The array axis that is cut.
        stride : int, default 1
            Fused sub-arrays along the axis.

        Returns
        -------
        Split
        """
        return cls(int(axis), int(group.size), int(group.rank), int(stride))


def _cut(ranges: list[slice], split: Split) -> list[slice]:
    """Cut the concatenation of global ``ranges`` by ``split``; return the global ranges kept."""
    length = sum(r.stop - r.start for r in ranges)
    if split.sizes:
        if sum(split.sizes) != length:
            raise ValueError(f"{split!r}: the sizes add up to {sum(split.sizes)}, the axis "
                             f"holds {length}")
        start = sum(split.sizes[:split.index])
        wanted = [slice(start, start + split.sizes[split.index])]
    else:
        wanted = strided_slices(length, split.parts, split.index, split.stride)
    kept = []
    for local in wanted:
        # Map the local range [local.start, local.stop) of the concatenation back to globals.
        offset = 0
        for r in ranges:
            lo, hi = max(local.start, offset), min(local.stop, offset + r.stop - r.start)
            if lo < hi:
                kept.append(slice(r.start + lo - offset, r.start + hi - offset))
            offset += r.stop - r.start
    merged: list[slice] = []
    for r in kept:
        if merged and merged[-1].stop == r.start:
            merged[-1] = slice(merged[-1].start, r.stop)
        elif r.stop > r.start:
            merged.append(r)
    return merged


@dataclass(frozen=True)
class Placement:
    """Where this rank's shard of a logical (serial-layout) array sits in the full array.

    Attributes
    ----------
    shape : tuple of int
        The full array's shape.
    splits : tuple of Split
        The cuts, applied in order. A later split of an axis already split cuts this rank's
        piece again (nested blocks, as the 3D layers use). Empty for a replicated array.
    """

    shape: tuple[int, ...]
    splits: tuple[Split, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "splits", tuple(self.splits))
        for split in self.splits:
            if split.axis >= len(self.shape):
                raise ValueError(f"{split!r} names an axis of a {len(self.shape)}-d shape "
                                 f"{self.shape}")

    @property
    def replicated(self) -> bool:
        """bool: True when every rank holds the whole array."""
        return all(s.parts == 1 for s in self.splits)

    def then(self, split: Split) -> "Placement":
        """This placement cut once more by ``split`` (e.g. a data-parallel share of a shard).

        Parameters
        ----------
        split : Split
            The further cut.

        Returns
        -------
        Placement
        """
        return Placement(self.shape, self.splits + (split,))

    @functools.cached_property
    def axis_ranges(self) -> tuple[tuple[slice, ...], ...]:
        """Per axis, the global ranges this rank holds, in local storage order."""
        per_axis = [[slice(0, n)] for n in self.shape]
        for split in self.splits:
            per_axis[split.axis] = _cut(per_axis[split.axis], split)
        return tuple(tuple(r) for r in per_axis)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """tuple of int: Shape of this rank's shard."""
        return tuple(sum(r.stop - r.start for r in ranges) for ranges in self.axis_ranges)

    def pieces(self) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """The shard as contiguous boxes: ``(global index, local index)`` pairs.

        ``full[g]`` and ``local[l]`` hold the same values for every pair ``(g, l)``; the local
        boxes tile the shard. One pair unless a strided split cuts an axis into several ranges.
        """
        per_axis = []
        for ranges in self.axis_ranges:
            pairs, offset = [], 0
            for r in ranges:
                pairs.append((r, slice(offset, offset + r.stop - r.start)))
                offset += r.stop - r.start
            per_axis.append(pairs)
        return [(tuple(g for g, _ in combo), tuple(lo for _, lo in combo))
                for combo in itertools.product(*per_axis)]

    def take(self, full: Any) -> Any:
        """This rank's shard of a full array, as a new array of the same library.

        Parameters
        ----------
        full : numpy.ndarray or cupy.ndarray
            The whole array, of shape :attr:`shape`.

        Returns
        -------
        array
            A copy of this rank's shard, of shape :attr:`local_shape`.
        """
        if tuple(full.shape) != self.shape:
            raise ValueError(f"expected a full array of shape {self.shape}, got {tuple(full.shape)}")
        pieces = self.pieces()
        if len(pieces) == 1:
            return full[pieces[0][0]].copy()
        local = array_module(full).empty(self.local_shape, dtype=full.dtype)
        for g, lo in pieces:
            local[lo] = full[g]
        return local

    def put(self, local: Any, full: Any) -> None:
        """Write this rank's shard ``local`` into its place in ``full`` (in place).

        Parameters
        ----------
        local : numpy.ndarray or cupy.ndarray
            This rank's shard, of shape :attr:`local_shape`.
        full : numpy.ndarray or cupy.ndarray
            The whole array, of shape :attr:`shape`, written where the shard belongs.
        """
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"expected a shard of shape {self.local_shape}, "
                             f"got {tuple(local.shape)}")
        for g, lo in self.pieces():
            full[g] = local[lo]
