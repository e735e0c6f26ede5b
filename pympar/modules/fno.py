"""Fourier neural operator building blocks: a spectral block, and which gradients sum where.

An FNO is ``Sequential(Linear(c_in, width), SpectralBlock(width, ...), ..., Linear(width,
c_out))``: lifting and projection are plain :class:`~pympar.modules.Linear` layers over the
channels, replicated over the spatial group; the spectral weights are split by mode over it
(:mod:`pympar.modules.spectral`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Sequence

import numpy

from ..group import Group
from .activations import GELU
from .core import Module
from .linear import Linear
from .parameter import Parameter
from .spectral import SpectralConv

__all__ = ["SpectralBlock", "split_parameters"]


def split_parameters(module: Module) -> tuple[list[Parameter], list[Parameter]]:
    """The parameters of ``module`` whose gradients sum over the data x spatial group
    (replicated ones), and those whose gradients sum over the data-parallel group only (split
    by mode over the spatial group: their gradients are already complete there).

    Examples
    --------
    ``replicated, split = split_parameters(model)``, then
    ``allreduce_gradients(replicated, data_spatial)`` and ``allreduce_gradients(split, data)``.
    """
    params = module.parameters()
    return ([p for p in params if p.placement.replicated],
            [p for p in params if not p.placement.replicated])


class SpectralBlock(Module):
    """One Fourier layer of an FNO: ``gelu(spectral(x) + pointwise(x))``.

    ``pointwise`` is a :class:`~pympar.modules.Linear` over the channels (FNO's 1x1
    convolution), replicated over ``group``: its gradients are partial sums over the spatial
    group (see :func:`split_parameters`). Lifting and projection are plain ``Linear`` layers
    too, so an FNO is ``Sequential(Linear(c_in, w), SpectralBlock(w, ...), ..., Linear(w, c_out))``.

    Parameters
    ----------
    channels : int
        Width (channels in and out).
    modes : int or sequence of int
        Modes per spatial axis; ``len(modes)`` (or ``dims``) spatial axes.
    group : Group, optional
        The spatial group that splits ``x1`` (see :class:`SpectralConv`).
    dims : int, optional
        Spatial axes when ``modes`` is an int (default 2).
    activation : bool, default True
        False leaves out the GELU (FNO's last Fourier layer).
    dtype, seed, xp, input_grad
        As :class:`SpectralConv`; the pointwise layer gets ``seed + 1``.
    """

    def __init__(self, channels: int, modes: int | Sequence[int], group: Group | None = None,
                 dims: int | None = None, activation: bool = True, dtype: Any = numpy.float32,
                 seed: int = 0, xp: ModuleType | None = None, input_grad: bool = True) -> None:
        super().__init__()
        if isinstance(modes, (int, numpy.integer)):
            modes = (int(modes),) * (2 if dims is None else int(dims))
        self.spectral = SpectralConv(channels, channels, modes, group, dtype, seed, xp,
                                     input_grad)
        self.pointwise = Linear(channels, channels, dtype=dtype, seed=seed + 1, xp=xp,
                                input_grad=input_grad)
        self.act = GELU() if activation else None
        self.input_grad = bool(input_grad)
        # The spectral layer's collectives run under this label, which their checks compare
        # (with the spectral layer's own settings): the activation is local work.
        self.label_calls(f"SpectralBlock(activation={self.act is not None})")

    def forward(self, x: Any) -> Any:
        """``gelu(spectral(x) + pointwise(x))`` of a ``(batch, x1 block, ..., channels)`` field."""
        with self._labels["forward"]:
            y = self.spectral.forward(x)
        y += self.pointwise.forward(x)
        return y if self.act is None else self.act.forward(y)

    def backward(self, dy: Any) -> Any:
        """The input gradient (None with ``input_grad=False``); accumulates the parameters'."""
        g = dy
        if self.act is not None:
            try:
                g = self.act.backward(dy)
            except (TypeError, ValueError) as err:  # the others are about to exchange
                self.spectral._refuse(err, "backward")
                raise
        with self._labels["backward"]:
            dx = self.spectral.backward(g)
        dp = self.pointwise.backward(g)
        if dx is None:
            return None
        dx += dp
        return dx
