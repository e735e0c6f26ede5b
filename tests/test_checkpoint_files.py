"""pympar.checkpoint.files and checksums on one process, against serial writes and hashes.

The boxes of a full array are written in small buffer-fulls, straight from the array
(contiguous row blocks), through the buffer (column blocks, byte-swapped or Fortran-ordered
sources), and read back the same ways. The file must
equal the array's bytes, and the chunk digests ``xxhash.xxh3_64`` of them (or the assembled
Adler-32, ``zlib.adler32``), whatever the order of the boxes and however the pieces fall
across chunk boundaries.
"""

from __future__ import annotations

import os
import tempfile
import zlib

import numpy as np
import pytest
import xxhash

from pympar.checkpoint import files
from pympar.checkpoint.checksums import AdlerSums, Chunks, adler_total
from pympar.checkpoint.files import Buffer, file_reader, read_box, write_box
from pympar.partition import block_slice

SHAPE = (37, 24)
CHUNK = 56  # bytes: 7 float64 values, so chunks begin inside rows and inside runs


def boxes(kind):
    """Boxes tiling SHAPE: row blocks (contiguous runs) or column blocks (short runs)."""
    axis = 0 if kind == "rows" else 1
    out = []
    for i in (2, 0, 1):  # out of order: the results must not depend on it
        cut = block_slice(SHAPE[axis], 3, i)
        out.append((cut, slice(0, SHAPE[1])) if axis == 0 else (slice(0, SHAPE[0]), cut))
    return out


def expected_digests(data):
    return {k // CHUNK: xxhash.xxh3_64_intdigest(data[k:k + CHUNK])
            for k in range(0, len(data), CHUNK)}


@pytest.mark.parametrize("kind", ["rows", "cols"])
@pytest.mark.parametrize("source", ["c", "fortran", "swapped"])
def test_write_box_bytes_and_checksum(kind, source, monkeypatch):
    monkeypatch.setattr(files, "PIECE_BYTES", 40)  # contiguous writes in pieces across chunks
    full = np.random.default_rng(3).standard_normal(SHAPE).astype("<f8")
    stored = np.dtype("<f8")
    buffer = Buffer(5 * SHAPE[1] * 8)  # a few rows per chunk: many chunks per box
    # One tally per box, as each box's writer (a rank) has its own: together they hash
    # every chunk once.
    tallies = [Chunks(full.nbytes, CHUNK) for _ in range(3)]
    adler = AdlerSums(full.nbytes)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f")
        fd = os.open(path, os.O_CREAT | os.O_RDWR)
        try:
            os.ftruncate(fd, 3 + full.nbytes)  # 3 bytes of "header": odd data offsets
            for box, tally in zip(boxes(kind), tallies):
                block = full[box]
                src = {"c": np.ascontiguousarray(block), "fortran": np.asfortranarray(block),
                       "swapped": block.astype(">f8")}[source]
                write_box(fd, 3, SHAPE, box, src, stored, buffer, tally)
                write_box(fd, 3, SHAPE, box, src, stored, buffer, adler)
            for tally in tallies:
                tally.finish(file_reader(fd, 3, buffer))
            data = os.pread(fd, full.nbytes + 16, 3)
        finally:
            os.close(fd)
    assert data == full.tobytes()
    got = {}
    for tally in tallies:
        assert not set(got) & set(tally.digests)  # each chunk hashed by one writer
        got.update(tally.digests)
    assert got == expected_digests(data)
    assert adler_total(adler.sums, full.nbytes) == zlib.adler32(data)


@pytest.mark.parametrize("kind", ["rows", "cols"])
@pytest.mark.parametrize("target", ["c", "fortran", "swapped"])
def test_read_box_values_and_checksum(kind, target, monkeypatch):
    monkeypatch.setattr(files, "PIECE_BYTES", 40)  # contiguous reads in pieces across chunks
    full = np.random.default_rng(4).standard_normal(SHAPE).astype("<f8")
    stored = np.dtype("<f8")
    buffer = Buffer(3 * SHAPE[1] * 8)
    tallies = [Chunks(full.nbytes, CHUNK) for _ in range(3)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f")
        with open(path, "wb") as f:
            f.write(b"abc" + full.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            for box, tally in zip(boxes(kind), tallies):
                shape = tuple(s.stop - s.start for s in box)
                dst = {"c": np.zeros(shape), "fortran": np.zeros(shape, order="F"),
                       "swapped": np.zeros(shape, dtype=">f8")}[target]
                read_box(fd, 3, SHAPE, box, dst, stored, buffer, tally)
                tally.finish(file_reader(fd, 3, buffer))
                assert np.array_equal(dst, full[box])
        finally:
            os.close(fd)
    got = {}
    for tally in tallies:
        assert not set(got) & set(tally.digests)
        got.update(tally.digests)
    assert got == expected_digests(full.tobytes())


def test_chunks_from_pieces_in_any_order():
    """Pieces of a byte string fed to three tallies in a shuffled order: every chunk is
    hashed exactly once, by the tally holding its first byte, equal to a serial hash."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    cuts = np.sort(rng.choice(np.arange(1, 1000), 40, replace=False))
    pieces = list(zip([0, *cuts], [*cuts, 1000]))
    owner = rng.integers(0, 3, len(pieces))
    tallies = [Chunks(len(data), CHUNK) for _ in range(3)]
    for k in rng.permutation(len(pieces)):
        a, b = pieces[k]
        tallies[owner[k]].feed(int(a), memoryview(data)[a:b])
    for tally in tallies:
        tally.finish(lambda offset, n: memoryview(data)[offset:offset + min(n, 17)])
    counts = {}
    for tally in tallies:
        for j, digest in tally.digests.items():
            counts[j] = counts.get(j, 0) + 1
            assert digest == xxhash.xxh3_64_intdigest(data[j * CHUNK:(j + 1) * CHUNK])
    assert counts == {j: 1 for j in range(-(-len(data) // CHUNK))}


@pytest.mark.parametrize("value", [
    ["0123456789abcdef"],  # one digest short
    ["0123456789abcde", "f0123456789abcdef"],  # the right total length, entries of 15 and 17
    ["0123456789abcdef", 5],  # not a string
    ["0123456789abcdef", b"0123456789abcdef"],  # bytes, not a string
    "0123456789abcdef0123456789abcdef",  # a string, not a list
    ["0123456789ABCDEF", "0123456789abcdef"],  # upper case
    ["0123456789abcde ", "0123456789abcdef"],  # a space
])
def test_manifest_digests_are_refused_unless_count_lowercase_hex_strings(value):
    from pympar.checkpoint.format import CheckpointError, _parse_digests

    with pytest.raises(CheckpointError, match="'t': 'xxh3_64'"):
        _parse_digests(value, 2, "t")


def test_manifest_digests_parse_as_big_endian_hex():
    from pympar.checkpoint.format import _parse_digests

    got = _parse_digests(["0123456789abcdef", "00000000000000ff"], 2, "t")
    assert got.dtype == np.uint64 and got.tolist() == [0x0123456789ABCDEF, 255]
    assert _parse_digests([], 0, "t").size == 0
