"""Array backends: NumPy on the host, CuPy on the GPU, and how each meets MPI.

This is pympar's lowest floor. It knows which array module an array belongs to,
how to make a device array safe to hand to MPI (stream synchronisation), whether
the loaded MPI library can read device memory (CUDA-aware MPI), and which MPI
datatype carries a given dtype. CuPy is imported only when a CuPy array is seen
or explicitly asked for, so ``import pympar`` works on machines without CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

__all__ = [
    "array_module",
    "is_cupy_array",
    "cupy_available",
    "synchronize",
    "cuda_aware",
    "mpi_library_cuda_support",
    "mpi_datatype",
    "wire_dtype",
    "accumulation_dtype",
    "bfloat16",
    "is_bfloat16",
    "device_has_bfloat16",
    "check_dtype",
    "staging_buffer",
    "staging_bytes",
    "release_staging",
    "to_wire",
    "from_wire",
]


def _bfloat16_dtype() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: The bfloat16 dtype of ``ml_dtypes`` when it is installed, else ``None``. Bound on first
#: use (module ``__getattr__``), not with pympar: importing ml_dtypes took about half of
#: ``import pympar``, and a program without bfloat16 never needs it.
bfloat16: np.dtype | None


def __getattr__(name: str) -> Any:
    if name == "bfloat16":
        globals()["bfloat16"] = dtype = _bfloat16_dtype()
        return dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_bfloat16(dtype: Any) -> bool:
    """Return whether ``dtype`` is ml_dtypes' bfloat16, without importing ml_dtypes.

    An array can only hold bfloat16 once ml_dtypes is loaded, so this never loads it.
    """
    ml_dtypes = sys.modules.get("ml_dtypes")
    return ml_dtypes is not None and dtype == ml_dtypes.bfloat16


def device_has_bfloat16(xp: ModuleType) -> bool:
    """Return whether array module ``xp`` holds bfloat16 arrays.

    NumPy does with ml_dtypes installed; CuPy from version 14 on (through ml_dtypes).
    """
    if getattr(sys.modules[__name__], "bfloat16") is None:
        return False
    if xp is np:
        return True
    return int(str(getattr(xp, "__version__", "0")).split(".")[0]) >= 14


def check_dtype(xp: ModuleType, dtype: Any, what: str) -> None:
    """Refuse, naming ``what``, a dtype that array module ``xp`` cannot hold.

    Raises
    ------
    TypeError
        For bfloat16 without ml_dtypes, or on CuPy before version 14.
    """
    if not (isinstance(dtype, str) and dtype == "bfloat16") and not is_bfloat16(dtype):
        return
    if getattr(sys.modules[__name__], "bfloat16") is None:
        raise TypeError(f"{what}: bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    if not device_has_bfloat16(xp):
        raise TypeError(f"{what}: bfloat16 on CuPy needs CuPy 14 or later (this is CuPy "
                        f"{getattr(xp, '__version__', '?')}); use float16 or float32")


def is_cupy_array(x: Any) -> bool:
    """Return True when ``x`` is a CuPy array.

    The check never imports CuPy: an object can only be a CuPy array if CuPy
    is already loaded.
    """
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(x: Any) -> ModuleType:
    """Return the array module (``numpy`` or ``cupy``) that owns ``x``.

    Parameters
    ----------
    x : array_like
        A NumPy array, a CuPy array, or anything NumPy accepts.

    Returns
    -------
    module
        ``cupy`` for CuPy arrays, ``numpy`` otherwise.
    """
    if is_cupy_array(x):
        return sys.modules["cupy"]
    return np


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """Return True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError, missing driver ...
        return False


def synchronize(x: Any) -> None:
    """Wait until every kernel that may write ``x`` has finished.

    MPI reads device buffers outside CUDA's stream order, so a CuPy array must
    be complete before its pointer is handed to MPI. NumPy arrays need nothing.
    """
    if is_cupy_array(x):
        sys.modules["cupy"].cuda.get_current_stream().synchronize()


