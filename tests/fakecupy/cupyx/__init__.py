"""``cupyx`` of the CuPy stand-in: pinned host memory (plain NumPy arrays, as in CuPy),
with the bytes still held counted so tests can see a pool released."""

from __future__ import annotations

import weakref
from typing import Any

import numpy

#: Bytes of pinned arrays that are still alive.
live_bytes = 0


def _freed(nbytes: int) -> None:
    global live_bytes
    live_bytes -= nbytes


def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> numpy.ndarray:
    global live_bytes
    out = numpy.empty(shape, dtype, order=order)
    live_bytes += out.nbytes
    weakref.finalize(out, _freed, out.nbytes)
    return out


def zeros_pinned(shape: Any, dtype: Any = float, order: str = "C") -> numpy.ndarray:
    out = empty_pinned(shape, dtype, order)
    out[...] = 0
    return out
