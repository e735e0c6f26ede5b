"""The plan of one halo exchange (private to :mod:`pympar.halo`): regions, datatypes, buffers.

For one array shape and dtype, :class:`Plan` holds per exchanged axis the four regions of
the padded array that travel (:class:`Axis`), the committed MPI subarray datatypes or the
reused contiguous buffers of the faces, and the zeroed ghost slabs where a non-periodic
field ends.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from . import backend

__all__ = ["UP", "DOWN", "Axis", "Plan", "widths", "count"]

UP, DOWN = 41, 42  # message tags: faces travelling to the upper and the lower neighbour
Index = tuple  # a tuple of slices into a padded array


def widths(width: Any, ndim: int) -> tuple[tuple[int, int], ...]:
    """``width`` (an int, or per axis an int or a ``(lo, hi)`` pair) as ``(lo, hi)`` per axis."""
    if isinstance(width, (int, np.integer)):
        width = [width] * ndim
    width = list(width)
    if len(width) != ndim:
        raise ValueError(f"HaloExchange: width has {len(width)} entries for a field of {ndim} "
                         f"dimensions (give one int, or one int or (lo, hi) pair per axis)")
    pairs = []
    for w in width:
        lo, hi = (w, w) if isinstance(w, (int, np.integer)) else tuple(w)
        lo, hi = operator.index(lo), operator.index(hi)
        if lo < 0 or hi < 0:
            raise ValueError(f"HaloExchange: widths must be >= 0, got {width}")
        pairs.append((lo, hi))
    return tuple(pairs)


class Axis:
    """The four regions of one axis's exchange in a padded array, and who sends to whom.

    ``send_up`` (the top ``lo`` interior cells) fills the upper neighbour's ``recv_lo``;
    ``send_down`` (the bottom ``hi`` interior cells) fills the lower neighbour's ``recv_hi``.
    """

    def __init__(self, axis: int, lead: int, padded: tuple[int, ...], interior: Index,
                 widths: tuple[tuple[int, int], ...], comm: MPI.Comm | None,
                 neighbours: tuple[int, int], group_name: str | None = None) -> None:
        lo, hi = widths[axis]
        n = padded[axis] - lo - hi
        self.axis, self.comm, (self.lower, self.upper) = axis, comm, neighbours
        self.group_name = None if comm is None else group_name
        around = [slice(None)] * len(padded)
        for b in range(axis + 1, len(padded)):
            around[b] = interior[b]  # later axes: interior only; earlier: the whole padding

        def region(start: int, stop: int) -> Index:
            index = list(around)
            index[axis] = slice(start, stop)
            return (slice(None),) * lead + tuple(index)

        self.recv_lo, self.send_up = region(0, lo), region(n, n + lo)
        self.recv_hi, self.send_down = region(lo + n, lo + n + hi), region(lo, lo + hi)
        self.lo, self.hi = lo, hi


def _free_requests(requests: list[list[MPI.Prequest]]) -> None:
    for axis in requests:
        for req in axis:
            req.Free()
    requests.clear()


def _sizes(region: Index, shape: tuple[int, ...]) -> list[int]:
    """The extents of ``region`` (slices of step 1) in an array of ``shape``."""
    return [len(range(*s.indices(n))) for s, n in zip(region, shape)]


def _contiguous(region: Index, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` is one contiguous run of a C-ordered array of ``shape``: single
    cells along the axes before one, whole axes after it."""
    sizes = _sizes(region, shape)
    first = next((a for a, n in enumerate(sizes) if n != 1), len(sizes))
    return sizes[first + 1:] == list(shape[first + 1:])


def _message(padded: Any, face: Index | MPI.Datatype) -> Any:
    """The buffer argument of a face's request on ``padded`` (see :meth:`Plan._face`)."""
    if isinstance(face, MPI.Datatype):
        return [padded, 1, face]
    return padded[face]


def count(region: Index, shape: tuple[int, ...]) -> int:
    """The number of cells of ``region`` in an array of ``shape``."""
    return int(np.prod(_sizes(region, shape)))