def _loaded_mpi_library() -> ctypes.CDLL | None:
    """Open the MPI shared library that mpi4py already loaded, or None."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
    except OSError:
        return None
    # libmpi.so (Open MPI, MPICH) before helper libraries such as libmpi_mpifh.
    for path in sorted(paths, key=lambda p: (os.path.basename(p).count("_"), p)):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def mpi_library_cuda_support() -> bool | None:
    """Ask the loaded MPI library whether it accepts CUDA device pointers.

    Open MPI answers through ``MPIX_Query_cuda_support`` and MPICH through
    ``MPIX_GPU_query_support``. Returns ``None`` when the library offers no
    such query (the answer is unknown).
    """
    lib = _loaded_mpi_library()
    if lib is None:
        return None
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query())
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        supported = ctypes.c_int(0)
        mpix_gpu_support_cuda = 0
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        gpu_query.restype = ctypes.c_int
        if gpu_query(mpix_gpu_support_cuda, ctypes.byref(supported)) == MPI.SUCCESS:
            return bool(supported.value)
    return None


def cuda_aware() -> bool:
    """Return whether CuPy device buffers go to MPI directly.

    Controlled by ``PYMPAR_CUDA_AWARE``: ``1`` forces device buffers, ``0``
    forces staging through pinned host memory, ``auto`` (the default) asks the
    MPI library and stages when the answer is unknown.
    """
    setting = os.environ.get("PYMPAR_CUDA_AWARE", "auto").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    if setting != "auto":
        raise ValueError(f"PYMPAR_CUDA_AWARE must be auto, 0 or 1, not {setting!r}")
    return bool(mpi_library_cuda_support())


def wire_dtype(dtype: Any) -> np.dtype:
    """Return the dtype whose bytes MPI moves for arrays of ``dtype``.

    Types that MPI cannot name (bfloat16) travel as unsigned integers of the
    same width: moving data never interprets it.
    """
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return np.dtype(np.uint16)
    return dtype


def accumulation_dtype(dtype: Any) -> np.dtype:
    """Return the dtype in which reductions of ``dtype`` are summed.

    Half-precision sums (float16, bfloat16) accumulate in float32 to avoid the
    rounding error of adding many 11- or 8-bit mantissas.
    """
    dtype = np.dtype(dtype)
    if dtype == np.float16 or is_bfloat16(dtype):
        return np.dtype(np.float32)
    return dtype


@functools.lru_cache(maxsize=64)
def mpi_datatype(dtype: Any) -> MPI.Datatype:
    """Return the MPI datatype for moving an array of ``dtype``.

    The predefined datatype of the wire dtype's type code (``MPI_FLOAT``,
    ``MPI_UNSIGNED_SHORT`` for bfloat16, ...) when MPI has one, otherwise the
    datatype that ``mpi4py.util.dtlib`` builds. Predefined first because MPICH
    refuses built-in reductions (``MPI_SUM`` ...) on the duplicated datatypes
    that ``dtlib`` returns even for plain numeric dtypes. A datatype that ``dtlib``
    builds (structured dtypes) is committed; each dtype's is made once.

    Parameters
    ----------
    dtype : numpy dtype or anything ``numpy.dtype`` accepts

    Raises
    ------
    TypeError
        When MPI has no datatype for it.
    """
    wire = wire_dtype(dtype)
    try:
        return MPI.Datatype.fromcode(wire.char)
    except (KeyError, ValueError):
        pass
    if wire == np.float16:
        # An MPI without a half type (Open MPI 4) moves the 16-bit words: reductions never
        # get here with float16 (they sum in float32, accumulation_dtype).
        return MPI.UINT16_T
    try:
        derived = dtlib.from_numpy_dtype(wire)
    except (ValueError, KeyError) as err:
        raise TypeError(f"pympar cannot send arrays of dtype {np.dtype(dtype)}: {err}") from None
    return derived.Commit()  # MPI moves no data in a datatype that is not committed


_PINNED: dict[Any, np.ndarray] = {}


def staging_buffer(slot: Any, like: Any) -> np.ndarray:
    """A pinned host array shaped like device array ``like``, from the pool of ``slot``.

    Each slot (any hashable: the collectives use 0 and 1, ring attention its own) keeps
    one pinned block, grown at least twofold when a larger message comes, so that message
    sizes creeping up cost a few allocations. The contents are undefined, and the next
    call for the same slot reuses them: copy out before then. :func:`release_staging`
    hands every block back to the driver.
    """
    pool = _PINNED.get(slot)
    if pool is None or pool.nbytes < like.nbytes:
        import cupyx  # only reached with CuPy arrays

        size = max(like.nbytes, 2 * pool.nbytes if pool is not None else 1)
        del pool
        _PINNED.pop(slot, None)
        _PINNED[slot] = pool = cupyx.empty_pinned((size,), np.uint8)
    return pool[:like.nbytes].view(like.dtype).reshape(like.shape)


def staging_bytes() -> int:
    """Bytes of pinned host memory that the staging pools hold now."""
    return sum(block.nbytes for block in _PINNED.values())


def release_staging() -> None:
    """Hand the pinned staging blocks back to the driver (next use allocates anew).

    :func:`pympar.manager.destroy_parallel` calls it. CuPy's pinned memory pool would
    otherwise keep the freed blocks for reuse, so its cached blocks are freed too.
    """
    _PINNED.clear()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def to_wire(send: Any, recv: Any) -> tuple[Any, Any]:
    """Device buffers as MPI should see them: themselves, or pinned host copies.

    Parameters
    ----------
    send : cupy.ndarray, ``MPI.IN_PLACE`` or None
        The send buffer; for ``IN_PLACE`` or None (a broadcast), ``recv`` holds the input.
    recv : cupy.ndarray
        The receive buffer.

    Returns
    -------
    tuple
        ``(send, recv)`` to hand to MPI; pass the second to :func:`from_wire` afterwards.
    """
    synchronize(recv)  # kernels writing either buffer ran on this stream
    if cuda_aware():
        return send, recv
    host_recv, host_send = staging_buffer(1, recv), send
    if send is None or send is MPI.IN_PLACE:
        recv.get(out=host_recv)
    else:
        host_send = staging_buffer(0, send)
        send.get(out=host_send)
    synchronize(recv)
    return host_send, host_recv


def from_wire(recv: Any, wire_recv: Any) -> None:
    """Copy what MPI wrote into ``wire_recv`` (see :func:`to_wire`) back to ``recv``."""
    if wire_recv is not recv:
        recv.set(wire_recv)
        # The pinned buffer is reused by the next call: the copy must be done.
        synchronize(recv)
