"""Serial affine layer ``y = x @ W.T + b`` with hand-written backward."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Union

import numpy

from ..backend import array_module
from ..partition import Placement
from .core import Module
from .validation import check_array
from .parameter import Parameter
from .init_methods import InitMethod
from .sharded_init import init_bias, init_shard

__all__ = ["Linear"]


class Linear(Module):
    """Affine layer ``y = x @ W.T + b`` over the last axis.

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the input and output last axes.
    bias : bool, default True
        Whether to add a learnable bias.
    init_method : str or InitMethod, default "kaiming_uniform"
        Weight init (see :mod:`pympar.modules.init_methods`); the default matches ``torch.nn.Linear``
        (bound ``1/sqrt(in_features)``). The bias always uses the ``torch.nn.Linear`` default.
    dtype : dtype, default numpy.float32
        Parameter dtype; inputs must have it too.
    seed : int, default 0
        Init seed. Layers with the same seed and shape start identical: give each layer its own.
    xp : module, optional
        ``numpy`` (default) or ``cupy``.
    input_grad : bool, default True
        False: ``backward`` computes no input gradient and returns None (a first layer,
        whose input is data).

    Attributes
    ----------
    weight : Parameter
        Shape ``(out_features, in_features)``.
    bias : Parameter or None
        Shape ``(out_features,)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Union[str, InitMethod] = "kaiming_uniform",
        dtype: Any = numpy.float32,
        seed: int = 0,
        xp: ModuleType | None = None,
        input_grad: bool = True,
    ) -> None:
        super().__init__()
        self.input_grad = bool(input_grad)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.dtype = numpy.dtype(dtype)
        placement = Placement((self.out_features, self.in_features))
        self.weight = Parameter(init_shard(placement, init_method, dtype, seed=seed, xp=xp),
                                placement=placement)
        if bias:
            placement = Placement((self.out_features,))
            self.bias = Parameter(init_bias("uniform", placement, self.in_features, dtype,
                                            seed=seed, xp=xp, layer="Linear"),
                                  placement=placement)
        else:
            self.bias = None

    def extra_repr(self) -> str:
        """Return the constructor arguments shown by ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype.name}"
        )

    def forward(self, x: Any) -> Any:
        """Return ``x @ W.T + b`` for ``x`` of shape ``(..., in_features)``."""
        check_array(self, x, self.in_features, self.dtype)
        xp = array_module(x)
        x2d = x.reshape(-1, self.in_features)
        y2d = xp.empty((x2d.shape[0], self.out_features), dtype=self.dtype)
        xp.matmul(x2d, self.weight.data.T, out=y2d)
        if self.bias is not None:
            y2d += self.bias.data
        self.save_for_backward(x2d, x.shape)
        return y2d.reshape(*x.shape[:-1], self.out_features)

    def backward(self, dy: Any) -> Any:
        """Return ``dy @ W`` (None with ``input_grad=False``); accumulate ``dW += dy.T @ x``
        and ``db += sum(dy)`` for the parameters that are not frozen."""
        x2d, x_shape = self.saved_tensors()
        check_array(self, dy, None, self.dtype, what="output gradient",
                    shape=(*x_shape[:-1], self.out_features))
        xp = array_module(dy)
        dy2d = dy.reshape(-1, self.out_features)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(dy2d.T @ x2d, consume=True)
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(dy2d.sum(axis=0), consume=True)
        if not self.input_grad:
            return None
        dx2d = xp.empty((dy2d.shape[0], self.in_features), dtype=self.dtype)
        xp.matmul(dy2d, self.weight.data, out=dx2d)  # out=: bfloat16 matmul returns float32
        return dx2d.reshape(x_shape)
