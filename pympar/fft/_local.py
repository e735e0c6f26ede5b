"""The transforms each rank makes on its own block: FFTW's, SciPy's or NumPy's; CuPy's for CuPy.

NumPy arrays go to the first library installed of

* ``"pyfftw"``: FFTW through pyFFTW (``pip install pyfftw``; the ``fftw`` extra), one
  thread. The first call of a shape measures (``FFTW_MEASURE``, as mpi4py-fft plans) on
  scratch arrays of the same layout and alignment, since measuring overwrites its arrays:
  0.1-0.2 s for a 64^3 field, about 2 s for 256^3, once per process; a 3-D r2c of 256^3 then
  ran in 0.4x the time of an ``FFTW_ESTIMATE`` plan. Every call plans its very arrays from
  that wisdom (``FFTW_WISDOM_ONLY``: microseconds, no data touched, no array kept alive).
  Outputs are fresh NumPy arrays (the input's alignment, which FFTW's SIMD needs to match),
  a complex stage on pympar's own intermediate runs in place; a complex-to-real stage,
  which FFTW lets destroy its input, runs its complex axes first (out of the caller's
  input, into an array of ours) and the real axis from that: 0.6x the time of FFTW's 3-D
  c2r of a copy at 256^3. FFTW does not scale: ``norm=`` is one in-place multiply of the
  output;
* ``"scipy.fft"``: pocketfft at ``workers=1``, with ``overwrite_x`` for pympar's own
  intermediates;
* ``"numpy.fft"``: pocketfft, one axis per call.

Why FFTW first: the local transforms are most of a round trip's time at 256^3 (the exchange is
a tenth of it), and there FFTW's r2c over the two whole axes of a slab takes about 0.7x
pocketfft's time and a one-rank 3-D round trip about 0.7x (``benchmarks/bench_fft.py``,
whose round trip also times pympar with ``scipy.fft``); mpi4py-fft, the anchor, plans FFTW
too, so with pyFFTW installed the two differ by their exchanges and machinery alone.
:data:`LIBRARY` says which library runs; assign it (``"scipy.fft"``, ``"numpy.fft"``) to pick
another installed one. Dtypes FFTW lacks (float16) go to SciPy or NumPy.

The adjoint of every 1-D stage is the inverse stage with the swapped ``norm``
(:data:`ADJOINT_NORM`); for the real transforms it also halves (r2c) or doubles (c2r) the
modes that stand for two conjugate coefficients (:func:`scale_conjugate_pairs`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any, Sequence

import numpy

from .. import backend

__all__ = ["ADJOINT_NORM", "NORMS", "LIBRARY", "LIBRARIES", "c2c", "r2c", "c2r", "direct",
           "scale_conjugate_pairs"]

#: The ``norm=`` values NumPy accepts (None is ``"backward"``).
NORMS = (None, "backward", "ortho", "forward")

#: The norm whose inverse transform is the adjoint of a transform under this norm.
ADJOINT_NORM = {None: "forward", "backward": "forward", "forward": "backward", "ortho": "ortho"}

#: The libraries that can transform NumPy arrays here, the preferred first.
LIBRARIES = tuple(name for name in ("pyfftw", "scipy.fft", "numpy.fft")
                  if importlib.util.find_spec(name.split(".")[0]) is not None)

#: Which library transforms NumPy arrays (the first of :data:`LIBRARIES`).
LIBRARY = LIBRARIES[0]

# FFTW's precisions; other dtypes go to the next library.
_FFTW_DTYPES = frozenset(numpy.dtype(t) for t in ("f4", "f8", "c8", "c16"))
# Modules imported at their first transform, not with pympar (scipy.fft and pyfftw take
# longer to import than the rest of pympar).
_modules: dict[str, Any] = {}
# The FFTW problems measured in this process (FFTW keeps their plans as wisdom).
_measured: set[tuple] = set()


def _module(name: str) -> Any:
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(name)
    return module


def _library(x: Any) -> str:
    """The library of this call: :data:`LIBRARY`, or the next for a dtype FFTW lacks."""
    if LIBRARY != "pyfftw" or x.dtype in _FFTW_DTYPES:
        return LIBRARY
    return "scipy.fft" if "scipy.fft" in LIBRARIES else "numpy.fft"


def direct(x: Any) -> bool:
    """Whether the transforms of ``x`` write into a given ``out`` directly (FFTW's), not
    through a copy."""
    return type(x) is numpy.ndarray and _library(x) == "pyfftw"


def _scale(out: Any, n: int, norm: str | None, inverse: bool) -> Any:
    """Scale FFTW's unnormalized ``out`` (``n`` points transformed) in place, as ``norm``."""
    if norm == "ortho":
        out *= 1.0 / math.sqrt(n)
    elif (norm == "forward") != inverse:  # forward of "forward", inverse of "backward"
        out *= 1.0 / n
    return out


def _twin(a: Any) -> Any:
    """A scratch array of ``a``'s shape, dtype and address modulo 64 (FFTW's SIMD plans
    depend on the alignment)."""
    raw = numpy.empty(a.nbytes + 64, numpy.uint8)
    shift = (a.ctypes.data - raw.ctypes.data) % 64
    return raw[shift:shift + a.nbytes].view(a.dtype).reshape(a.shape)


def _fftw(x: Any, out: Any, axes: tuple[int, ...], inverse: bool, destroy: bool) -> Any:
    """FFTW's unnormalized transform of ``x`` into ``out`` (``x`` itself: in place)."""
    pyfftw = _module("pyfftw")
    direction = "FFTW_BACKWARD" if inverse else "FFTW_FORWARD"
    flags = ("FFTW_MEASURE", "FFTW_DESTROY_INPUT") if destroy else ("FFTW_MEASURE",)
    key = (x.shape, x.dtype.str, out.shape, out.dtype.str, axes, inverse, destroy, x is out,
           x.ctypes.data % 64, out.ctypes.data % 64)
    contiguous = x.flags.c_contiguous and out.flags.c_contiguous
    if contiguous and key not in _measured:  # measuring overwrites the arrays: scratch ones
        twin = _twin(x)
        pyfftw.FFTW(twin, twin if x is out else _twin(out), axes=axes, direction=direction,
                    flags=flags, threads=1)
        _measured.add(key)
    try:  # the wisdom of the measured twin plans the call's arrays, untouched
        plan = pyfftw.FFTW(x, out, axes=axes, direction=direction,
                           flags=flags + ("FFTW_WISDOM_ONLY",), threads=1)
    except RuntimeError:  # strided arrays (not measured), or wisdom FFTW would not reuse
        plan = pyfftw.FFTW(x, out, axes=axes, direction=direction,
                           flags=("FFTW_ESTIMATE",) + flags[1:], threads=1)
    plan.execute()
    return out


def _call(x: Any, name: str, overwrite: bool, out: Any, **kw: Any) -> Any:
    """SciPy's, NumPy's or CuPy's ``name`` of ``x`` (copied into ``out`` when given)."""
    if type(x) is numpy.ndarray:
        if _library(x) == "scipy.fft":
            y = getattr(_module("scipy.fft"), name)(x, workers=1, overwrite_x=overwrite, **kw)
        else:
            y = getattr(numpy.fft, name)(x, **kw)
    else:
        y = getattr(backend.array_module(x).fft, name)(x, **kw)
    if out is None or out is y:
        return y
    out[...] = y
    return out


def _complex_dtype(x: Any) -> numpy.dtype:
    return numpy.result_type(x.dtype, numpy.complex64)


def c2c(x: Any, axes: Sequence[int], norm: str | None, inverse: bool,
        overwrite: bool = False, out: Any = None) -> Any:
    """Complex transform of ``x`` over ``axes``: into ``out`` when given, else a new array,
    or ``x`` itself transformed in place when ``overwrite`` (then ``x`` may be destroyed)."""
    if not axes:
        if out is None:
            return x
        out[...] = x
        return out
    axes = tuple(axes)
    if type(x) is not numpy.ndarray or _library(x) != "pyfftw":
        return _call(x, "ifftn" if inverse else "fftn", overwrite, out, axes=axes, norm=norm)
    return _scale(_fftw_c2c(x, axes, inverse, overwrite, out),
                  math.prod(x.shape[a] for a in axes), norm, inverse)


def _fftw_c2c(x: Any, axes: tuple[int, ...], inverse: bool, overwrite: bool,
              out: Any = None) -> Any:
    """FFTW's unnormalized complex transform of ``x``: into ``out``, else in place when
    ``overwrite``, else into a new array."""
    if x.dtype.kind != "c":  # as NumPy: a real field is a complex one
        x, overwrite = x.astype(_complex_dtype(x)), True
    if out is None:
        out = x if overwrite and x.flags.writeable else numpy.empty(x.shape, x.dtype)
    if not axes:
        if out is not x:
            out[...] = x
        return out
    return _fftw(x, out, axes, inverse, destroy=False)


def r2c(x: Any, axes: Sequence[int], norm: str | None, out: Any = None) -> Any:
    """Real-to-complex transform over ``axes``, the real one along ``axes[-1]`` (into
    ``out`` when given, else a new array)."""
    axes = tuple(axes)
    if type(x) is not numpy.ndarray or _library(x) != "pyfftw":
        return _call(x, "rfftn", False, out, axes=axes, norm=norm)
    if out is None:
        shape = list(x.shape)
        shape[axes[-1]] = shape[axes[-1]] // 2 + 1
        out = numpy.empty(shape, _complex_dtype(x))
    _fftw(x, out, axes, False, destroy=False)
    return _scale(out, math.prod(x.shape[a] for a in axes), norm, False)


def c2r(x: Any, axes: Sequence[int], lengths: Sequence[int], norm: str | None,
        overwrite: bool = False, out: Any = None, work: Any = None) -> Any:
    """Complex-to-real transform over ``axes`` with real lengths ``lengths``, into ``out``
    when given, else a new array. Unless ``overwrite`` (``x`` may be destroyed), FFTW's
    complex stages go into ``work`` when given (an array of ``x``'s shape and dtype)."""
    axes, lengths = tuple(axes), tuple(lengths)
    if type(x) is not numpy.ndarray or _library(x) != "pyfftw":
        return _call(x, "irfftn", overwrite, out, s=lengths, axes=axes, norm=norm)
    if x.shape[axes[-1]] != lengths[-1] // 2 + 1 or any(
            x.shape[a] != n for a, n in zip(axes[:-1], lengths[:-1])):
        raise ValueError(f"c2r: a spectrum of shape {x.shape} over axes {axes} does not "
                         f"have the modes of real lengths {lengths}")
    # The complex axes first, into an array of ours (unless x is), then the real axis from
    # it, which FFTW may destroy: faster than FFTW's n-d c2r of a copy of x.
    if x.dtype.kind != "c" or (work is not None and work.dtype != x.dtype):
        work = None
    x = _fftw_c2c(x, axes[:-1], True, overwrite, None if overwrite else work)
    if out is None:
        shape = list(x.shape)
        shape[axes[-1]] = lengths[-1]
        out = numpy.empty(shape, numpy.empty(0, x.dtype).real.dtype)
    _fftw(x, out, axes[-1:], True, destroy=True)
    return _scale(out, math.prod(lengths), norm, True)


def scale_conjugate_pairs(x: Any, axis: int, n: int, factor: float) -> None:
    """Multiply, in place, the modes of a half spectrum of real length ``n`` (along ``axis``,
    whole here) that stand for a conjugate pair: all but 0 and, for even ``n``, ``n // 2``.

    ``factor`` 0.5 turns the adjoint of ``rfft`` into ``irfft`` with the adjoint norm; 2 turns
    that of ``irfft`` into ``rfft``.
    """
    index = [slice(None)] * x.ndim
    index[axis] = slice(1, (n + 1) // 2)
    x[tuple(index)] *= factor
