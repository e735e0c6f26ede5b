"""Layer normalization over the last axis with hand-written backward."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy

from .core import Module, Parameter
from .linear import check_input

__all__ = ["LayerNorm"]


class LayerNorm(Module):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last axis.

    Parameters
    ----------
    normalized_shape : int or (int,)
        Size of the last (hidden) axis.
    eps : float, default 1e-5
        Added to the (biased) variance.
    elementwise_affine : bool, default True
        Whether to learn ``weight`` (gamma, init 1) and ``bias`` (beta, init 0).
    dtype : dtype, default numpy.float32
        Parameter dtype; inputs must have it too.
    xp : module, optional
        ``numpy`` (default) or ``cupy``.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        dtype: Any = numpy.float32,
        xp: ModuleType | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(normalized_shape, int):
            if len(normalized_shape) != 1:
                raise ValueError(
                    f"LayerNorm normalizes the last axis only; got normalized_shape={normalized_shape}"
                )
            normalized_shape = normalized_shape[0]
        xp = numpy if xp is None else xp
        self.hidden = int(normalized_shape)
        self.eps = float(eps)
        self.dtype = numpy.dtype(dtype)
        if elementwise_affine:
            self.weight = Parameter(xp.ones(self.hidden, dtype=dtype))
            self.bias = Parameter(xp.zeros(self.hidden, dtype=dtype))
        else:
            self.weight = None
            self.bias = None

    def extra_repr(self) -> str:
        """Return the constructor arguments shown by ``repr``."""
        return f"{self.hidden}, eps={self.eps}, affine={self.weight is not None}"

    def forward(self, x: Any) -> Any:
        """Normalize ``x`` of shape ``(..., hidden)``."""
        from pympar.backend import array_module

        check_input(self, x, self.hidden, self.dtype)
        xp = array_module(x)
        # C order lets every later reshape to (rows, hidden) be a view.
        x = xp.ascontiguousarray(x)
        xhat = x - x.mean(axis=-1, keepdims=True)
        # The output buffer doubles as scratch for the squared deviations.
        y = xp.multiply(xhat, xhat)
        rstd = y.mean(axis=-1, keepdims=True)
        rstd += self.eps
        xp.sqrt(rstd, out=rstd)
        xp.reciprocal(rstd, out=rstd)
        xhat *= rstd
        if self.weight is None:
            y[...] = xhat
        else:
            xp.multiply(xhat, self.weight.data, out=y)
            y += self.bias.data
        self.save_for_backward(xhat, rstd)
        return y

    def backward(self, dy: Any) -> Any:
        """Return ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * weight``."""
        from pympar.backend import array_module

        xhat, rstd = self.saved_tensors()
        if dy.shape != xhat.shape:
            raise ValueError(f"{self!r}: expected dy of shape {xhat.shape}, got {dy.shape}")
        xp = array_module(dy)
        dy = xp.ascontiguousarray(dy)
        dy2d = dy.reshape(-1, self.hidden)
        xhat2d = xhat.reshape(-1, self.hidden)
        if self.weight is not None:
            # einsum reduces the product without materializing dy * xhat.
            self.weight.accumulate_grad(xp.einsum("ij,ij->j", dy2d, xhat2d), consume=True)
            self.bias.accumulate_grad(dy2d.sum(axis=0), consume=True)
            g = xp.multiply(dy, self.weight.data)
        else:
            g = dy.copy()
        g2d = g.reshape(-1, self.hidden)
        mean_gx = xp.einsum("ij,ij->i", g2d, xhat2d)[:, None]
        mean_gx /= self.hidden
        g2d -= g2d.mean(axis=-1, keepdims=True)
        # The cached xhat is not needed after this backward, so it becomes scratch.
        xhat2d *= mean_gx
        g2d -= xhat2d
        g2d *= rstd.reshape(-1, 1)
        return g
