"""Element-wise activations and dropout with hand-written backward.

The GELU here is written with in-place ``out=`` ufuncs because element-wise NumPy dominates
its cost: a naive ``x**3`` form was measured 20x slower in float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy

from ..backend import array_module
from .core import Module
from .layout_tags import carry
from .philox import DROPOUT_STREAM
from .validation import check_array

__all__ = ["GELU", "ReLU", "Dropout"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


#: Elements per block of GELU's element-wise passes on NumPy arrays: small enough that a
#: block's operands (x, T, y or dy, dx: 128 KiB each in float32) stay in the L2 cache while
#: the ~8 passes run over them, large enough that the ~1 us cost of a ufunc call is small.
#: Unblocked, every pass streams the whole array through memory; that made GELU a quarter of
#: a tensor-parallel MLP step (benchmarks/README.md).
_GELU_BLOCK = 1 << 15


class GELU(Module):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Forward allocates the output and one cached array (the tanh value); backward allocates
    only ``dx`` and turns the cached array into scratch, which the next forward of the same
    shape reuses. On NumPy arrays both run block by block (``_GELU_BLOCK`` elements) so that
    all passes over a block hit the cache; CuPy arrays take whole-array passes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._spare = None

    def _buffer(self, like: Any) -> Any:
        """A C-ordered array shaped like ``like``: the spare one, else a new one (the
        blocked passes write it through a flat view, which an F-ordered one would copy)."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.shape == like.shape and spare.dtype == like.dtype:
            if type(spare) is type(like):
                return spare
        return array_module(like).empty(like.shape, like.dtype)

    @staticmethod
    def _forward_into(xp: Any, x: Any, t: Any, y: Any) -> None:
        """``t = tanh(k x (1 + c x^2))``, ``y = 0.5 x (1 + t)`` on same-shaped arrays."""
        # k x (1 + c x^2) = x (k + (k c) x^2): multiplying x*x avoids a slow integer power.
        xp.multiply(x, x, out=t)
        t *= _SQRT_2_OVER_PI * _GELU_C
        t += _SQRT_2_OVER_PI
        t *= x
        xp.tanh(t, out=t)
        xp.add(t, 1.0, out=y)
        y *= x
        y *= 0.5

    @staticmethod
    def _backward_into(xp: Any, x: Any, t: Any, dy: Any, dx: Any) -> None:
        """``dx = dy * 0.5 (1 + T) [1 + k x (1 + 3c x^2) (1 - T)]``; overwrites ``t``."""
        xp.multiply(x, x, out=dx)
        dx *= 3.0 * _GELU_C * _SQRT_2_OVER_PI
        dx += _SQRT_2_OVER_PI
        dx *= x
        xp.subtract(1.0, t, out=t)  # t = 1 - T
        dx *= t
        dx += 1.0
        xp.subtract(2.0, t, out=t)  # t = 1 + T
        dx *= t
        dx *= 0.5
        dx *= dy

    def forward(self, x: Any) -> Any:
        """Apply GELU element-wise."""
        xp = array_module(x)
        t = self._buffer(x)
        y = xp.empty_like(x)
        if xp is numpy and x.flags.c_contiguous:
            xf, tf, yf = x.reshape(-1), t.reshape(-1), y.reshape(-1)
            block = _GELU_BLOCK
            for i in range(0, xf.size, block):
                j = i + block
                self._forward_into(xp, xf[i:j], tf[i:j], yf[i:j])
        else:
            self._forward_into(xp, x, t, y)
        self.save_for_backward(x, t)
        return carry(x, y)

    def backward(self, dy: Any) -> Any:
        """Return ``dy * gelu'(x)``.

        ``gelu'(x) = 0.5 (1 + T) [1 + k x (1 + 3c x^2) (1 - T)]`` with ``T`` the cached tanh,
        an arrangement that needs no scratch beyond ``dx`` and the cached ``T``.
        """
        x, t = self.saved_tensors()
        check_array(self, dy, None, x.dtype, "output gradient", x.shape)
        xp = array_module(x)
        dx = xp.empty_like(x)
        if xp is numpy and x.flags.c_contiguous and dy.flags.c_contiguous:
            xf, tf, df, gf = x.reshape(-1), t.reshape(-1), dy.reshape(-1), dx.reshape(-1)
            block = _GELU_BLOCK
            for i in range(0, xf.size, block):
                j = i + block
                self._backward_into(xp, xf[i:j], tf[i:j], df[i:j], gf[i:j])
        else:
            self._backward_into(xp, x, t, dy, dx)
        self._spare = t
        return carry(dy, dx)


