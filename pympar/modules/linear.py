"""Serial affine layer ``y = x @ W.T + b`` with hand-written backward."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Union

import numpy

from .core import Module, Parameter
from .init import InitMethod, bias_init, initialize_affine_weight

__all__ = ["Linear", "check_input"]


def check_input(layer: Module, x: Any, last_dim: int, dtype: Any) -> None:
    """Raise ``ValueError`` naming ``layer`` unless ``x`` is ``(..., last_dim)`` of ``dtype``.

    Parameters
    ----------
    layer : Module
        The layer, shown by its ``repr`` in the message.
    x : array
        The input to check.
    last_dim : int
        Required size of the last axis.
    dtype : dtype
        Required dtype (no silent casts: a cast would copy every activation).
    """
    if x.ndim < 1 or x.shape[-1] != last_dim or x.dtype != dtype:
        raise ValueError(
            f"{layer!r}: expected input of shape (..., {last_dim}) and dtype "
            f"{numpy.dtype(dtype).name}, got shape {tuple(x.shape)} and dtype {x.dtype}"
        )


class Linear(Module):
    """Affine layer ``y = x @ W.T + b`` over the last axis.

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the input and output last axes.
    bias : bool, default True
        Whether to add a learnable bias.
    init_method : str or InitMethod, default "kaiming_uniform"
        Weight init (see :mod:`pympar.modules.init`); the default matches ``torch.nn.Linear``
        (bound ``1/sqrt(in_features)``). The bias always uses the ``torch.nn.Linear`` default.
    dtype : dtype, default numpy.float32
        Parameter dtype; inputs must have it too.
    seed : int, default 0
        Init seed. Layers with the same seed and shape start identical: give each layer its own.
    xp : module, optional
        ``numpy`` (default) or ``cupy``.

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
    ) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.dtype = numpy.dtype(dtype)
        w = initialize_affine_weight(
            (self.out_features, self.in_features), 1, 0, init_method, dtype,
            rank=0, seed=seed, xp=xp,
        )
        self.weight = Parameter(w)
        if bias:
            b = bias_init(self.out_features, self.in_features, 1, dtype, rank=0, seed=seed, xp=xp)
            self.bias = Parameter(b)
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
        from pympar.backend import array_module

        check_input(self, x, self.in_features, self.dtype)
        xp = array_module(x)
        x2d = x.reshape(-1, self.in_features)
        y2d = xp.empty((x2d.shape[0], self.out_features), dtype=self.dtype)
        xp.matmul(x2d, self.weight.data.T, out=y2d)
        if self.bias is not None:
            y2d += self.bias.data
        self.save_for_backward(x2d, x.shape)
        return y2d.reshape(*x.shape[:-1], self.out_features)

    def backward(self, dy: Any) -> Any:
        """Return ``dy @ W``; accumulate ``dW += dy.T @ x`` and ``db += sum(dy)``."""
        x2d, x_shape = self.saved_tensors()
        expected = (*x_shape[:-1], self.out_features)
        if tuple(dy.shape) != expected:
            raise ValueError(f"{self!r}: expected dy of shape {expected}, got {tuple(dy.shape)}")
        dy2d = dy.reshape(-1, self.out_features)
        self.weight.accumulate_grad(dy2d.T @ x2d, consume=True)
        if self.bias is not None:
            self.bias.accumulate_grad(dy2d.sum(axis=0), consume=True)
        return (dy2d @ self.weight.data).reshape(x_shape)
