"""Checksums of a checkpoint's files, computed on the bytes as they are written or read.

Format 2 stores the xxHash3-64 digest (``xxhash.xxh3_64``) of every :data:`CHUNK_BYTES`-long
chunk of a file's data bytes (everything after the ``.npy`` header; the last chunk may be
shorter). xxHash3 runs at memory speed (30-45 GB/s per core on cache-hot data on the 2-core
machine of the committed benchmarks, against 20 GB/s for hardware CRC-32C and 3 GB/s for
zlib's Adler-32), but a digest cannot be assembled from pieces hashed apart: so one per
chunk, and each chunk is hashed by the one rank that holds its first byte (:class:`Chunks`).
The bytes of a rank's chunk that another rank holds (at most one chunk per contiguous range
a rank holds) are read back from the file (:meth:`Chunks.finish`).

Format 1 stored Adler-32 of the whole data, which adds up from pieces hashed anywhere
(:class:`AdlerSums`): a run of ``L`` bytes at offset ``o`` of ``N`` data bytes with Adler sums
``(a, b)`` adds ``a - 1`` to the total's ``A`` and ``(N - o - L)(a - 1) + b - L`` to its
``B`` (mod 65521). Old checkpoints are still verified that way.

Either way every byte of a file is fed by exactly one rank (a save: what each rank writes;
a load: what each rank is assigned of what it reads), and a collective step compares.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np
import xxhash
from mpi4py import MPI

from .format import CHUNK_BYTES, CheckpointError, chunk_count

__all__ = ["ADLER_MOD", "Chunks", "AdlerSums", "adler_part", "adler_total", "gather_digests",
           "verdict"]

ADLER_MOD = 65521


class Chunks:
    """xxHash3-64 digests of the chunks whose first byte this rank feeds (one file).

    :meth:`feed` takes this rank's bytes of the file in pieces, in any order, each byte
    fed once across the ranks. A chunk that starts in a piece is this rank's: hashed at once
    when the piece holds all of it, else continued by the next piece if that one follows
    on, and otherwise completed by :meth:`finish` from the file.
    """

    def __init__(self, total: int, chunk: int = CHUNK_BYTES) -> None:
        self.total, self.chunk = int(total), int(chunk)
        self.digests: dict[int, int] = {}
        self._open: dict[int, tuple[Any, int]] = {}  # chunk -> (running hash, next offset)

    def feed(self, offset: int, data: memoryview) -> None:
        """Bytes ``data`` (a byte memoryview) at data offset ``offset``."""
        size, end = self.chunk, offset + len(data)
        j = offset // size
        if offset % size:  # the piece starts inside a chunk: continue it if it is ours
            running = self._open.get(j)
            if running is not None and running[1] == offset:
                stop = min((j + 1) * size, self.total)
                upto = min(stop, end)
                running[0].update(data[:upto - offset])
                if upto == stop:
                    self.digests[j] = running[0].intdigest()
                    del self._open[j]
                else:
                    self._open[j] = (running[0], upto)
            j += 1
        while j * size < end:  # chunks that start in this piece are ours
            start = j * size
            stop = min(start + size, self.total)
            if stop <= end:
                self.digests[j] = xxhash.xxh3_64_intdigest(data[start - offset:stop - offset])
            else:
                running = xxhash.xxh3_64()
                running.update(data[start - offset:])
                self._open[j] = (running, end)
            j += 1

    @property
    def incomplete(self) -> bool:
        """Whether a chunk of this rank still waits for bytes another rank holds."""
        return bool(self._open)

    fed_while_reading = True  # a load feeds the pieces it reads

    def complete(self, lo: int, hi: int, read: Callable[[int, int], memoryview]) -> None:
        """Hash every chunk that starts in data bytes ``[lo, hi)`` and is not hashed yet,
        reading what it lacks with ``read(offset, nbytes)``."""
        self.finish(read)
        size = self.chunk
        for j in range(-(-lo // size), -(-hi // size)):
            if j not in self.digests:
                running = xxhash.xxh3_64()
                self._open[j] = (running, j * size)
        self.finish(read)

    def finish(self, read: Callable[[int, int], memoryview]) -> None:
        """Complete the open chunks with ``read(offset, nbytes)`` (bytes from the file)."""
        for j, (running, at) in sorted(self._open.items()):
            stop = min((j + 1) * self.chunk, self.total)
            while at < stop:
                data = read(at, stop - at)
                running.update(data)
                at += len(data)
            self.digests[j] = running.intdigest()
        self._open.clear()


class AdlerSums:
    """Adler-32 contributions ``[A, B]`` of the bytes this rank feeds (format 1, one file)."""

    incomplete = False  # Adler-32 adds up from any pieces
    fed_while_reading = False  # a load sums its share of the bytes at the end, in one go

    def __init__(self, total: int) -> None:
        self.total = int(total)
        self.sums = np.zeros(2, dtype=np.int64)

    def feed(self, offset: int, data: memoryview) -> None:
        a, b = adler_part(data, offset, self.total)
        self.sums[0] = (self.sums[0] + a) % ADLER_MOD
        self.sums[1] = (self.sums[1] + b) % ADLER_MOD

    def finish(self, read: Callable[[int, int], memoryview]) -> None:
        """Nothing to complete: Adler-32 adds up from any pieces."""

    def complete(self, lo: int, hi: int, read: Callable[[int, int], memoryview]) -> None:
        """Add the contributions of data bytes ``[lo, hi)``, read with ``read``."""
        while lo < hi:
            data = read(lo, min(hi - lo, 2**24))
            self.feed(lo, data)
            lo += len(data)


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


def _chunk_offsets(tallies: list[Chunks]) -> np.ndarray:
    return np.cumsum([0] + [chunk_count(t.total, t.chunk) for t in tallies])


def gather_digests(comm: MPI.Intracomm, tallies: list[Chunks]) -> list[np.ndarray] | None:
    """Every file's digests on rank 0 (None elsewhere); collective.

    Each chunk's digest comes from the one rank that hashed it; a chunk hashed by no rank or
    by two (a bug, never the data) raises on every rank.
    """
    at = _chunk_offsets(tallies)
    digests = np.zeros(int(at[-1]), dtype=np.uint64)
    counts = np.zeros(int(at[-1]), dtype=np.int32)
    for i, t in enumerate(tallies):
        if t.digests:
            index = np.fromiter(t.digests, dtype=np.int64) + at[i]
            digests[index] = np.fromiter(t.digests.values(), dtype=np.uint64)
            counts[index] = 1
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    if not (counts == 1).all():
        raise CheckpointError("internal error: a checksum chunk was hashed by "
                              f"{int(counts[counts != 1][0])} ranks")
    rank0 = comm.Get_rank() == 0
    comm.Reduce(MPI.IN_PLACE if rank0 else digests, digests if rank0 else None, op=MPI.BOR,
                root=0)
    return [digests[at[i]:at[i + 1]] for i in range(len(tallies))] if rank0 else None


def verdict(comm: MPI.Intracomm, names: list[str], files: list[str], tallies: list[Any],
            expected: list[Any]) -> str | None:
    """The first corrupted file's message, the same on every rank, or None; collective.

    ``expected`` holds each file's digests (format 2, an array) or Adler-32 value (format 1).
    """
    if tallies and isinstance(tallies[0], AdlerSums):
        sums = np.array([t.sums for t in tallies], dtype=np.int64).reshape(len(tallies), 2)
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        bad = [i for i, t in enumerate(tallies)
               if adler_total(sums[i] % ADLER_MOD, t.total) != expected[i]]
        return None if not bad else (f"tensor {names[bad[0]]!r}: checksum mismatch in "
                                     f"{files[bad[0]]} (the file is corrupted)")
    at = _chunk_offsets(tallies)
    counts = np.zeros(int(at[-1]), dtype=np.int32)
    first = np.full(1, len(tallies), dtype=np.int64)
    for i, t in enumerate(tallies):
        if t.digests:
            index = np.fromiter(t.digests, dtype=np.int64)
            counts[index + at[i]] = 1
            got = np.fromiter(t.digests.values(), dtype=np.uint64)
            if (got != expected[i][index]).any() and first[0] == len(tallies):
                first[0] = i
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    comm.Allreduce(MPI.IN_PLACE, first, op=MPI.MIN)
    if not (counts == 1).all():
        return "internal error: a checksum chunk was verified by " \
            f"{int(counts[counts != 1][0])} ranks"
    i = int(first[0])
    return None if i == len(tallies) else (f"tensor {names[i]!r}: checksum mismatch in "
                                           f"{files[i]} (the file is corrupted)")
