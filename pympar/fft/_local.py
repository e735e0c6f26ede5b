"""The transforms each rank makes on its own block: NumPy's, or CuPy's for CuPy arrays.

NumPy (2.x) and ``scipy.fft`` run the same C++ pocketfft; on the test VM (``benchmarks/
bench_fft.py --local``) they were within a few per cent of each other at ``workers=1`` on the
slab's shapes, so pympar uses NumPy: no extra dependency, and never more than one thread per
rank (NumPy's FFT has no thread pool; SciPy's would need ``workers=1`` on every call).

The adjoint of every 1-D stage is the inverse stage with the swapped ``norm``
(:data:`ADJOINT_NORM`); for the real transforms it also halves (r2c) or doubles (c2r) the
modes that stand for two conjugate coefficients (:func:`hermitian_weights`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Sequence

import numpy

from .. import backend

__all__ = ["fft_module", "ADJOINT_NORM", "NORMS", "c2c", "r2c", "c2r", "scale_conjugate_pairs"]

#: The ``norm=`` values NumPy accepts (None is ``"backward"``).
NORMS = (None, "backward", "ortho", "forward")

#: The norm whose inverse transform is the adjoint of a transform under this norm.
ADJOINT_NORM = {None: "forward", "backward": "forward", "forward": "backward", "ortho": "ortho"}


def fft_module(x: Any) -> ModuleType:
    """``numpy.fft`` for NumPy arrays, ``cupy.fft`` for CuPy arrays."""
    if type(x) is numpy.ndarray:
        return numpy.fft
    return backend.array_module(x).fft


def c2c(x: Any, axes: Sequence[int], norm: str | None, inverse: bool) -> Any:
    """Complex transform of ``x`` over ``axes`` (a new array)."""
    if not axes:
        return x
    fft = fft_module(x)
    return (fft.ifftn if inverse else fft.fftn)(x, axes=tuple(axes), norm=norm)


def r2c(x: Any, axes: Sequence[int], norm: str | None) -> Any:
    """Real-to-complex transform over ``axes``, the real one along ``axes[-1]``."""
    return fft_module(x).rfftn(x, axes=tuple(axes), norm=norm)


def c2r(x: Any, axes: Sequence[int], lengths: Sequence[int], norm: str | None) -> Any:
    """Complex-to-real transform over ``axes`` with real lengths ``lengths``."""
    return fft_module(x).irfftn(x, s=tuple(lengths), axes=tuple(axes), norm=norm)


def scale_conjugate_pairs(x: Any, axis: int, n: int, factor: float) -> None:
    """Multiply, in place, the modes of a half spectrum of real length ``n`` (along ``axis``,
    whole here) that stand for a conjugate pair: all but 0 and, for even ``n``, ``n // 2``.

    ``factor`` 0.5 turns the adjoint of ``rfft`` into ``irfft`` with the adjoint norm; 2 turns
    that of ``irfft`` into ``rfft``.
    """
    index = [slice(None)] * x.ndim
    index[axis] = slice(1, (n + 1) // 2)
    x[tuple(index)] *= factor
