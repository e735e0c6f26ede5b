"""Two-phase writes: ranks trade their blocks for row slabs, then each writes one range.

A block split along a trailing axis (a Row-parallel weight, a 3D block) lies in its C-order
file as one short run per row: thousands of small writes per rank, and pages that two ranks
write at once. For such a tensor the ranks first exchange data with one ``Alltoallw`` per
round, so that rank ``q`` holds a slab of whole rows of the full array (its balanced share
of the first axis, one staging buffer-full per round), and then write that slab with one
``os.pwrite`` -- MPI-IO's collective buffering, without MPI-IO. Subarray datatypes describe
both sides, so MPI reads the blocks where they lie and nothing is packed in Python. The
slab is the staging buffer, so the memory bound of a save does not change.

A load does not trade: on one node, ``Alltoallw`` over these datatypes measured several
times slower than each rank copying its block out of a mapping of the file (see
:func:`pympar.checkpoint.loading.read_files`).

Every rank decides alike from one all-gather of every rank's box (:func:`plan`); a
tensor whose blocks cannot be described this way (several pieces, as fused ``stride > 1``
weights have; CuPy arrays; a byte order other than the stored one) keeps the direct writes
of :func:`~pympar.checkpoint.files.write_box`.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
from mpi4py import MPI

from ..partition import block_slice
from .files import Buffer, start_writeback, write_range

__all__ = ["SHORT_RUN_BYTES", "plan", "write_slabs"]

#: Blocks whose file runs are shorter than this are exchanged instead of written in place.
SHORT_RUN_BYTES = 1 * 2**20
#: The predefined datatype moving one item of each size. Subarrays over them ran 3-4x faster
#: in ``Alltoallw`` (MPICH, one node) than over ``MPI.BYTE.Create_contiguous(itemsize)``.
_ITEM_TYPES = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}

Box = tuple  # tuple of slices over the full shape


def _runs_are_short(shape: tuple[int, ...], box: Box, itemsize: int) -> bool:
    """Whether ``box`` lies in the C-order file of ``shape`` as several runs, each shorter
    than :data:`SHORT_RUN_BYTES`."""
    extents = [s.stop - s.start for s in box]
    if 0 in extents:
        return False
    run = itemsize
    for axis in range(len(shape) - 1, -1, -1):
        run *= extents[axis]
        if extents[axis] != shape[axis]:
            break
    return run < SHORT_RUN_BYTES and run < math.prod(extents) * itemsize


def plan(comm: MPI.Intracomm, tensors: list[Any], blocks: list[list[tuple]],
         buffer_bytes: int) -> list[Any]:
    """Per tensor, every rank's ``(global box, local starts)`` to exchange, or None.

    ``blocks[i]`` is this rank's list of ``(global box, local box)`` pieces to write of
    tensor ``i`` (replica shares already cut). One all-gather of a fixed-size record per
    tensor (eligible, box bounds, local starts) tells every rank every other rank's box, so
    that the ranks agree on which tensors to exchange and build matching datatypes. A
    tensor whose full row exceeds ``buffer_bytes`` (the staging buffer a round fills) keeps
    the direct writes, so that a save never holds more than one buffer.
    """
    size = comm.Get_size()
    if size == 1:
        return [None] * len(tensors)
    widths = [1 + 3 * len(t.placement.shape) for t in tensors]
    mine = np.zeros(sum(widths), dtype=np.int64)
    at = 0
    for t, pieces, width in zip(tensors, blocks, widths):
        d = len(t.placement.shape)
        live = [(g, lo) for g, lo in pieces if math.prod(s.stop - s.start for s in g)]
        direct = (isinstance(t.array, np.ndarray) and t.array.flags.c_contiguous
                  and t.array.dtype == t.stored and t.array.ndim == d)
        # Subarray datatypes take int extents: a longer axis keeps the direct writes.
        fits = (max(t.placement.shape, default=0) < 2**31
                and math.prod(t.placement.shape[1:]) * t.stored.itemsize <= buffer_bytes)
        if d >= 2 and len(live) <= 1 and direct and fits:
            mine[at] = 1
            if live:
                g, lo = live[0]
                mine[at + 1:at + 1 + d] = [s.start for s in g]
                mine[at + 1 + d:at + 1 + 2 * d] = [s.stop for s in g]
                mine[at + 1 + 2 * d:at + width] = [s.start for s in lo]
        at += width
    every = np.empty((size, mine.size), dtype=np.int64)
    comm.Allgather(mine, every)
    out, at = [], 0
    for t, width in zip(tensors, widths):
        d, shape = len(t.placement.shape), t.placement.shape
        rows = every[:, at:at + width]
        at += width
        if not rows[:, 0].all():
            out.append(None)
            continue
        boxes = [(tuple(slice(int(a), int(b)) for a, b in zip(r[1:1 + d], r[1 + d:1 + 2 * d])),
                  tuple(int(v) for v in r[1 + 2 * d:])) for r in rows]
        short = any(_runs_are_short(shape, g, t.stored.itemsize) for g, _ in boxes)
        out.append(boxes if short else None)
    return out


def _subarray(base: MPI.Datatype, sizes: tuple[int, ...], box: Box,
              starts: tuple[int, ...]) -> MPI.Datatype:
    return base.Create_subarray(list(sizes), [s.stop - s.start for s in box], list(starts),
                                order=MPI.ORDER_C).Commit()


def _overlap(box: Box, lo: int, hi: int) -> Box | None:
    """``box`` cut to rows ``[lo, hi)`` of the first axis; None when nothing is left."""
    a, b = max(box[0].start, lo), min(box[0].stop, hi)
    if a >= b or any(s.stop <= s.start for s in box[1:]):
        return None
    return (slice(a, b),) + tuple(box[1:])


def _rounds(comm: MPI.Intracomm, t: Any, boxes: list,
            buffer: Buffer) -> Iterator[tuple[int, int, np.ndarray, list, list, list]]:
    """The exchange rounds of tensor ``t``: ``(lo, hi, slab, block_types, slab_types,
    counts)`` per round, this rank's rows ``[lo, hi)`` in ``slab`` (a view of the buffer).

    ``block_types[q]`` picks, in this rank's array, its part of rank ``q``'s rows;
    ``slab_types[q]`` picks, in the slab, rank ``q``'s part of this rank's rows; ``counts``
    (block side, slab side) say which are not empty. The datatypes are freed after the
    round.
    """
    shape, itemsize = t.placement.shape, t.stored.itemsize
    size, rank = comm.Get_size(), comm.Get_rank()
    row_bytes = math.prod(shape[1:]) * itemsize
    rows_per_round = max(buffer.nbytes // max(row_bytes, 1), 1)  # plan(): a row fits
    domains = [block_slice(shape[0], size, q) for q in range(size)]
    rounds = max(math.ceil((d.stop - d.start) / rows_per_round) for d in domains)
    base = _ITEM_TYPES.get(itemsize) or MPI.BYTE.Create_contiguous(itemsize).Commit()
    mine, my_starts = boxes[rank]
    local_shape = tuple(t.array.shape)
    try:
        for k in range(rounds):
            chunks = [(d.start + k * rows_per_round,
                       min(d.stop, d.start + (k + 1) * rows_per_round)) for d in domains]
            lo, hi = chunks[rank]
            slab = buffer.view((max(hi - lo, 0),) + tuple(shape[1:]), t.stored)
            block_types, slab_types, made = [], [], []
            for q in range(size):
                part = _overlap(mine, *chunks[q])
                if part is None:
                    block_types.append(base)
                else:
                    starts = [o + s.start - m.start for o, s, m in zip(my_starts, part, mine)]
                    block_types.append(_subarray(base, local_shape, part, starts))
                    made.append(block_types[-1])
                theirs = _overlap(boxes[q][0], lo, hi)
                if theirs is None:
                    slab_types.append(base)
                else:
                    starts = [theirs[0].start - lo] + [s.start for s in theirs[1:]]
                    slab_types.append(_subarray(base, slab.shape, theirs, starts))
                    made.append(slab_types[-1])
            counts = ([int(ty is not base) for ty in block_types],
                      [int(ty is not base) for ty in slab_types])
            try:
                yield lo, hi, slab, block_types, slab_types, counts
            finally:
                for ty in made:
                    ty.Free()
    finally:
        if itemsize not in _ITEM_TYPES:
            base.Free()


def write_slabs(comm: MPI.Intracomm, fd: int | None, data_offset: int, t: Any, boxes: list,
                buffer: Buffer, tally: Any) -> BaseException | None:
    """Exchange tensor ``t``'s blocks for row slabs and write this rank's slabs; collective.

    ``boxes`` is :func:`plan`'s entry for ``t``; ``fd`` the open file (None when this rank
    has no rows to write). Each round moves at most a buffer-full of rows into ``buffer``.
    The written slabs are fed to ``tally`` (each piece hashed right before it is written). A failed
    write does not stop this rank's part in the exchange (the others would wait): the first
    error is returned, to be agreed on afterwards.
    """
    row_bytes = math.prod(t.placement.shape[1:]) * t.stored.itemsize
    zeros = [0] * comm.Get_size()
    error: BaseException | None = None
    for lo, hi, slab, block_types, slab_types, counts in _rounds(comm, t, boxes, buffer):
        comm.Alltoallw([t.array, (counts[0], zeros), block_types],
                       [slab, (counts[1], zeros), slab_types])
        if hi > lo and fd is not None and error is None:
            try:
                flat = memoryview(slab).cast("B")
                write_range(fd, data_offset, lo * row_bytes, flat, tally)
                start_writeback(fd, data_offset + lo * row_bytes, len(flat))
            except Exception as err:  # noqa: BLE001 - reported after the exchange
                error = err
    return error