class Plan:
    """Everything one array shape and dtype needs: regions, MPI datatypes, buffers, key."""

    def __init__(self, halo: Any, shape: tuple[int, ...], x: Any) -> None:
        d = halo.decomposition
        lead = len(shape) - d.ndim
        self.shape, self.dtype = shape, x.dtype
        self.interior = (slice(None),) * lead + halo.interior
        self.numpy = type(x) is np.ndarray
        self.subarrays = self.numpy and halo.faces == "subarray"
        self.axes = []
        for a in halo.exchanged:
            group = d.groups[a]
            comm = None if group is None or group.size == 1 else group.comm
            self.axes.append(Axis(a, lead, halo.padded_shape, halo.interior, halo.widths,
                                   comm, d.neighbours(a), group and group.name))
        # Outer ghost slabs (where a non-periodic field ends), zeroed by forward.
        self.outer: list[Index] = []
        for a in range(d.ndim):
            lower, upper = d.neighbours(a)
            lo, hi = halo.widths[a]
            full = [slice(None)] * d.ndim
            for none, width, start in ((lower, lo, 0), (upper, hi, halo.padded_shape[a] - hi)):
                if width and none == MPI.PROC_NULL:
                    full[a] = slice(start, start + width)
                    self.outer.append((slice(None),) * lead + tuple(full))
        self.mpi_type = backend.mpi_datatype(x.dtype)
        self.types: dict[tuple[int, str], MPI.Datatype] = {}
        self.buffers: dict[Any, Any] = {}
        self.signatures: dict[str | None, int] = {}  # the agreement key's, per label
        # The persistent requests per axis (see requests()) and the array they were made on
        # (they hold it anyway).
        self.persistent: list[list[MPI.Prequest]] = []
        self._requests_at: int | None = None
        self.requests_on: Any = None
        # Requests left when the plan goes (or at exit, before MPI finalizes) are freed then.
        weakref.finalize(self, _free_requests, self.persistent)
        self.xp = backend.array_module(x)
        self.lead_shape = shape[:lead]
        for ax in self.axes:  # bytes sent and received along the axis, for statistics
            up, down = ax.upper != MPI.PROC_NULL, ax.lower != MPI.PROC_NULL
            ax.sent = x.dtype.itemsize * (up * count(ax.send_up, shape)
                                          + down * count(ax.send_down, shape))
            ax.received = x.dtype.itemsize * (down * count(ax.recv_lo, shape)
                                              + up * count(ax.recv_hi, shape))
            # The forward's two Sendrecv, ready to go: (send region, to, tag, receive region,
            # from), each region a view when it is one contiguous run of the padded array
            # (MPICH moves a plain buffer 4-5 us sooner than the same bytes as a subarray
            # datatype), else its subarray datatype.
            ax.pairs = () if not self.subarrays or ax.comm is None else (
                (self._face(ax, "send_up"), ax.upper, UP, self._face(ax, "recv_lo"), ax.lower),
                (self._face(ax, "send_down"), ax.lower, DOWN, self._face(ax, "recv_hi"),
                 ax.upper))
        # Every axis exchanged through persistent requests: an exchange is only their
        # Startall + Waitall, axis after axis.
        self.direct = self.subarrays and all(ax.pairs for ax in self.axes)

    def requests(self, padded: Any) -> list[list[MPI.Prequest]]:
        """Per axis with subarray faces, the forward's four persistent requests on
        ``padded`` (both receives, then both sends): made once per array address, so a
        reused padded array starts them again without building any message (2-3 us less
        per axis than two ``Sendrecv``, on MPICH)."""
        if padded is self.requests_on:  # the same array object: the same memory
            return self.persistent
        at = padded.ctypes.data  # ~2 us: only for an array not seen last
        if self._requests_at != at:
            self.free_requests()
            self.persistent.extend(
                [req for send, dest, tag, recv, source in ax.pairs
                 for req in (ax.comm.Recv_init(_message(padded, recv), source, tag),
                             ax.comm.Send_init(_message(padded, send), dest, tag))]
                for ax in self.axes if ax.pairs)
            self._requests_at = at
        self.requests_on = padded
        return self.persistent

    def free_requests(self) -> None:
        """Free the persistent requests (they hold the last array they were made on)."""
        _free_requests(self.persistent)
        self._requests_at = self.requests_on = None

    def _face(self, ax: Axis, name: str) -> Index | MPI.Datatype:
        """Region ``name`` of ``ax`` as a persistent request takes it: the index of a
        contiguous run, else the region's subarray datatype."""
        region = getattr(ax, name)
        return region if _contiguous(region, self.shape) else self.datatype(ax, name)

    def datatype(self, ax: Axis, name: str) -> MPI.Datatype:
        """The committed subarray datatype of region ``name`` of ``ax`` (cached)."""
        t = self.types.get((ax.axis, name))
        if t is None:
            starts, sizes = [], []
            for s, n in zip(getattr(ax, name), self.shape):
                start, stop, _ = s.indices(n)
                starts.append(start)
                sizes.append(stop - start)
            t = self.types[ax.axis, name] = self.mpi_type.Create_subarray(
                list(self.shape), sizes, starts, order=MPI.ORDER_C).Commit()
        return t

    def buffer(self, ax: Axis, name: str) -> Any:
        """A reused contiguous array shaped as region ``name`` of ``ax`` (one per region)."""
        buf = self.buffers.get((ax.axis, name))
        if buf is None:
            buf = self.buffers[ax.axis, name] = self.xp.empty(
                _sizes(getattr(ax, name), self.shape), self.dtype)
        return buf

    def free(self) -> None:
        self.free_requests()
        for t in self.types.values():
            t.Free()
        self.types.clear()
        self.buffers.clear()
