"""A strict CuPy stand-in for pympar's tests: NumPy memory, CuPy's rules, and stricter ones.

Put ``tests/fakecupy`` on ``sys.path`` (``PYMPAR_FAKE_CUPY=1`` or ``pytest --fake-cupy``;
``make test`` does) and ``import cupy`` finds this module. Its :class:`ndarray` holds a
NumPy array but is no NumPy subclass, and shows its memory only through
``__cuda_array_interface__``: mpi4py hands MPI that "device" pointer, which a host MPI can
still read and write, so device buffers really travel.

What a GPU user meets on the first run is an error here:

* ``numpy.asarray(device)`` (``__array__``) raises CuPy's TypeError; NumPy functions and
  ufuncs given a device array refuse (stricter than CuPy, which dispatches some of them);
* a NumPy array passed to a CuPy function or operator raises TypeError as CuPy does, and
  assigning one into a device array raises CuPy's ValueError (only ``asarray``/``array``
  and ``ndarray.set`` take host arrays); ``get``/``set`` check dtype, shape and contiguity;
* streams: every kernel (any function or method computing on device arrays, and ``set``)
  leaves the memory it reads or writes pending until a synchronize (a stream's, the
  device's, or a blocking ``get``); MPI given pending memory raises, because a transport
  would read half-written data or overwrite what a kernel still reads;
* device memory reaches MPI only when ``PYMPAR_CUDA_AWARE=1`` (the stand-in then plays a
  CUDA-aware MPI); with ``0`` or ``auto`` (a host MPI) any MPI access to it raises:
  nothing may bypass staging. Managed memory is the exception, as with CUDA: arrays
  allocated through ``cupy.cuda.set_allocator(MemoryPool(malloc_managed).malloc)`` may reach
  a host MPI. ``PYMPAR_TEST_CUPY_MANAGED=1`` (how ``scripts/gpu_check.sh`` emulates a
  CUDA-aware MPI with a host one) makes the stand-in a host MPI in every mode: then only
  managed memory may reach it, as on a GPU with the MPICH wheel.

Only the names CuPy has are provided (:data:`_FUNCTIONS`); any other raises
AttributeError, so code calling a NumPy-only function through ``xp`` fails here too.
"""

from __future__ import annotations

import importlib

import os
import sys
import types
from typing import Any

import numpy

from . import cuda
from .cuda import _PENDING

__version__ = "14.0.0"

#: Marks this module as the stand-in (tests that need a real device check it).
IS_STAND_IN = True

_HOST_ERROR = ("Implicit conversion to a NumPy array is not allowed. "
               "Please use `.get()` to construct a NumPy array explicitly.")


def _root(a: numpy.ndarray) -> numpy.ndarray:
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    return a


def _touch(a: numpy.ndarray) -> None:
    root = _root(a)
    _PENDING[id(root)] = root


def _pending(a: numpy.ndarray) -> bool:
    return id(_root(a)) in _PENDING


def _wrap(a: Any) -> Any:
    """A NumPy result as device memory (NumPy scalars become 0-d arrays, as in CuPy)."""
    if isinstance(a, numpy.generic):
        a = numpy.asarray(a)
    if isinstance(a, numpy.ndarray):
        if cuda.allocating_managed and a.base is None:
            cuda._allocated(a)
        out = ndarray.__new__(ndarray)
        out._a = a
        return out
    if isinstance(a, tuple):
        return tuple(_wrap(x) for x in a)
    if isinstance(a, list):
        return [_wrap(x) for x in a]
    return a


def _unwrap(x: Any, touched: list) -> Any:
    """Device arrays to their NumPy memory (recorded in ``touched``); refuse host arrays."""
    kind = type(x)
    if kind is ndarray:
        touched.append(x._a)
        return x._a
    if kind is numpy.ndarray:
        raise TypeError(f"Unsupported type {type(x)}")
    if kind is list or kind is tuple:
        return kind([_unwrap(v, touched) for v in x])
    return x


