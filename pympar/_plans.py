"""Per-group plans and scratch buffers of the collectives, and ``out=`` handling.

Private to :mod:`pympar.collectives`.

* Scratch: every :class:`~pympar.group.Group` keeps a bounded cache of
  temporaries (``group._buffers``, at most ``_MAX_BUFFERS`` arrays and
  ``_MAX_BUFFER_BYTES`` bytes, oldest evicted first).
* Plans: what a collective needs that depends only on metadata -- output shape,
  MPI datatype, counts and displacements, whether packing is needed -- is a
  ``_Plan`` in ``group._plans``, keyed by (operation, shape, dtype, axis, ...).
* Blocks: ``_Blocks`` cuts an axis into one block per rank; ``_pack`` and
  ``_unpack`` move a non-leading axis between its array and rank-major order.
* Arguments: axis normalisation, agreeing on unknown extents with one small
  Allgather, and checking or allocating ``out``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from . import debug
from ._wire import _ndarray, _offsets, _xp


_MAX_BUFFERS = 16
_MAX_BUFFER_BYTES = 2**31  # per group; one larger message still gets its buffer
_MAX_PLANS = 512


# --------------------------------------------------------------------------- scratch


def _cached(self: Any, key: tuple, shape: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """The group's scratch array for ``key``, allocated on first use (contents undefined).

    The cache holds at most ``_MAX_BUFFERS`` arrays and ``_MAX_BUFFER_BYTES``
    bytes, evicting the oldest first.
    """
    buffers = self._buffers
    buffer = buffers.get(key)
    if buffer is None:
        nbytes = math.prod(shape) * dtype.itemsize
        while buffers and (len(buffers) >= _MAX_BUFFERS or
                           sum(b.nbytes for b in buffers.values()) + nbytes > _MAX_BUFFER_BYTES):
            del buffers[next(iter(buffers))]
        buffer = buffers[key] = xp.empty(shape, dtype)
    return buffer


def _temp(group: Any, slot: str, shape: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """A cached C-contiguous scratch array shaped ``shape`` (contents undefined)."""
    return _cached(group, (slot, shape, dtype, xp is np), shape, dtype, xp)


# --------------------------------------------------------------------------- plans


class _Blocks:
    """An axis of a C-ordered shape cut into one block per rank.

    Seen as ``(lead, n, post)``, block ``q`` covers ``[:, offsets[q]:offsets[q] +
    sizes[q], :]``; rank-major, it is ``counts[q]`` elements at ``displs[q]``.
    """

    __slots__ = ("lead", "n", "post", "sizes", "offsets", "counts", "displs", "total", "even",
                 "contiguous", "by_axis", "by_rank", "scratch_shape")

    def __init__(self, shape: tuple[int, ...], axis: int, sizes: tuple[int, ...]) -> None:
        self.lead = math.prod(shape[:axis])
        self.post = math.prod(shape[axis + 1:])
        self.n = sum(sizes)
        self.sizes = sizes
        self.offsets = _offsets(sizes)
        self.counts = tuple(self.lead * s * self.post for s in sizes)
        self.displs = _offsets(self.counts)
        self.total = sum(self.counts)
        self.even = len(set(sizes)) == 1
        # Blocks already lie rank-major in memory: MPI can use the array directly.
        self.contiguous = self.lead == 1
        # Even blocks as 4-D views: the array (lead, rank, s, post) and the
        # rank-major buffer (rank, lead, s, post); one transposed copy apart.
        p, s = len(sizes), sizes[0]
        self.by_axis = (self.lead, p, s, self.post)
        self.by_rank = (p, self.lead, s, self.post)
        # Rank-major scratch is allocated in the shape its copy uses.
        self.scratch_shape = self.by_rank if self.even else (self.total,)


def _pack(flat: Any, x: Any, b: _Blocks) -> None:
    """Copy ``x``'s blocks rank-major into the scratch ``flat`` (any layout; casts)."""
    if b.even:
        # One strided copy into the (rank, lead, s, post) scratch (a reshape of a
        # non-contiguous x copies first).
        flat[...] = x.reshape(b.by_axis).transpose(1, 0, 2, 3)
        return
    x3 = x.reshape(b.lead, b.n, b.post)
    for q in range(len(b.sizes)):
        o, s, d = b.offsets[q], b.sizes[q], b.displs[q]
        flat[d:d + b.counts[q]].reshape(b.lead, s, b.post)[...] = x3[:, o:o + s]


def _unpack(dest: Any, flat: Any, b: _Blocks) -> None:
    """Copy the rank-major blocks of the scratch ``flat`` into the C-contiguous ``dest``."""
    if b.even:
        dest.reshape(b.by_axis)[...] = flat.transpose(1, 0, 2, 3)
        return
    d3 = dest.reshape(b.lead, b.n, b.post)
    for q in range(len(b.sizes)):
        o, s, d = b.offsets[q], b.sizes[q], b.displs[q]
        d3[:, o:o + s] = flat[d:d + b.counts[q]].reshape(b.lead, s, b.post)


