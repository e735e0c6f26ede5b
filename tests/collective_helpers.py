"""Shared pieces of the collectives' and mappings' tests: dtypes, layouts, NumPy pieces, checks."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpi_helpers import agree, to_numpy
from pympar import backend

BF16 = backend.bfloat16
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)] + (
    [BF16] if BF16 is not None else [])
#: Relative tolerance of a sum of a few values rounded once to the dtype.
RTOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
LAYOUTS = ("C", "F", "strided")


def dtypes_for(xp: Any) -> list[np.dtype]:
    """The dtypes an array module can hold (CuPy 14 has bfloat16, through ml_dtypes)."""
    return [d for d in DTYPES if xp is np or d != BF16 or backend.device_has_bfloat16(xp)]


def layouts_for(xp: Any) -> tuple[str, ...]:
    """The layouts tested: all on NumPy; C and strided on CuPy, where a Fortran-ordered array
    takes the strided array's path (packing is module-agnostic and tested on NumPy)."""
    return LAYOUTS if xp is np else ("C", "strided")


def random(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Host array of ``dtype`` from a standard normal (exactly representable after the cast)."""
    return rng.standard_normal(shape).astype(dtype)


def laid_out(a: np.ndarray, layout: str, xp: Any) -> Any:
    """``a`` on ``xp`` as a C-ordered, Fortran-ordered or non-contiguous array."""
    if layout == "C" or not a.ndim:
        return xp.array(a, order="C")
    if layout == "F":
        return xp.array(a, order="F")
    big = xp.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
    view = big[..., 1::2]
    view[...] = xp.asarray(a)
    return view


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Extents of ``numpy.array_split`` of ``n`` items into ``parts`` (the sizes= argument)."""
    return tuple(len(block) for block in np.array_split(np.empty(n), parts))


def piece(a: np.ndarray, parts: int, axis: int, rank: int) -> np.ndarray:
    """This rank's block by the balanced rule."""
    return np.array_split(a, parts, axis=axis)[rank]


class Checks:
    """Collects failures on this rank; :meth:`done` agrees on them over WORLD."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def equal(self, actual: Any, expected: np.ndarray, what: str) -> None:
        """Bitwise equality of values, shape and dtype."""
        self.count += 1
        a = to_numpy(actual)
        if a.shape != expected.shape or a.dtype != expected.dtype \
                or a.tobytes() != np.ascontiguousarray(expected).tobytes():
            self.failures.append(f"{what}: got {a.dtype}{a.shape}, expected "
                                 f"{expected.dtype}{expected.shape}, values differ")

    def close(self, actual: Any, expected: np.ndarray, what: str, rtol: float | None = None) -> None:
        """Equal shape and dtype, values within the dtype's tolerance."""
        self.count += 1
        a = to_numpy(actual)
        rtol = RTOL[expected.dtype.name] if rtol is None else rtol
        if a.shape != expected.shape or a.dtype != expected.dtype:
            self.failures.append(f"{what}: got {a.dtype}{a.shape}, expected "
                                 f"{expected.dtype}{expected.shape}")
            return
        a64, e64 = a.astype(np.float64), expected.astype(np.float64)
        if not np.allclose(a64, e64, rtol=rtol, atol=rtol):
            err = float(np.max(np.abs(a64 - e64)))
            self.failures.append(f"{what}: max abs error {err:.3g} (rtol {rtol})")

    def true(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.failures.append(what)

    def done(self) -> None:
        agree(not self.failures, f"{len(self.failures)} of {self.count} checks failed: "
              + "; ".join(self.failures[:6]))