def _kernel(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``func`` on the NumPy memory of device arrays: a kernel on the stream."""
    touched: list = []
    args = [_unwrap(a, touched) for a in args]
    if kwargs:
        kwargs = {k: _unwrap(v, touched) for k, v in kwargs.items()}
    result = func(*args, **kwargs)
    kind = type(result)
    if kind is numpy.ndarray:
        touched.append(result)
        if cuda.allocating_managed and result.base is None:
            cuda._allocated(result)
        out = ndarray.__new__(ndarray)
        out._a = result
    else:
        if kind in (bool, int, float, complex) or isinstance(result, numpy.generic):
            result = numpy.asarray(result)  # CuPy returns 0-d arrays (sums, allclose ...)
        out = _wrap(result)
        for r in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(r, ndarray):
                touched.append(r._a)
    for a in touched:
        while type(a.base) is numpy.ndarray:
            a = a.base
        _PENDING[id(a)] = a
    return out


def _staging_forced() -> bool:
    return os.environ.get("PYMPAR_CUDA_AWARE", "auto").strip().lower() not in (
        "1", "true", "yes", "on")


def _host_mpi() -> bool:
    """Whether the stand-in plays a host MPI: staging is forced, or the run emulates a
    CUDA-aware MPI on managed memory (``PYMPAR_TEST_CUPY_MANAGED=1``, as
    ``scripts/gpu_check.sh`` sets where the MPI library reports no CUDA support)."""
    return _staging_forced() or os.environ.get("PYMPAR_TEST_CUPY_MANAGED", "") == "1"


class _Flags:
    def __init__(self, a: numpy.ndarray) -> None:
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = a.base is None

    def __getitem__(self, name: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[name]


class ndarray:
    """A device array of the stand-in (NumPy memory, reachable only as device memory)."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None,
                 strides: Any = None, order: str = "C") -> None:
        if memptr is not None or strides is not None:
            raise NotImplementedError("the CuPy stand-in allocates its own memory")
        self._a = numpy.empty(shape, _device_dtype(dtype), order=order)
        if cuda.allocating_managed:
            cuda._allocated(self._a)

    # ---------------------------------------------------------------- what MPI sees
    @property
    def __cuda_array_interface__(self) -> dict:
        if _host_mpi() and not cuda.is_managed(_root(self._a)):
            raise RuntimeError(
                "CuPy stand-in: device memory reached a host MPI (PYMPAR_CUDA_AWARE is not 1, "
                "or PYMPAR_TEST_CUPY_MANAGED=1) that cannot read device pointers: this "
                "buffer bypassed staging, or was not allocated as managed memory")
        if _pending(self._a):
            raise RuntimeError(
                "CuPy stand-in: device memory handed to MPI while a kernel that reads or "
                "writes it may still run (synchronize the stream first)")
        a = self._a
        cuda.mpi_exports += 1
        return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr,
                "strides": None if a.flags.c_contiguous else a.strides,
                "data": (a.ctypes.data if a.size else 0, False), "version": 3,
                "stream": 1}

    # ---------------------------------------------------------------- host conversion
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_HOST_ERROR)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise TypeError(f"CuPy stand-in: NumPy ufunc numpy.{ufunc.__name__} was given a device "
                        f"array; use the array's module (cupy.{ufunc.__name__})")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise TypeError(f"CuPy stand-in: NumPy function numpy.{func.__name__} was given a "
                        f"device array; use the array's module (cupy.{func.__name__})")

    def get(self, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> numpy.ndarray:
        a = self._a
        if out is not None:
            if not isinstance(out, numpy.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            if out.dtype != a.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {a.dtype} array")
            if out.shape != a.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {a.shape}, "
                                 f"actual shape: {out.shape}")
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("`out` cannot be specified when copying to "
                                   "non-contiguous ndarray")
            numpy.copyto(out, a)
        else:
            out = numpy.array(a, order="F" if order == "F" else "C")
        if blocking:
            cuda._complete()
        return out

    def set(self, arr: Any, stream: Any = None) -> None:
        a = self._a
        if not isinstance(arr, numpy.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if a.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {a.dtype} array")
        if a.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {a.shape}, new shape: {arr.shape}")
        if not (a.flags.c_contiguous or a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        numpy.copyto(a, arr)
        _touch(a)  # an asynchronous copy on the stream

    def item(self) -> Any:
        if self._a.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self) -> Any:
        return self.get().tolist()

    def tobytes(self, order: str = "C") -> bytes:
        return self.get().tobytes(order)

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __complex__(self) -> complex:
        return complex(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __index__(self) -> int:
        if self._a.ndim or self._a.dtype.kind not in "iub":
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.item())

    def __repr__(self) -> str:
        return repr(self.get()).replace("array(", "cupy-stand-in array(", 1)

    # ---------------------------------------------------------------- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: cuda.MemoryPointer(self._a.ctypes.data))
    device = property(lambda self: cuda.Device())

    @property
    def base(self) -> Any:
        root = _root(self._a)
        return None if root is self._a else _wrap(root)

    @property
    def T(self) -> "ndarray":
        return _wrap(self._a.T)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, key: Any) -> Any:
        touched: list = []
        result = self._a[_index(key, touched)]
        out = _wrap(result)
        if not (isinstance(result, numpy.ndarray) and _root(result) is _root(self._a)):
            _touch(self._a)  # a gather: a kernel reading self, writing out
            _touch(out._a)
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, numpy.ndarray):
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.item()
        elif isinstance(value, (list, tuple)):
            raise TypeError("CuPy stand-in: assign a cupy.ndarray or a scalar, not a "
                            f"{type(value).__name__}")
        touched: list = []
        index = _index(key, touched)
        if isinstance(value, ndarray):
            target = self._a[index].shape if not isinstance(index, numpy.ndarray) else None
            if target is not None and (value.ndim > len(target) or numpy.broadcast_shapes(
                    value.shape, target) != target):
                # NumPy drops leading 1s of the value; CuPy broadcasts strictly.
                raise ValueError(f"CuPy stand-in: cannot broadcast a value of shape "
                                 f"{value.shape} into shape {target}")
        self._a[index] = _unwrap(value, touched)
        for a in touched + [self._a]:
            _touch(a)

    # ---------------------------------------------------------------- views (no kernel)
    def reshape(self, *shape: Any, order: str = "C") -> "ndarray":
        return _wrap(self._a.reshape(*shape, order=order))

    def view(self, dtype: Any = None) -> "ndarray":
        return _wrap(self._a.view() if dtype is None else self._a.view(_device_dtype(dtype)))

    def transpose(self, *axes: Any) -> "ndarray":
        return _wrap(self._a.transpose(*axes))

    def swapaxes(self, a: int, b: int) -> "ndarray":
        return _wrap(self._a.swapaxes(a, b))

    def squeeze(self, axis: Any = None) -> "ndarray":
        return _wrap(self._a.squeeze(axis))

    def ravel(self, order: str = "C") -> "ndarray":
        result = self._a.ravel(order)
        if _root(result) is not _root(self._a):
            return _kernel(numpy.ravel, self, order)
        return _wrap(result)

    def fill(self, value: Any) -> None:
        if isinstance(value, numpy.ndarray):
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.item()
        _kernel(numpy.ndarray.fill, self, value)

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None,
               copy: bool = True) -> "ndarray":
        dtype = _device_dtype(dtype)
        if not copy and dtype == self._a.dtype:
            return self
        return _kernel(numpy.ndarray.astype, self, dtype, order)


