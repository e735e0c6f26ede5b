"""Positioned reads and writes of one rank's block of a C-order ``.npy`` file.

A block of the full array is a box (a tuple of slices). In the C-order file it is a set of
equally long contiguous byte runs; :func:`box_runs` lists them without a Python loop over
elements. Data moves in chunks along the box's first axis through one reusable host buffer,
or straight from/into the caller's array when that chunk is already contiguous host memory
of the stored dtype, so a save or load needs at most one buffer (or one slab of the first
axis, if larger) beyond the arrays themselves.

Every byte written or read is fed to a checksum tally (:mod:`pympar.checkpoint.checksums`)
in pieces of :data:`PIECE_BYTES`, each hashed right before it is written or right after it
is read, while it is in the CPU's cache: the data are never read a second time to be
verified. (A helper thread for the hashes measured slower: with every core busy reading,
it only adds hand-offs of the GIL.)
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from typing import Any

import numpy as np

from ..backend import is_cupy_array
from ..partition import block_slice

__all__ = ["Buffer", "box_runs", "replica_share", "write_box", "write_range", "read_box",
           "read_range", "file_reader", "pwrite_all", "pread_all", "start_writeback"]

#: Runs shorter than this many bytes are read as one span per chunk.
SHORT_RUN = 64 * 1024
#: Data are hashed and written, or read and hashed, in pieces of this many bytes (aligned in
#: the file's data): a piece is still in the cache when it is hashed. (Reads of 64 KiB to
#: 4 MiB pieces, interleaved in one process: 1 MiB read fastest with its hash.)
PIECE_BYTES = 2**20
Box = tuple  # tuple of slices over the full shape


class Buffer:
    """One reusable host staging buffer of ``nbytes`` bytes (default 8 MiB)."""

    def __init__(self, nbytes: int = 8 * 2**20) -> None:
        self.nbytes = int(nbytes)
        self._raw = np.empty(0, dtype=np.uint8)

    def view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` over the buffer (grown if one slab needs more)."""
        need = math.prod(shape) * dtype.itemsize
        if self._raw.size < need:
            self._raw = np.empty(max(need, min(self.nbytes, need * 4)), dtype=np.uint8)
        return self._raw[:need].view(dtype).reshape(shape)


def box_runs(shape: tuple[int, ...], box: Box) -> tuple[np.ndarray, int]:
    """Element offsets of the contiguous C-order runs covering ``box``, and their length.

    The innermost axes that the box spans completely merge into each run; the offsets are
    computed with broadcasting, one per combination of the remaining outer indices.
    """
    extents = [s.stop - s.start for s in box]
    if not shape:
        return np.zeros(1, dtype=np.int64), 1
    if 0 in extents:
        return np.zeros(0, dtype=np.int64), 0
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    j = len(shape) - 1
    while j > 0 and extents[j] == shape[j]:
        j -= 1
    length = extents[j] * strides[j]
    starts = np.array(sum(s.start * st for s, st in zip(box, strides)), dtype=np.int64)
    for k in range(j):
        starts = starts[..., None] + np.arange(extents[k], dtype=np.int64) * strides[k]
    return starts.reshape(-1), length


def replica_share(box: Box, count: int, index: int) -> Box | None:
    """Part ``index`` of ``count`` of a box that ``count`` ranks hold identically.

    Cut along the outermost axis at least ``count`` long (runs stay long); failing that the
    outermost longer than 1, where some replicas get nothing. ``None``: nothing at all (a
    single element belongs to the first replica).
    """
    if count == 1:
        return box
    extents = [s.stop - s.start for s in box]
    axes = [a for a, n in enumerate(extents) if n >= count] or \
        [a for a, n in enumerate(extents) if n > 1]
    if not axes:  # a single element (or a 0-d array): the first replica writes it
        return box if index == 0 else None
    a = axes[0]
    part = block_slice(extents[a], count, index)
    cut = slice(box[a].start + part.start, box[a].start + part.stop)
    return box[:a] + (cut,) + box[a + 1:]


def _host_chunk(src: Any, buffer: Buffer, dtype: np.dtype) -> np.ndarray:
    """``src`` as C-contiguous host memory of ``dtype``: itself when it already is, else a copy
    in the buffer (CuPy arrays are staged chunk by chunk)."""
    if is_cupy_array(src):
        import cupy

        out = buffer.view(tuple(src.shape), dtype)
        # ascontiguousarray makes a 0-d array 1-d: the reshape keeps the shapes equal.
        cupy.ascontiguousarray(src).reshape(out.shape).get(out=out)
        return out
    if src.flags.c_contiguous and src.dtype == dtype:
        return src
    out = buffer.view(tuple(src.shape), dtype)
    np.copyto(out, src)
    return out