class _Plan:
    """What a collective needs that depends only on metadata, computed once per key."""

    __slots__ = ("out_shape", "mpi_type", "send", "recv", "op", "fast", "send_key", "recv_key")

    def __init__(self, out_shape: tuple[int, ...], mpi_type: MPI.Datatype, dtype: np.dtype,
                 send: _Blocks | None, recv: _Blocks | None) -> None:
        self.out_shape = out_shape
        self.mpi_type = mpi_type
        self.send = send    # how the input splits into rank blocks, if it does
        self.recv = recv    # how the result joins rank blocks, if it does
        self.op: MPI.Op | None = None  # reductions only
        self.fast = False   # whether the plain (non-v) or inline NumPy path applies
        # Keys of the NumPy scratch buffers (see _scratch), built once.
        self.send_key = send and ("send", send.scratch_shape, dtype, True)
        self.recv_key = recv and ("recv", recv.scratch_shape, dtype, True)


def _remember(self: Any, keys: tuple, plan: _Plan) -> _Plan:
    if len(self._plans) >= _MAX_PLANS:
        self._plans.clear()
    for key in keys:
        self._plans[key] = plan
    return plan


# --------------------------------------------------------------------------- arguments


def _normalize_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for an array of {ndim} "
                         f"dimension{'s' if ndim != 1 else ''}")
    return axis + ndim if axis < 0 else axis


def _agree_extents(group: Any, x: Any, axis: int, timeout: float | None,
                   what: str) -> tuple[int, ...]:
    """Every rank's extent along ``axis``, from one small Allgather.

    The same message carries a fingerprint of the other dimensions and the
    dtype, so ranks that disagree on them fail here (on every rank) instead of
    exchanging mismatched counts.
    """
    others = x.shape[:axis] + x.shape[axis + 1:]
    # Hashes of ints are the same in every process (those of str are salted).
    mine = np.array([x.shape[axis], hash((others, x.dtype.num, x.dtype.itemsize)) & (2**62 - 1)],
                    np.int64)
    table = np.empty((group.size, 2), np.int64)
    if timeout is None:
        group.comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    else:
        start = time.monotonic()
        debug.wait(group.comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]),
                   f"{what} (agreeing sizes)", group, timeout, start)
    differ = [r for r in range(group.size) if table[r, 1] != table[0, 1]]
    if differ:
        raise ValueError(f"{what} on group {group.name!r}: ranks {differ} disagree with rank 0 "
                         f"on the dtype or on the dimensions other than axis {axis} (this rank: "
                         f"shape {tuple(x.shape)}, {x.dtype}); PYMPAR_DEBUG=1 shows every rank's")
    return tuple(table[:, 0].tolist())


def _resolve_sizes(self: Any, sizes: Any, x: Any, axis: int, timeout: float | None,
                   what: str) -> tuple[int, ...]:
    extent = x.shape[axis]
    if sizes is None:
        return (extent,) if self.size == 1 else _agree_extents(self, x, axis, timeout, what)
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != self.size or sizes[self.rank] != extent:
        raise ValueError(f"{what} on group {self.name!r}: sizes {sizes} do not fit "
                         f"{self.size} ranks with this rank ({self.rank}) holding {extent}")
    return sizes


def _bad_out(out: Any, x: Any, shape: tuple[int, ...], what: str) -> None:
    if type(out) is not type(x):
        raise TypeError(f"{what}: out is a {type(out).__module__}.{type(out).__name__}, "
                        f"the input a {type(x).__module__}.{type(x).__name__}")
    raise ValueError(f"{what}: out has shape {out.shape} and dtype {out.dtype}, "
                     f"expected {shape} and {x.dtype}")


def _solo(x: Any, out: Any) -> Any:
    """A group of one rank: the result is the input."""
    if out is None:
        return x.copy()
    out[...] = x
    return out


def _output(self: Any, out: Any, x: Any, shape: tuple[int, ...], what: str) -> Any:
    """Checked ``out``, or a new array, as the C-contiguous array to write."""
    if out is None:
        return (np.empty if type(x) is _ndarray else _xp(x).empty)(shape, x.dtype)
    if type(out) is not type(x) or out.shape != shape or out.dtype != x.dtype:
        _bad_out(out, x, shape, what)
    if out.flags.c_contiguous:
        return out
    return _temp(self, "dest", shape, x.dtype, _xp(x))


def _scratch(self: Any, slot: str, dtype: np.dtype, b: _Blocks, like: Any) -> Any:
    """The group's cached rank-major scratch for blocks ``b`` (module of ``like``)."""
    numpy = type(like) is _ndarray
    return _cached(self, (slot, b.scratch_shape, dtype, numpy), b.scratch_shape, dtype,
                   np if numpy else _xp(like))


def _done(out: Any, dest: Any) -> Any:
    if out is None or dest is out:
        return dest
    out[...] = dest  # a non-contiguous out, written once at the end
    return out