def _index(key: Any, touched: list) -> Any:
    """An index for NumPy memory: device index arrays unwrapped; host index arrays allowed
    (CuPy copies them to the device)."""
    if isinstance(key, tuple):
        return tuple(_index(k, touched) for k in key)
    if isinstance(key, ndarray):
        touched.append(key._a)
        return key._a
    return key


def _method(name: str) -> Any:
    def method(self: ndarray, *args: Any, **kwargs: Any) -> Any:
        return _kernel(getattr(numpy.ndarray, name), self, *args, **kwargs)
    method.__name__ = name
    return method


for _name in ("sum", "mean", "max", "min", "prod", "var", "std", "argmax", "argmin", "all",
              "any", "cumsum", "clip", "dot", "round", "conj", "copy", "flatten", "nonzero",
              "__neg__", "__pos__", "__abs__", "__invert__"):
    setattr(ndarray, _name, _method(_name))


def _binary(name: str, inplace: bool = False) -> Any:
    op = getattr(numpy.ndarray, name)

    def method(self: ndarray, other: Any) -> Any:
        if isinstance(other, numpy.ndarray):
            raise TypeError(f"Unsupported type {type(other)}")
        if inplace:
            touched: list = []
            op(self._a, _unwrap(other, touched))
            for a in touched + [self._a]:
                _touch(a)
            return self
        return _kernel(op, self, other)
    method.__name__ = name
    return method


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
            "xor", "lshift", "rshift"):
    setattr(ndarray, f"__{_op}__", _binary(f"__{_op}__"))
    setattr(ndarray, f"__r{_op}__", _binary(f"__r{_op}__"))
    setattr(ndarray, f"__i{_op}__", _binary(f"__i{_op}__", inplace=True))