class ReLU(Module):
    """``max(x, 0)``; backward passes ``dy`` where ``x > 0``."""

    def forward(self, x: Any) -> Any:
        """Apply ReLU element-wise."""
        xp = array_module(x)
        mask = x > 0
        self.save_for_backward(mask, x.dtype)
        return carry(x, xp.multiply(x, mask))

    def backward(self, dy: Any) -> Any:
        """Return ``dy`` masked by ``x > 0``."""
        mask, dtype = self.saved_tensors()
        check_array(self, dy, None, dtype, "output gradient", mask.shape)
        return carry(dy, array_module(dy).multiply(dy, mask))


class Dropout(Module):
    """Inverted dropout: zero each element with probability ``p``, scale the rest by 1/(1-p).

    The mask is drawn from a Philox stream keyed by ``seed`` and positioned by
    ``(call counter, rank)``, so a run is reproducible and ranks draw different masks.
    Masks are drawn on the host (identical for NumPy and CuPy inputs) and copied to the device.
    In evaluation mode (``.eval()``) forward and backward are the identity.

    Parameters
    ----------
    p : float, default 0.5
        Drop probability, ``0 <= p <= 1``.
    seed : int, default 0
        Philox key, ``0 <= seed < 2**64``.
    rank : int, optional
        The rank index mixed into the stream (e.g. the tensor-parallel rank when activations
        are sharded); ``None`` means 0.

    Attributes
    ----------
    calls : int
        Number of training-mode forwards so far (the stream position of the next mask).
    """

    def __init__(self, p: float = 0.5, seed: int = 0, rank: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"Dropout: seed must be in [0, 2**64), got {seed}")
        self.p = float(p)
        self.seed = int(seed)
        self.rank = 0 if rank is None else int(rank)
        self.calls = 0

    def extra_repr(self) -> str:
        """Return the constructor arguments shown by ``repr``."""
        return f"p={self.p}, seed={self.seed}, rank={self.rank}"

    def _mask(self, x: Any) -> Any:
        counter = [0, self.calls, self.rank, DROPOUT_STREAM]
        bitgen = numpy.random.Philox(key=self.seed, counter=counter)
        self.calls += 1
        # Comparing uniforms in x's float precision keeps the mask draw as cheap as the multiply.
        draw_dtype = numpy.float64 if x.dtype == numpy.float64 else numpy.float32
        keep = numpy.random.Generator(bitgen).random(x.shape, dtype=draw_dtype) >= self.p
        mask = keep.astype(x.dtype)
        # p == 1 keeps nothing; the scale would be infinite and 0 * inf is nan.
        mask *= 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        return array_module(x).asarray(mask)

    def forward(self, x: Any) -> Any:
        """Return ``x * mask / (1 - p)`` in training mode, ``x`` in evaluation mode."""
        if not self.training or self.p == 0.0:
            self.save_for_backward(None, x.shape, x.dtype)
            return x
        mask = self._mask(x)
        self.save_for_backward(mask, x.shape, x.dtype)
        return carry(x, x * mask)

    def backward(self, dy: Any) -> Any:
        """Apply the forward's mask (and scale) to ``dy``."""
        mask, shape, dtype = self.saved_tensors()
        check_array(self, dy, None, dtype, "output gradient", shape)
        return dy if mask is None else carry(dy, dy * mask)
