"""Shared pieces of the layer tests: array modules, tolerances, serial references."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from gpu_stand_in import cupy_in_mode
from pympar.group import Group

#: NumPy, and CuPy with device buffers staged through the host and given to MPI directly.
XPS = [pytest.param("numpy", id="numpy"),
       pytest.param("cupy-staged", id="cupy-staged", marks=pytest.mark.gpu),
       pytest.param("cupy-aware", id="cupy-aware", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(np.float64, id="f64"), pytest.param(np.float32, id="f32")]


def get_xp(name: str):
    """The array module for a test parameter (see :func:`gpu_stand_in.cupy_in_mode`)."""
    if name == "numpy":
        return np
    return cupy_in_mode(name.split("-")[1])


def tolerance(dtype) -> dict:
    """Comparison tolerances: float64 to ~1e-12, float32 to ~1e-5."""
    if np.dtype(dtype) == np.float64:
        return {"rtol": 1e-10, "atol": 1e-12}
    return {"rtol": 1e-5, "atol": 2e-5}


def self_group() -> Group:
    """A size-1 group of this rank alone: the serial reference of any layer."""
    return Group(MPI.COMM_SELF, f"self-{MPI.COMM_WORLD.Get_rank()}",
                 [MPI.COMM_WORLD.Get_rank()], owns_comm=False)


def rng_array(seed: int, shape, dtype, xp=np):
    """The same random array on every rank (generated on the host)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return data if xp is np else xp.asarray(data)


def owned(n: int, parts: int, index: int, stride: int = 1) -> np.ndarray:
    """Indices rank ``index`` of ``parts`` holds of an axis of ``n`` items, from NumPy itself:
    ``numpy.array_split`` into ``stride`` fused parts, then each part over the ranks."""
    fused = np.array_split(np.arange(n), stride)
    return np.concatenate([np.array_split(part, parts)[index] for part in fused])


def block(n: int, parts: int, index: int) -> slice:
    """numpy.array_split's block ``index`` of ``n`` items in ``parts``, as a slice."""
    sizes = [len(b) for b in np.array_split(np.arange(n), parts)]
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


def numeric_grad(f, a, eps=1e-6):
    """Central differences of scalar ``f()`` with respect to every element of ``a`` (in place)."""
    g = np.empty_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        hi = f()
        flat[i] = old - eps
        lo = f()
        flat[i] = old
        gflat[i] = (hi - lo) / (2 * eps)
    return g
