"""Positioned reads and writes of one rank's block of a C-order ``.npy`` file.

A block of the full array is a box (a tuple of slices). In the C-order file it is a set of
equally long contiguous byte runs; :func:`box_runs` lists them without a Python loop over
elements. Data moves in chunks along the box's first axis through one reusable host buffer,
or straight from/into the caller's array when that chunk is already contiguous host memory
of the stored dtype, so a save or load needs at most one buffer (or one slab of the first
axis, if larger) beyond the arrays themselves.

The checksum is Adler-32 of a file's data bytes (everything after the header), the value
``zlib.adler32(data)`` of a serial reader. Adler-32 can be assembled from pieces computed
anywhere: a run of ``L`` bytes at offset ``o`` of ``N`` data bytes with Adler sums
``(a, b)`` adds ``a - 1`` to the total's ``A`` and ``(N - o - L)(a - 1) + b - L`` to its
``B`` (mod 65521). Each rank sums over the runs it owns; one all-reduce adds the ranks.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import zlib
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ..backend import is_cupy_array
from ..partition import block_slice

__all__ = ["ADLER_MOD", "Buffer", "box_runs", "replica_share", "write_box", "read_box",
           "checksum_range", "adler_part", "adler_total", "pwrite_all", "start_writeback"]

ADLER_MOD = 65521
#: Runs shorter than this many bytes are read as one span per chunk.
SHORT_RUN = 64 * 1024
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
        out = buffer.view(tuple(src.shape), dtype)
        src.get(out=out)  # CuPy makes it contiguous itself (ascontiguousarray makes 0-d 1-d)
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


def adler_part(data: Any, offset: int, total: int) -> tuple[int, int]:
    """Contribution of ``data`` at byte ``offset`` to the Adler-32 sums of ``total`` bytes."""
    value = zlib.adler32(data)
    a, b, n = value & 0xFFFF, value >> 16, len(data)
    return (a - 1) % ADLER_MOD, ((total - offset - n) * (a - 1) + b - n) % ADLER_MOD


def adler_total(parts: np.ndarray, total: int) -> int:
    """The Adler-32 value of ``total`` bytes from the summed contributions ``(A, B)``."""
    a = (1 + int(parts[0])) % ADLER_MOD
    b = (total + int(parts[1])) % ADLER_MOD
    return (b << 16) | a


def write_box(fd: int, data_offset: int, shape: tuple[int, ...], box: Box, src: Any,
              dtype: np.dtype, buffer: Buffer, sums: np.ndarray,
              checksums: Executor | None = None) -> None:
    """Write ``src`` (the box's values, any layout, NumPy or CuPy) into its runs of the file.

    ``dtype`` is the stored dtype (``src`` must already have its kind, e.g. bfloat16 viewed
    as uint16; only the byte order may differ); the Adler-32 contributions of the written
    bytes are added to ``sums`` (``[A, B]``). Chunks that are C-contiguous host memory of
    ``dtype`` are written straight from ``src``, others through the buffer. With
    ``checksums`` (one worker thread) a chunk's checksum runs while it is being written:
    ``zlib`` and ``os.pwrite`` both release the GIL. A contiguous chunk's write-back to the
    disk is started as soon as it is written, so the disk works while later chunks are copied.
    """
    extents = [s.stop - s.start for s in box]
    total = math.prod(shape) * dtype.itemsize
    pending: list[Any] = []
    for r0, r1, sub in _chunks(box, extents, dtype.itemsize, buffer):
        starts, length = box_runs(shape, sub)
        if not len(starts):
            continue
        part = src[r0:r1] if extents else src
        if not _is_direct(part, dtype):  # the buffer is refilled: its checksum must be done
            _drain(pending, sums, 0)
        flat = memoryview(_host_chunk(part, buffer, dtype)).cast("B")
        nbytes = length * dtype.itemsize
        offsets = (starts * dtype.itemsize).tolist()
        if checksums is None:
            pending.append(_Done(_adler_runs(flat, offsets, nbytes, total)))
        else:
            pending.append(checksums.submit(_adler_runs, flat, offsets, nbytes, total))
        for k, offset in enumerate(offsets):
            pwrite_all(fd, flat[k * nbytes:(k + 1) * nbytes], data_offset + offset)
        if len(offsets) == 1:  # a span with gaps holds other ranks' runs: its pages, written
            start_writeback(fd, data_offset + offsets[0], nbytes)  # back now, would go twice
        _drain(pending, sums, 1)  # at most one checksum (of this chunk) left running
    _drain(pending, sums, 0)


class _Done:
    """A computed value with the interface of a finished future."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def _drain(pending: list[Any], sums: np.ndarray, leave: int) -> None:
    while len(pending) > leave:
        a, b = pending.pop(0).result()
        sums[0] += a
        sums[1] += b


def _is_direct(part: Any, dtype: np.dtype) -> bool:
    return isinstance(part, np.ndarray) and part.flags.c_contiguous and part.dtype == dtype


def _adler_runs(flat: memoryview, offsets: list[int], nbytes: int,
                total: int) -> tuple[int, int]:
    """Summed Adler-32 contributions of equal runs of ``flat`` at data byte ``offsets``."""
    a_sum = b_sum = 0
    for k, offset in enumerate(offsets):
        a, b = adler_part(flat[k * nbytes:(k + 1) * nbytes], offset, total)
        a_sum += a
        b_sum += b
    return a_sum % ADLER_MOD, b_sum % ADLER_MOD


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


def read_box(fd: int, data_offset: int, shape: tuple[int, ...], box: Box, dst: Any,
             dtype: np.dtype, buffer: Buffer) -> None:
    """Read the box's runs of the file into ``dst`` (NumPy or CuPy, any layout).

    Reads go straight into ``dst`` when a chunk of it is contiguous host memory of ``dtype``,
    else through the buffer. Short runs (narrow column blocks) are read as one span per
    chunk and the box is picked out of it with strides: one system call instead of one per
    run, at the price of reading the neighbours' bytes of that span.
    """
    extents = [s.stop - s.start for s in box]
    strides = [math.prod(shape[k + 1:]) * dtype.itemsize for k in range(len(shape))]
    for r0, r1, sub in _chunks(box, extents, dtype.itemsize, buffer, span=shape):
        starts, length = box_runs(shape, sub)
        if not len(starts):
            continue
        part = dst[r0:r1] if extents else dst
        chunk_shape = tuple([r1 - r0] + extents[1:]) if extents else ()
        nbytes = length * dtype.itemsize
        if len(starts) > 1 and nbytes < SHORT_RUN:
            first = int(starts[0]) * dtype.itemsize
            span = int(starts[-1]) * dtype.itemsize + nbytes - first
            raw = buffer.view((span,), np.dtype(np.uint8))
            _pread_all(fd, memoryview(raw), data_offset + first)
            # The span starts at the chunk's first element: the full array's strides pick it.
            host = np.lib.stride_tricks.as_strided(raw.view(dtype), chunk_shape, strides,
                                                   writeable=False)
        else:
            direct = (isinstance(part, np.ndarray) and part.flags.c_contiguous
                      and part.dtype == dtype)
            host = part if direct else buffer.view(chunk_shape, dtype)
            flat = memoryview(host).cast("B")
            for k, start in enumerate(starts.tolist()):
                _pread_all(fd, flat[k * nbytes:(k + 1) * nbytes],
                           data_offset + start * dtype.itemsize)
            if direct:
                continue
        if is_cupy_array(part):
            import cupy

            part[...] = cupy.asarray(host)  # np.ascontiguousarray would make a 0-d host 1-d
        else:
            part[...] = host


def checksum_range(fd: int, data_offset: int, start: int, stop: int, total: int,
                   buffer: Buffer, sums: np.ndarray) -> None:
    """Add the Adler-32 contributions of data bytes ``[start, stop)`` to ``sums``.

    Verification splits each file into one contiguous range per rank, whatever the layout.
    """
    for lo in range(start, stop, buffer.nbytes):
        hi = min(lo + buffer.nbytes, stop)
        raw = memoryview(buffer.view((hi - lo,), np.dtype(np.uint8)))
        _pread_all(fd, raw, data_offset + lo)
        a, b = adler_part(raw, lo, total)
        sums[0] += a
        sums[1] += b


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _pread_all(fd: int, into: memoryview, offset: int) -> None:
    while len(into):
        got = os.preadv(fd, [into], offset)
        if got == 0:
            raise EOFError(f"file ends at byte {offset}")
        into, offset = into[got:], offset + got