def _chunks(box: Box, extents: list[int], itemsize: int, buffer: Buffer,
            span: tuple[int, ...] | None = None):
    """Sub-boxes of ``box`` along its first axis, each about one buffer (at least one slab).

    With ``span`` (the full shape) a slab is sized by the file bytes it spans, not its own.
    """
    if not extents:
        yield 0, 1, box
        return
    inner = span[1:] if span is not None and len(extents) > 1 else extents[1:]
    slab = max(math.prod(inner) * itemsize, 1)
    rows = max(buffer.nbytes // slab, 1)
    for r0 in range(0, extents[0], rows):
        r1 = min(r0 + rows, extents[0])
        yield r0, r1, (slice(box[0].start + r0, box[0].start + r1),) + tuple(box[1:])


def write_box(fd: int, data_offset: int, shape: tuple[int, ...], box: Box, src: Any,
              dtype: np.dtype, buffer: Buffer, tally: Any) -> None:
    """Write ``src`` (the box's values, any layout, NumPy or CuPy) into its runs of the file.

    ``dtype`` is the stored dtype (``src`` must already have its kind, e.g. bfloat16 viewed
    as uint16; only the byte order may differ); every written byte is fed to ``tally``
    (:func:`write_range`). Chunks that are C-contiguous host memory of ``dtype`` are written
    straight from ``src``, others through the buffer. A contiguous chunk's write-back to the
    disk is started as soon as it is written, so the disk works while later chunks are
    copied.
    """
    extents = [s.stop - s.start for s in box]
    for r0, r1, sub in _chunks(box, extents, dtype.itemsize, buffer):
        starts, length = box_runs(shape, sub)
        if not len(starts):
            continue
        part = src[r0:r1] if extents else src
        flat = memoryview(_host_chunk(part, buffer, dtype)).cast("B")
        nbytes = length * dtype.itemsize
        offsets = (starts * dtype.itemsize).tolist()
        for k, offset in enumerate(offsets):
            write_range(fd, data_offset, offset, flat[k * nbytes:(k + 1) * nbytes], tally)
        if len(offsets) == 1:  # a span with gaps holds other ranks' runs: its pages, written
            start_writeback(fd, data_offset + offsets[0], nbytes)  # back now, would go twice


def write_range(fd: int, data_offset: int, start: int, data: memoryview, tally: Any) -> None:
    """Write ``data`` at data byte ``start``, in pieces of :data:`PIECE_BYTES` (aligned in
    the data), each fed to ``tally`` first."""
    pos, n = 0, len(data)
    while pos < n:
        stop = min(n, ((start + pos) // PIECE_BYTES + 1) * PIECE_BYTES - start)
        tally.feed(start + pos, data[pos:stop])
        pwrite_all(fd, data[pos:stop], data_offset + start + pos)
        pos = stop


def _feed_runs(tally: Any, flat: memoryview, offsets: list[int], nbytes: int,
               verify: tuple[int, int] | None, positions: list[int] | None = None) -> None:
    """Feed the runs of ``flat`` (run ``k`` at data byte ``offsets[k]``, found at byte
    ``positions[k]`` of ``flat``, else at ``k * nbytes``) to ``tally``, each cut to the data
    bytes ``verify`` (all when None)."""
    lo, hi = verify if verify is not None else (0, math.inf)
    for k, offset in enumerate(offsets):
        a, b = max(offset, lo), min(offset + nbytes, hi)
        if a < b:
            at = (k * nbytes if positions is None else positions[k]) + a - offset
            tally.feed(a, flat[at:at + b - a])


def _is_direct(part: Any, dtype: np.dtype) -> bool:
    return isinstance(part, np.ndarray) and part.flags.c_contiguous and part.dtype == dtype


def _sync_file_range() -> Any:
    """Linux's ``sync_file_range`` through ctypes, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` to the disk, not waiting.

    Only a hint that overlaps the disk's work with the rest of a save (without it the dirty
    pages wait for the final ``fsync``); durability still comes from that ``fsync``.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def read_range(fd: int, data_offset: int, start: int, into: memoryview, tally: Any = None,
               verify: tuple[int, int] | None = None) -> None:
    """Read data bytes ``[start, start + len(into))`` of the file straight into ``into``.

    Pieces of :data:`PIECE_BYTES` (aligned in the data) are fed to ``tally`` as they arrive,
    cut to the data bytes ``verify`` (all when None); no tally, nothing is fed.
    """
    pos, n = 0, len(into)
    lo, hi = verify if verify is not None else (start, start + n)
    while pos < n:
        stop = min(n, ((start + pos) // PIECE_BYTES + 1) * PIECE_BYTES - start)
        pread_all(fd, into[pos:stop], data_offset + start + pos)
        a, b = max(start + pos, lo), min(start + stop, hi)
        if tally is not None and a < b:
            tally.feed(a, into[a - start:b - start])
        pos = stop


def read_box(fd: int, data_offset: int, shape: tuple[int, ...], box: Box, dst: Any,
             dtype: np.dtype, buffer: Buffer, tally: Any = None,
             verify: tuple[int, int] | None = None) -> None:
    """Read the box's runs of the file into ``dst`` (NumPy or CuPy, any layout).

    A box that is one contiguous run read into contiguous host memory of ``dtype`` goes
    straight into ``dst`` (:func:`read_range`). Otherwise chunks go straight into ``dst``
    when they are contiguous host memory of ``dtype``, else through the buffer. Short runs
    (narrow column blocks) are read as one span per chunk and the box is picked out of it
    with strides: one system call instead of one per run, at the price of reading the
    neighbours' bytes of that span. With ``tally``, the box's bytes within the data bytes
    ``verify`` (all when None) are fed to it as they are read.
    """
    extents = [s.stop - s.start for s in box]
    starts, length = box_runs(shape, box)
    if len(starts) == 1 and _is_direct(dst, dtype):
        read_range(fd, data_offset, int(starts[0]) * dtype.itemsize,
                   memoryview(dst).cast("B"), tally, verify)
        return
    strides = [math.prod(shape[k + 1:]) * dtype.itemsize for k in range(len(shape))]
    for r0, r1, sub in _chunks(box, extents, dtype.itemsize, buffer, span=shape):
        starts, length = box_runs(shape, sub)
        if not len(starts):
            continue
        part = dst[r0:r1] if extents else dst
        chunk_shape = tuple([r1 - r0] + extents[1:]) if extents else ()
        nbytes = length * dtype.itemsize
        offsets = (starts * dtype.itemsize).tolist()
        direct = _is_direct(part, dtype)
        if len(starts) > 1 and nbytes < SHORT_RUN:
            first = offsets[0]
            span = offsets[-1] + nbytes - first
            raw = buffer.view((span,), np.dtype(np.uint8))
            pread_all(fd, memoryview(raw), data_offset + first)
            if tally is not None:
                _feed_runs(tally, memoryview(raw), offsets, nbytes, verify,
                           [o - first for o in offsets])
            # The span starts at the chunk's first element: the full array's strides pick it.
            host = np.lib.stride_tricks.as_strided(raw.view(dtype), chunk_shape, strides,
                                                   writeable=False)
        else:
            host = part if direct else buffer.view(chunk_shape, dtype)
            flat = memoryview(host).cast("B")
            for k, offset in enumerate(offsets):
                pread_all(fd, flat[k * nbytes:(k + 1) * nbytes], data_offset + offset)
            if tally is not None:
                _feed_runs(tally, flat, offsets, nbytes, verify)
            if direct:
                continue
        if is_cupy_array(part):
            import cupy

            part[...] = cupy.asarray(host)  # np.ascontiguousarray would make a 0-d host 1-d
        else:
            part[...] = host


def file_reader(fd: int, data_offset: int, buffer: Buffer) -> Any:
    """``read(offset, nbytes)``: up to ``nbytes`` data bytes of the file from ``offset``,
    read into the buffer (a memoryview of it)."""
    def read(offset: int, nbytes: int) -> memoryview:
        into = memoryview(buffer.view((min(nbytes, buffer.nbytes),), np.dtype(np.uint8)))
        pread_all(fd, into, data_offset + offset)
        return into
    return read


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def pread_all(fd: int, into: memoryview, offset: int) -> None:
    """Fill all of ``into`` from ``offset`` (``EOFError`` where the file ends first)."""
    while len(into):
        got = os.preadv(fd, [into], offset)
        if got == 0:
            raise EOFError(f"file ends at byte {offset}")
        into, offset = into[got:], offset + got
