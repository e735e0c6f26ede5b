"""pympar.checkpoint.files.write_box on one process: bytes and Adler-32 against a serial write.

The boxes of a full array are written in small buffer-fulls, straight from the array
(contiguous row blocks), through the buffer (column blocks, byte-swapped or Fortran-ordered
sources), with the checksum on a helper thread or inline. The file must equal the array's
bytes and the assembled checksum ``zlib.adler32`` of them, whatever the order of the boxes.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pympar.checkpoint.files import Buffer, adler_total, write_box
from pympar.partition import block_slice

SHAPE = (37, 24)


def boxes(kind):
    """Boxes tiling SHAPE: row blocks (contiguous runs) or column blocks (short runs)."""
    axis = 0 if kind == "rows" else 1
    out = []
    for i in (2, 0, 1):  # out of order: the contributions must not depend on it
        cut = block_slice(SHAPE[axis], 3, i)
        out.append((cut, slice(0, SHAPE[1])) if axis == 0 else (slice(0, SHAPE[0]), cut))
    return out


@pytest.mark.parametrize("kind", ["rows", "cols"])
@pytest.mark.parametrize("source", ["c", "fortran", "swapped"])
@pytest.mark.parametrize("threaded", [False, True])
def test_write_box_bytes_and_checksum(kind, source, threaded):
    full = np.random.default_rng(3).standard_normal(SHAPE).astype("<f8")
    stored = np.dtype("<f8")
    sums = np.zeros(2, dtype=np.int64)
    buffer = Buffer(5 * SHAPE[1] * 8)  # a few rows per chunk: many chunks per box
    with tempfile.TemporaryDirectory() as tmp, \
            ThreadPoolExecutor(1) as pool:
        path = os.path.join(tmp, "f")
        fd = os.open(path, os.O_CREAT | os.O_RDWR)
        try:
            os.ftruncate(fd, 3 + full.nbytes)  # 3 bytes of "header": odd data offsets
            for box in boxes(kind):
                block = full[box]
                src = {"c": np.ascontiguousarray(block), "fortran": np.asfortranarray(block),
                       "swapped": block.astype(">f8")}[source]
                write_box(fd, 3, SHAPE, box, src, stored, buffer, sums,
                          pool if threaded else None)
            data = os.pread(fd, full.nbytes + 16, 3)
        finally:
            os.close(fd)
    assert data == full.tobytes()
    assert adler_total(sums % 65521, full.nbytes) == zlib.adler32(data)