for _op in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(ndarray, f"__{_op}__", _binary(f"__{_op}__"))


def _device_dtype(dtype: Any) -> numpy.dtype:
    """A dtype the stand-in holds: CuPy 14's (bfloat16 through ml_dtypes; no object, str)."""
    dtype = numpy.dtype(dtype)
    if dtype.kind in "OUSM m" or (dtype.kind == "V" and dtype.name != "bfloat16"):
        raise TypeError(f"Unsupported dtype {dtype}")
    if dtype.name == "bfloat16" and int(__version__.split(".")[0]) < 14:
        raise TypeError(f"Unsupported dtype {dtype} (CuPy {__version__} has no bfloat16)")
    return dtype


# ---------------------------------------------------------------------- the module's functions


def asarray(a: Any, dtype: Any = None, order: Any = None, **kwargs: Any) -> ndarray:
    """Host data to the device (a copy on the stream), or a device array as it is."""
    if isinstance(a, ndarray):
        if dtype is None or numpy.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype)
    host = numpy.asarray(a, dtype=dtype)
    out = _wrap(numpy.array(host, dtype=_device_dtype(host.dtype), order=order or "K"))
    _touch(out._a)
    return out


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K",
          ndmin: int = 0, **kwargs: Any) -> ndarray:
    if isinstance(obj, ndarray):
        return _kernel(numpy.array, obj, dtype=dtype, order=order, ndmin=ndmin)
    host = numpy.array(obj, dtype=dtype, order=order, ndmin=ndmin)
    out = _wrap(host if host.base is None else host.copy(order))
    _device_dtype(out._a.dtype)
    _touch(out._a)
    return out


asanyarray = asarray


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> numpy.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return numpy.asarray(a, order=order)


