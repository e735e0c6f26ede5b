"""How arrays meet MPI in the collectives: sizes, counts, datatypes, CuPy staging.

Private to :mod:`pympar.collectives`, whose public names (:func:`balanced_sizes`,
:func:`check_count`, :func:`large_counts_supported`, :data:`INT_MAX`) are
defined here and re-exported there.

* Sizes: the balanced split rule of ``numpy.array_split`` and offsets of blocks.
* Counts: whether a count or displacement fits the MPI interface at hand.
* Datatypes: per dtype, the MPI datatype that moves it and, for half precision,
  the float32 accumulation dtype of reductions (cached in ``_DTYPES``).
* CuPy: device buffers handed to MPI directly when MPI is CUDA-aware, otherwise
  staged through pinned host buffers from a grow-only per-slot pool.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import backend
from .partition import balanced_sizes, block_slice  # noqa: F401  (re-exported by collectives)

__all__ = ["INT_MAX", "balanced_sizes", "check_count", "large_counts_supported"]


#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = 2**31 - 1

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

_ndarray = np.ndarray
_IN_PLACE = MPI.IN_PLACE


# --------------------------------------------------------------------------- sizes


def _offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return tuple(out)


def large_counts_supported(mpi_version: tuple[int, int] | None = None) -> bool:
    """Return whether counts above :data:`INT_MAX` can reach MPI.

    mpi4py 4 passes large counts through the MPI-4 ``_c`` routines, which the
    library has from MPI standard version 4.0 on.

    Parameters
    ----------
    mpi_version : tuple of int, optional
        The standard version to judge; ``MPI.Get_version()`` by default.
    """
    version = MPI.Get_version() if mpi_version is None else mpi_version
    return tuple(version) >= (4, 0)


def check_count(largest: int, operation: str,
                mpi_version: tuple[int, int] | None = None) -> None:
    """Refuse a message whose counts or displacements MPI cannot express.

    Parameters
    ----------
    largest : int
        The largest count or displacement (in elements of the MPI datatype)
        the call would pass.
    operation : str
        Name of the collective, for the message.
    mpi_version : tuple of int, optional
        The MPI standard version; the loaded library's by default.

    Raises
    ------
    ValueError
        When ``largest`` exceeds :data:`INT_MAX` and the library has no MPI-4
        large-count routines: the call would otherwise truncate the count.
    """
    if largest > INT_MAX and not large_counts_supported(mpi_version):
        version = MPI.Get_version() if mpi_version is None else mpi_version
        raise ValueError(
            f"{operation}: a count of {largest} elements exceeds {INT_MAX}, and the MPI "
            f"library (standard {version[0]}.{version[1]}) has no large-count routines; "
            f"split the array into smaller messages or use an MPI-4 library")


# --------------------------------------------------------------------------- dtypes


_DTYPES: dict[np.dtype, tuple[MPI.Datatype, np.dtype | None, MPI.Datatype]] = {}


def _dtype_info(dtype: np.dtype) -> tuple[MPI.Datatype, np.dtype | None, MPI.Datatype]:
    """(wire MPI type, accumulation dtype or None when it is ``dtype``, its MPI type)."""
    info = _DTYPES.get(dtype)
    if info is None:
        acc = backend.accumulation_dtype(dtype)
        info = (backend.mpi_datatype(dtype), None if acc == dtype else acc,
                backend.mpi_datatype(acc))
        _DTYPES[dtype] = info
    return info


# (dtype, op) -> (MPI datatype, MPI op) for dtypes reduced in their own precision.
_FAST_REDUCE: dict[tuple[np.dtype, str], tuple[MPI.Datatype, MPI.Op]] = {}


# --------------------------------------------------------------------------- arrays


def _coerce(x: Any) -> Any:
    """The array itself (NumPy or CuPy), or ``numpy.asarray`` of anything else."""
    if type(x) is np.ndarray or backend.is_cupy_array(x):
        return x
    return np.asarray(x)


def _xp(x: Any) -> Any:
    return np if type(x) is np.ndarray else backend.array_module(x)


# --------------------------------------------------------------------------- CuPy


_PINNED: dict[int, np.ndarray] = {}


def _pinned(slot: int, like: Any) -> np.ndarray:
    """A pinned host array shaped like ``like`` from a per-slot, grow-only pool."""
    nbytes = like.nbytes
    pool = _PINNED.get(slot)
    if pool is None or pool.nbytes < nbytes:
        import cupyx  # only reached with CuPy arrays
        # Grow at least 2x: a few allocations even when message sizes creep up.
        size = max(nbytes, 2 * pool.nbytes if pool is not None else 1)
        _PINNED[slot] = pool = cupyx.empty_pinned((size,), np.uint8)
    return pool[:nbytes].view(like.dtype).reshape(like.shape)


def _to_wire(send: Any, recv: Any) -> tuple[Any, Any]:
    """Device buffers as MPI should see them: themselves, or pinned host copies.

    ``send`` may be ``MPI.IN_PLACE``, in which case ``recv`` holds the input.
    """
    backend.synchronize(recv)  # kernels writing either buffer ran on this stream
    if backend.cuda_aware():
        return send, recv
    host_recv = _pinned(1, recv)
    if send is MPI.IN_PLACE:
        recv.get(out=host_recv)
        host_send = send
    else:
        host_send = _pinned(0, send)
        send.get(out=host_send)
    backend.synchronize(recv)
    return host_send, host_recv


def _from_wire(recv: Any, wire_recv: Any) -> None:
    if wire_recv is not recv:
        recv.set(wire_recv)
        # The pinned buffer is reused by the next call: the copy must be done.
        backend.synchronize(recv)
