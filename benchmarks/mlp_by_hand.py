"""The tensor-parallel MLP step of ``bench_mlp.py`` written by hand with NumPy and mpi4py.

No pympar: the same Megatron step (column-split ``fc1``, local GELU, row-split ``fc2``, one
all-reduce of the output forward and one of the input gradient backward) on the same
weights, with the same BLAS calls, the same tanh-approximation GELU blocked the same way,
and fresh gradients every step. It is the limit for this stack: pympar's TP step is
measured against it, so that what remains is pympar's own machinery.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from mpi4py import MPI

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715
_BLOCK = 1 << 15  # elements per pass, as pympar's GELU


def _gelu_forward(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> None:
    """``t = tanh(k x (1 + c x^2))``, ``y = 0.5 x (1 + t)``, block by block."""
    xf, tf, yf = x.reshape(-1), t.reshape(-1), y.reshape(-1)
    for i in range(0, xf.size, _BLOCK):
        xb, tb, yb = xf[i:i + _BLOCK], tf[i:i + _BLOCK], yf[i:i + _BLOCK]
        np.multiply(xb, xb, out=tb)
        tb *= _K * _C
        tb += _K
        tb *= xb
        np.tanh(tb, out=tb)
        np.add(tb, 1.0, out=yb)
        yb *= xb
        yb *= 0.5


def _gelu_backward(x: np.ndarray, t: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """``dx = dy * 0.5 (1 + T) [1 + k x (1 + 3c x^2) (1 - T)]``; overwrites ``t``."""
    xf, tf, df, gf = x.reshape(-1), t.reshape(-1), dy.reshape(-1), dx.reshape(-1)
    for i in range(0, xf.size, _BLOCK):
        xb, tb, db, gb = (a[i:i + _BLOCK] for a in (xf, tf, df, gf))
        np.multiply(xb, xb, out=gb)
        gb *= 3.0 * _C * _K
        gb += _K
        gb *= xb
        np.subtract(1.0, tb, out=tb)
        gb *= tb
        gb += 1.0
        np.subtract(2.0, tb, out=tb)
        gb *= tb
        gb *= 0.5
        gb *= db


class HandWrittenTP:
    """``fc1`` rows and ``fc2`` columns of this rank (balanced split of the ``ffn`` axis).

    Parameters
    ----------
    w1, b1, w2, b2 : numpy.ndarray
        The full serial weights ``(ffn, hidden)``, ``(ffn,)``, ``(hidden, ffn)``, ``(hidden,)``.
    comm : mpi4py.MPI.Comm
        The tensor-parallel ranks.
    """

    def __init__(self, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray,
                 comm: MPI.Comm) -> None:
        rows = np.array_split(np.arange(w1.shape[0]), comm.Get_size())[comm.Get_rank()]
        lo, hi = int(rows[0]) if rows.size else 0, int(rows[-1]) + 1 if rows.size else 0
        self.w1, self.b1 = np.ascontiguousarray(w1[lo:hi]), b1[lo:hi].copy()
        self.w2, self.b2 = np.ascontiguousarray(w2[:, lo:hi]), b2.copy()
        self.comm = comm
        self.grads: dict[str, Any] = {}
        self._spare: np.ndarray | None = None  # the GELU's tanh cache, reused as pympar does

    def step(self, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward with fresh gradients; returns ``(y, dx)``."""
        self.grads = {}
        h = np.empty((x.shape[0], self.w1.shape[0]), dtype=x.dtype)
        np.matmul(x, self.w1.T, out=h)
        h += self.b1
        t = self._spare if self._spare is not None and self._spare.shape == h.shape \
            else np.empty_like(h)
        self._spare = None
        a = np.empty_like(h)
        _gelu_forward(h, t, a)
        y = np.empty((x.shape[0], self.w2.shape[0]), dtype=x.dtype)
        np.matmul(a, self.w2.T, out=y)
        self.comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM)
        y += self.b2
        self.grads["w2"], self.grads["b2"] = dy.T @ a, dy.sum(axis=0)
        da = np.empty_like(a)
        np.matmul(dy, self.w2, out=da)
        dh = np.empty_like(h)
        _gelu_backward(h, t, da, dh)
        self._spare = t
        self.grads["w1"], self.grads["b1"] = dh.T @ x, dh.sum(axis=0)
        dx = np.empty_like(x)
        np.matmul(dh, self.w1, out=dx)
        self.comm.Allreduce(MPI.IN_PLACE, dx, op=MPI.SUM)
        return y, dx
