"""``cupy.fft`` of the stand-in: NumPy's transforms run as kernels on device arrays.

CuPy's functions take NumPy's arguments (``s``, ``axes``, ``norm``) and keep the input's
precision (complex64 out of float32), as NumPy 2 does.
"""

from __future__ import annotations

from typing import Any

import numpy

from . import _kernel

_NAMES = ("fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn", "ifftn",
          "rfftn", "irfftn")


def _transform(name: str) -> Any:
    func = getattr(numpy.fft, name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _kernel(func, *args, **kwargs)
    kernel.__name__ = name
    return kernel


globals().update({name: _transform(name) for name in _NAMES})
__all__ = list(_NAMES)