def _allocator(func: Any) -> Any:
    def allocate(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
        return _wrap(func(shape, _device_dtype(dtype), order=order))
    allocate.__name__ = func.__name__
    return allocate


empty = _allocator(numpy.empty)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    out = _wrap(numpy.zeros(shape, _device_dtype(dtype), order=order))
    _touch(out._a)  # a memset on the stream
    return out


def empty_like(a: Any, dtype: Any = None, order: str = "K", subok: Any = None,
               shape: Any = None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    return _wrap(numpy.empty_like(a._a, dtype=dtype and _device_dtype(dtype), order=order,
                                  shape=shape))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    """CuPy's: always at least one dimension (a 0-d array comes back 1-d)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    if a.ndim and a.flags.c_contiguous and (dtype is None or numpy.dtype(dtype) == a.dtype):
        return a
    return _kernel(numpy.ascontiguousarray, a, dtype=dtype)


def may_share_memory(a: Any, b: Any, max_work: Any = None) -> bool:
    if not (isinstance(a, ndarray) and isinstance(b, ndarray)):
        raise TypeError("cupy.may_share_memory takes cupy arrays")
    return bool(numpy.may_share_memory(a._a, b._a))


def shares_memory(a: Any, b: Any, max_work: Any = None) -> bool:
    if not (isinstance(a, ndarray) and isinstance(b, ndarray)):
        raise TypeError("cupy.shares_memory takes cupy arrays")
    return bool(numpy.shares_memory(a._a, b._a))


def get_array_module(*args: Any) -> types.ModuleType:
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else numpy


#: NumPy functions CuPy also has, run as kernels on device arrays.
_FUNCTIONS = frozenset("""
zeros_like ones_like full_like ones full arange linspace eye identity tri tril triu
concatenate stack vstack hstack split array_split where copyto reshape transpose swapaxes
moveaxis expand_dims squeeze broadcast_to ravel flip roll tile repeat pad take
take_along_axis diag outer
exp exp2 expm1 log log1p log2 log10 sqrt square reciprocal tanh sinh cosh sin cos tan
arctan arctanh abs absolute sign negative positive floor ceil rint around round trunc
maximum minimum fmax fmin clip add subtract multiply divide true_divide floor_divide power
mod fmod logaddexp logaddexp2 matmul dot vdot einsum tensordot inner
sum prod mean var std max min amax amin argmax argmin cumsum cumprod all any
isfinite isnan isinf logical_and logical_or logical_not logical_xor greater greater_equal
less less_equal equal not_equal allclose isclose array_equal count_nonzero nonzero
sort argsort unique searchsorted nan_to_num real imag conj
""".split())

#: The ufuncs whose ``at`` method (unbuffered in-place, repeated indices applied each
#: time) CuPy 14 has, as ``cupy.add.at``.
_UFUNCS_WITH_AT = frozenset({"add", "subtract", "maximum", "minimum"})

#: Names CuPy shares with NumPy that are not functions of device arrays.
_CONSTANTS = frozenset("""
float16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool_ complex64
complex128 intp dtype newaxis pi e inf nan finfo iinfo result_type can_cast promote_types
""".split())


def __getattr__(name: str) -> Any:
    if name == "fft":  # cupy.fft, a submodule as in CuPy
        return importlib.import_module(f"{__name__}.fft")
    if name in _CONSTANTS:
        return getattr(numpy, name)
    if name in _FUNCTIONS:
        func = getattr(numpy, name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            return _kernel(func, *args, **kwargs)
        kernel.__name__ = name
        if name in _UFUNCS_WITH_AT:
            def at(a: Any, indices: Any, b: Any = None) -> None:
                if not isinstance(a, ndarray):
                    raise TypeError(f"cupy.{name}.at takes a cupy.ndarray, got {type(a)}")
                _kernel(func.at, a, indices, *(() if b is None else (b,)))
            kernel.at = at  # type: ignore[attr-defined]
        globals()[name] = kernel
        return kernel
    raise AttributeError(f"the CuPy stand-in has no {name!r} (add it to tests/fakecupy/cupy "
                         f"if CuPy 14 has it)")


_DEVICE_POOL, _PINNED_POOL = cuda.MemoryPool(), cuda.PinnedMemoryPool()


def get_default_memory_pool() -> cuda.MemoryPool:
    return _DEVICE_POOL


def get_default_pinned_memory_pool() -> cuda.PinnedMemoryPool:
    return _PINNED_POOL


def synchronize() -> None:
    """Not CuPy API: tests complete every pending kernel with it (like Device.synchronize)."""
    cuda._complete()
