"""The transforms each rank makes on its own block: SciPy's or NumPy's, CuPy's for CuPy arrays.

NumPy arrays go to ``scipy.fft`` with ``workers=1`` (one thread per rank) when SciPy is
installed, else to ``numpy.fft``. Why SciPy's: both run pocketfft, but SciPy's takes several
axes in one C++ call that vectorizes over the lines of strided axes, takes ``workers=1``
explicitly, and may overwrite the intermediate arrays pympar owns (``overwrite_x``), which
saves a copy per stage. On the shared 2-core test VM, best of 15 on a 128^3 slab's local
blocks, SciPy's ``rfftn`` over two axes took 0.64-0.89x NumPy's time and its ``irfftn``
0.8x; 1-D transforms were even; later runs under heavier load scattered both ways, so
``benchmarks/bench_fft.py`` re-measures all three libraries side by side (its ``local``
section) and :data:`LIBRARY` says which one ran. FFTW (mpi4py-fft's planner) took about half
pocketfft's time for the two-axis ``rfftn`` in the same runs: that, not the exchange, is what
separates pympar's round trip from mpi4py-fft's ``fftw`` backend.

The adjoint of every 1-D stage is the inverse stage with the swapped ``norm``
(:data:`ADJOINT_NORM`); for the real transforms it also halves (r2c) or doubles (c2r) the
modes that stand for two conjugate coefficients (:func:`scale_conjugate_pairs`).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Sequence

import numpy

from .. import backend

_UNLOADED: Any = object()
# scipy.fft is imported at the first transform, not with pympar.modules (it takes longer to
# import than the rest of pympar); None: NumPy's transforms.
_scipy_fft: Any = _UNLOADED if importlib.util.find_spec("scipy") is not None else None

__all__ = ["ADJOINT_NORM", "NORMS", "LIBRARY", "c2c", "r2c", "c2r", "scale_conjugate_pairs"]

#: The ``norm=`` values NumPy accepts (None is ``"backward"``).
NORMS = (None, "backward", "ortho", "forward")

#: The norm whose inverse transform is the adjoint of a transform under this norm.
ADJOINT_NORM = {None: "forward", "backward": "forward", "forward": "backward", "ortho": "ortho"}

#: Which library transforms NumPy arrays: ``"scipy.fft"`` or ``"numpy.fft"``.
LIBRARY = "numpy.fft" if _scipy_fft is None else "scipy.fft"


def _call(x: Any, name: str, overwrite: bool, **kw: Any) -> Any:
    global _scipy_fft
    if type(x) is numpy.ndarray:
        if _scipy_fft is _UNLOADED:
            import scipy.fft as _scipy_fft
        if _scipy_fft is not None:
            return getattr(_scipy_fft, name)(x, workers=1, overwrite_x=overwrite, **kw)
        return getattr(numpy.fft, name)(x, **kw)
    return getattr(backend.array_module(x).fft, name)(x, **kw)


def c2c(x: Any, axes: Sequence[int], norm: str | None, inverse: bool,
        overwrite: bool = False) -> Any:
    """Complex transform of ``x`` over ``axes`` (a new array; ``overwrite``: ``x`` may be
    destroyed)."""
    if not axes:
        return x
    return _call(x, "ifftn" if inverse else "fftn", overwrite, axes=tuple(axes), norm=norm)


def r2c(x: Any, axes: Sequence[int], norm: str | None) -> Any:
    """Real-to-complex transform over ``axes``, the real one along ``axes[-1]``."""
    return _call(x, "rfftn", False, axes=tuple(axes), norm=norm)


def c2r(x: Any, axes: Sequence[int], lengths: Sequence[int], norm: str | None,
        overwrite: bool = False) -> Any:
    """Complex-to-real transform over ``axes`` with real lengths ``lengths``."""
    return _call(x, "irfftn", overwrite, s=tuple(lengths), axes=tuple(axes), norm=norm)


def scale_conjugate_pairs(x: Any, axis: int, n: int, factor: float) -> None:
    """Multiply, in place, the modes of a half spectrum of real length ``n`` (along ``axis``,
    whole here) that stand for a conjugate pair: all but 0 and, for even ``n``, ``n // 2``.

    ``factor`` 0.5 turns the adjoint of ``rfft`` into ``irfft`` with the adjoint norm; 2 turns
    that of ``irfft`` into ``rfft``.
    """
    index = [slice(None)] * x.ndim
    index[axis] = slice(1, (n + 1) // 2)
    x[tuple(index)] *= factor
