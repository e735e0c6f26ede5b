"""Layer normalization over the last axis with hand-written backward.

The math is written once, in :func:`layer_norm_forward` and :func:`layer_norm_backward`,
over a *row-sum* function: the serial :class:`LayerNorm` sums each row locally, the 3D
:class:`~pympar.modules.LayerNorm3D` sums its hidden block and all-reduces the sums.
"""

from __future__ import annotations

import math

from types import ModuleType
from typing import Any, Callable, Sequence

import numpy

from ..backend import array_module, is_bfloat16
from ..partition import Placement
from .core import Module
from .validation import check_array
from .parameter import Parameter

__all__ = ["LayerNorm", "RowSums", "local_row_sums", "layer_norm_forward", "layer_norm_backward"]

RowSums = Callable[..., Sequence[Any]]
"""``row_sums(*terms) -> sums``: per term, the sum over the full hidden axis of each row,
shaped ``(..., 1)``. A term is an array ``a`` (sum of ``a``) or a pair ``(a, b)`` (sum of
``a * b``)."""


def local_row_sums(*terms: Any) -> list[Any]:
    """The :data:`RowSums` of arrays that hold whole rows."""
    sums = []
    for term in terms:
        if isinstance(term, tuple):
            a, b = term
            # einsum reduces the product without materializing a * b (it has no bfloat16).
            s = (array_module(a).einsum("...j,...j->...", a, b)[..., None] if not is_bfloat16(a.dtype)
                 else (a * b).sum(axis=-1, keepdims=True))
        else:
            s = term.sum(axis=-1, keepdims=True)
        sums.append(s)
    return sums


def layer_norm_forward(x: Any, weight: Any, bias: Any, eps: float, hidden: int,
                       row_sums: RowSums) -> tuple[Any, Any, Any]:
    """Return ``y, xhat, rstd``: the normalized, scaled output and what backward needs.

    Parameters
    ----------
    x : array
        ``(..., h)`` where ``h`` is this rank's part of the hidden axis (all of it serially).
    weight, bias : array or None
        ``(h,)`` gamma and beta, or None for no affine transform.
    eps : float
        Added to the biased variance.
    hidden : int
        The full hidden size (the divisor of the means).
    row_sums : RowSums
        Sums over the full hidden axis.
    """
    xp = array_module(x)
    # C order lets every later reshape to (rows, h) be a view.
    x = xp.ascontiguousarray(x)
    (mean,) = row_sums(x)
    mean /= hidden
    xhat = x - mean
    (rstd,) = row_sums((xhat, xhat))
    rstd /= hidden
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    if weight is None:
        return xhat.copy(), xhat, rstd
    y = xp.multiply(xhat, weight)
    y += bias
    return y, xhat, rstd


def layer_norm_backward(dy: Any, xhat: Any, rstd: Any, weight: Any, hidden: int,
                        row_sums: RowSums, *, param_grads: bool = True,
                        input_grad: bool = True) -> tuple[Any, Any, Any]:
    """Return ``dx, dgamma_local, dbeta_local`` (each None when not asked for).

    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * weight``; the
    parameter gradients are this rank's row sums (a layer sharing parameters over other rows
    reduces them). The cached ``xhat`` is used as scratch: call once per forward.
    """
    xp = array_module(dy)
    dy = xp.ascontiguousarray(dy)
    dgamma = dbeta = dx = None
    if param_grads and weight is not None:
        # (not reshape(-1, n): a rank may hold no hidden columns, n == 0)
        rows = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])
        xhat2d = xhat.reshape(rows.shape)
        dgamma = (xp.einsum("ij,ij->j", rows, xhat2d) if not is_bfloat16(rows.dtype)
                  else (rows * xhat2d).sum(axis=0))
        dbeta = rows.sum(axis=0)
    if input_grad:
        dx = dy.copy() if weight is None else xp.multiply(dy, weight)
        mean_g, mean_gx = row_sums(dx, (dx, xhat))
        mean_g /= hidden
        mean_gx /= hidden
        dx -= mean_g
        xhat *= mean_gx
        dx -= xhat
        dx *= rstd
    return dx, dgamma, dbeta


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
    input_grad : bool, default True
        False: ``backward`` computes no input gradient and returns None (a first layer).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        dtype: Any = numpy.float32,
        xp: ModuleType | None = None,
        input_grad: bool = True,
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
        self.input_grad = bool(input_grad)
        if elementwise_affine:
            placement = Placement((self.hidden,))
            self.weight = Parameter(xp.ones(self.hidden, dtype=dtype), placement=placement)
            self.bias = Parameter(xp.zeros(self.hidden, dtype=dtype), placement=placement)
        else:
            self.weight = None
            self.bias = None

    def extra_repr(self) -> str:
        """Return the constructor arguments shown by ``repr``."""
        return f"{self.hidden}, eps={self.eps}, affine={self.weight is not None}"

    def forward(self, x: Any) -> Any:
        """Normalize ``x`` of shape ``(..., hidden)``."""
        check_array(self, x, self.hidden, self.dtype)
        weight = None if self.weight is None else self.weight.data
        bias = None if self.bias is None else self.bias.data
        y, xhat, rstd = layer_norm_forward(x, weight, bias, self.eps, self.hidden,
                                           local_row_sums)
        self.save_for_backward(xhat, rstd)
        return y

    def backward(self, dy: Any) -> Any:
        """Return the input gradient (None with ``input_grad=False``); accumulate the
        gradients of unfrozen ``weight`` and ``bias``."""
        xhat, rstd = self.saved_tensors()
        check_array(self, dy, None, self.dtype, what="output gradient", shape=xhat.shape)
        weight = None if self.weight is None else self.weight.data
        dx, dgamma, dbeta = layer_norm_backward(
            dy, xhat, rstd, weight, self.hidden, local_row_sums,
            param_grads=self.weight is not None and (self.weight.requires_grad
                                                     or self.bias.requires_grad),
            input_grad=self.input_grad)
        if dgamma is not None:
            if self.weight.requires_grad:
                self.weight.accumulate_grad(dgamma, consume=True)
            if self.bias.requires_grad:
                self.bias.accumulate_grad(dbeta, consume=True)
        return dx
