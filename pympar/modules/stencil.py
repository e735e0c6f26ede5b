"""Stencil layers on a decomposed field, built on the halo exchange, with hand-written backward.

Both layers take each rank's block of a field split by a
:class:`~pympar.decomposition.Decomposition`, fill its ghosts with a
:class:`~pympar.halo.HaloExchange` (``forward``: zeros where a non-periodic field ends),
apply the stencil to the padded block, and in backward scatter the output gradient onto the
padded block and send the ghosts' part home (``HaloExchange.backward``). The result equals
the serial stencil applied to the whole field, with periodic wrap or zero padding.

- :class:`Laplacian`: the second-order central-difference Laplacian, no parameters.
- :class:`HaloConv`: an n-d convolution (cross-correlation, as ``torch.nn.Conv2d`` with
  ``padding="same"``) with a learnable kernel and bias, replicated on every rank of the
  spatial groups; their gradients are summed over those groups in backward.
"""

from __future__ import annotations

import itertools
import math
from types import ModuleType
from typing import Any, Sequence

import numpy

from ..backend import array_module, is_cupy_array
from ..decomposition import agree_all
from ..halo import HaloExchange
from ..partition import Placement
from .core import Module, described_init
from .validation import check_array
from .parameter import Parameter
from .sharded_init import init_bias, init_shard

__all__ = ["Laplacian", "HaloConv"]


def _check_halo(layer: str, halo: Any, reach: Sequence[int]) -> None:
    """Refuse a halo narrower than the stencil's ``reach`` per axis (the same on every rank)."""
    if not isinstance(halo, HaloExchange):
        raise TypeError(f"{layer}: halo must be a pympar HaloExchange, not {type(halo).__name__}")
    if len(reach) != halo.decomposition.ndim:
        raise ValueError(f"{layer}: a {len(reach)}-d stencil on a "
                         f"{halo.decomposition.ndim}-d field")
    short = [a for a, (r, (lo, hi)) in enumerate(zip(reach, halo.widths)) if min(lo, hi) < r]
    if short:
        raise ValueError(f"{layer}: the stencil reaches {tuple(reach)} cells per axis but the "
                         f"halo's widths are {halo.widths} (axis {short[0]} is too narrow)")


def _checked(layer: Module, halo: HaloExchange, x: Any, what: str, dtype: Any,
             shape: tuple[int, ...], whole_groups: bool = False) -> None:
    """:func:`check_array`, refused in the agreement check the other ranks make next: the
    halo's, with the neighbours (or, ``whole_groups``, the layer's own over the spatial
    groups), so that a rank whose array does not fit makes them raise instead of leaving
    them waiting."""
    try:
        check_array(layer, x, None, dtype, what=what, shape=shape)
    except (TypeError, ValueError) as err:
        shown = f"{type(layer).__name__}.{what}"
        if whole_groups:
            agree_all(halo.decomposition.split_groups(), (), shown, err)
        with layer._labels["backward" if "gradient" in what else "forward"]:
            halo.refuse(shown, err)


def _is_array(x: Any) -> bool:
    return isinstance(x, numpy.ndarray) or is_cupy_array(x)


def _window(halo: HaloExchange, lead: int, offset: Sequence[int]) -> tuple:
    """The index of the padded cells at ``offset`` from each interior cell."""
    return (slice(None),) * lead + tuple(
        slice(s.start + o, s.stop + o) for s, o in zip(halo.interior, offset))


class _Padded:
    """A padded buffer, reused while the shape, dtype and array module stay the same."""

    def __init__(self) -> None:
        self.array: Any = None

    def get(self, halo: HaloExchange, lead: tuple[int, ...], like: Any, zero: bool) -> Any:
        shape = (*lead, *halo.padded_shape)
        a = self.array
        if a is None or a.shape != shape or a.dtype != like.dtype or type(a) is not type(like):
            a = self.array = array_module(like).empty(shape, like.dtype)
        if zero:
            a.fill(0)
        return a

    def take(self, halo: HaloExchange, lead: tuple[int, ...], like: Any) -> Any:
        """:meth:`get` a buffer for a forward's cache: until :meth:`give` returns it, the
        next call makes another (a pipeline holds several forwards' caches at once)."""
        a = self.get(halo, lead, like, zero=False)
        self.array = None
        return a

    def give(self, a: Any) -> None:
        """Offer ``a``, taken before and no longer read, for reuse."""
        if self.array is None:
            self.array = a


class Laplacian(Module):
    """The central-difference Laplacian ``sum_a (u[i-1] - 2 u[i] + u[i+1]) / h_a**2``.

    Parameters
    ----------
    halo : HaloExchange
        The field's halo, at least one cell wide on each side of every axis. Along a
        non-periodic axis the field is taken as zero outside (homogeneous Dirichlet).
    spacing : float or sequence of float, default 1.0
        Grid spacing ``h`` per axis.
    """

    def __init__(self, halo: HaloExchange, spacing: float | Sequence[float] = 1.0) -> None:
        super().__init__()
        ndim = halo.decomposition.ndim if isinstance(halo, HaloExchange) else 0
        _check_halo("Laplacian", halo, (1,) * ndim)
        h = [float(spacing)] * ndim if numpy.isscalar(spacing) else [float(s) for s in spacing]
        if len(h) != ndim or min(h) <= 0:
            raise ValueError(f"Laplacian: spacing must be one positive number or one per axis "
                             f"({ndim}), got {spacing!r}")
        self.halo = halo
        self.spacing = tuple(h)
        self._padded = _Padded()
        # Its exchanges run under this label, which their check compares: the spacing only
        # scales the local stencil, so ranks passing another one would otherwise not raise.
        self.label_calls(f"Laplacian(spacing={self.spacing})")

    def extra_repr(self) -> str:
        """Return the settings shown by ``repr``."""
        return f"spacing={self.spacing}, {self.halo!r}"

    def _apply(self, src: Any, lead: int, out: Any, transpose: bool) -> None:
        """``out`` = the stencil of padded ``src`` (or, transposed, its scatter onto padded
        ``out`` from interior ``src``)."""
        d = self.halo.decomposition
        centre = -2.0 * sum(1.0 / h ** 2 for h in self.spacing)
        here = _window(self.halo, lead, (0,) * d.ndim)
        if transpose:
            out[here] += centre * src
        else:
            array_module(out).multiply(src[here], centre, out=out)
        for a, h in enumerate(self.spacing):
            for step in (-1, 1):
                offset = [0] * d.ndim
                offset[a] = step
                there = _window(self.halo, lead, offset)
                if transpose:
                    out[there] += src / h ** 2
                else:
                    out += src[there] / h ** 2

    def forward(self, u: Any) -> Any:
        """The Laplacian of this rank's block ``u`` of shape ``(*leading, *local_shape)``."""
        ndim = self.halo.decomposition.ndim
        out = None  # HaloExchange.forward refuses a misfit u on every rank
        if _is_array(u) and u.ndim >= ndim:
            out = self._padded.get(self.halo, u.shape[:u.ndim - ndim], u, zero=False)
        with self._labels["forward"]:
            padded = self.halo.forward(u, out=out)
        y = array_module(u).empty(u.shape, u.dtype)
        self._apply(padded, u.ndim - ndim, y, transpose=False)
        self.save_for_backward(tuple(u.shape), u.dtype)
        return y

    def backward(self, dy: Any) -> Any:
        """The gradient of the block: the transposed stencil, then the halo's adjoint."""
        shape, dtype = self.saved_tensors()
        if not self.input_grad:
            return None
        _checked(self, self.halo, dy, "output gradient", dtype, shape)
        lead = len(shape) - self.halo.decomposition.ndim
        dpad = self._padded.get(self.halo, shape[:lead], dy, zero=True)
        self._apply(dy, lead, dpad, transpose=True)
        with self._labels["backward"]:
            return array_module(dy).ascontiguousarray(self.halo.adjoint(dpad))


class HaloConv(Module):
    """An n-d convolution of a decomposed field with a learnable kernel ("same" padding).

    ``y[b, o, i] = bias[o] + sum_{c, k} weight[o, c, k] * x[b, c, i + k - r]`` for every
    cell ``i`` and kernel offset ``k`` (``r = kernel_size // 2``), as ``torch.nn.Conv2d``
    (cross-correlation) with ``padding="same"`` does: beyond a non-periodic end the field
    is zero, along a periodic axis it wraps around.

    Parameters
    ----------
    halo : HaloExchange
        The field's halo, at least ``kernel_size // 2`` wide on each side of every axis.
    in_channels, out_channels : int
        Channels of the input and the output (axis 1 of ``(batch, channels, *local_shape)``).
    kernel_size : int or sequence of int
        Odd kernel extents, one for all axes or one per axis.
    bias : bool, default True
        Whether to add a learnable bias per output channel.
    dtype : dtype, default numpy.float32
        Parameter dtype; inputs must have it too.
    seed : int, default 0
        Init seed: the same kernel on every rank (``torch``'s default bound,
        ``1/sqrt(in_channels * prod(kernel_size))``, for weight and bias).
    xp : module, optional
        ``numpy`` (default) or ``cupy``.
    input_grad : bool, default True
        False: ``backward`` computes no input gradient (and sends no halo) and returns None.

    Attributes
    ----------
    weight : Parameter
        ``(out_channels, in_channels, *kernel_size)``, replicated.
    bias : Parameter or None
        ``(out_channels,)``, replicated.

    Notes
    -----
    ``backward`` sums the parameters' gradients over the decomposition's groups (one
    all-reduce per split axis), so every rank of the spatial grid holds the whole
    gradient; a data-parallel sum on top is the optimizer's, as for every layer.
    """

    def __init__(self, halo: HaloExchange, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], bias: bool = True,
                 dtype: Any = numpy.float32, seed: int = 0, xp: ModuleType | None = None,
                 input_grad: bool = True) -> None:
        super().__init__()
        ndim = halo.decomposition.ndim if isinstance(halo, HaloExchange) else 0
        k = (int(kernel_size),) * ndim if numpy.isscalar(kernel_size) else \
            tuple(int(s) for s in kernel_size)
        if len(k) != ndim or any(s < 1 or s % 2 == 0 for s in k):
            raise ValueError(f"HaloConv: kernel_size must be odd, one for all axes or one per "
                             f"axis ({ndim}), got {kernel_size!r}")
        _check_halo("HaloConv", halo, tuple(s // 2 for s in k))
        self.halo, self.kernel_size = halo, k
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.dtype = numpy.dtype(dtype)
        self.input_grad = bool(input_grad)
        fan_in = self.in_channels * math.prod(k)
        # Drawn as the (out, in * prod(k)) matrix of the same fan-in, then reshaped.
        flat = init_shard(Placement((self.out_channels, fan_in)), "kaiming_uniform", dtype,
                          seed=seed, xp=xp)
        shape = (self.out_channels, self.in_channels, *k)
        self.weight = Parameter(flat.reshape(shape), placement=Placement(shape))
        self.bias = None
        if bias:
            placement = Placement((self.out_channels,))
            self.bias = Parameter(init_bias("uniform", placement, fan_in, dtype, seed=seed,
                                            xp=xp, layer="HaloConv"), placement=placement)
        self._offsets = list(itertools.product(*(range(s) for s in k)))
        self._padded, self._grad_padded = _Padded(), _Padded()
        # Its exchanges and reductions run under this label, which their checks compare:
        # the kernel, the bias and the init only shape the local convolution.
        self.label_calls(f"HaloConv({self.in_channels}->{self.out_channels}, kernel_size={k}, "
                         f"bias={bias}, dtype={self.dtype.name}, {described_init(seed)})")

    def extra_repr(self) -> str:
        """Return the constructor arguments shown by ``repr``."""
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"dtype={self.dtype.name}")

    def _windows(self) -> Any:
        """(kernel index, padded window index) for every kernel offset."""
        reach = [s // 2 for s in self.kernel_size]
        for index in self._offsets:
            yield index, _window(self.halo, 2, [i - r for i, r in zip(index, reach)])

    def forward(self, x: Any) -> Any:
        """Convolve this rank's block ``x`` of shape ``(batch, in_channels, *local_shape)``."""
        d = self.halo.decomposition
        batch = x.shape[0] if _is_array(x) and x.ndim else 0
        _checked(self, self.halo, x, "input", self.dtype,
                 (batch, self.in_channels, *d.local_shape))
        xp, cells = array_module(x), math.prod(d.local_shape)
        with self._labels["forward"]:
            padded = self.halo.forward(x, out=self._padded.take(self.halo, x.shape[:2], x))
        y = xp.zeros((batch, self.out_channels, cells), self.dtype)
        w = self.weight.data
        for index, window in self._windows():
            # (out, in) @ (batch, in, cells): the window is copied once, contiguous.
            y += xp.matmul(w[(slice(None), slice(None), *index)],
                           padded[window].reshape(batch, self.in_channels, cells))
        if self.bias is not None:
            y += self.bias.data[:, None]
        self.save_for_backward(padded)
        return y.reshape(batch, self.out_channels, *d.local_shape)

    def backward(self, dy: Any) -> Any:
        """Accumulate the kernel's and bias's gradients (summed over the spatial groups);
        return the input gradient (None with ``input_grad=False``)."""
        (padded,) = self.saved_tensors()
        d = self.halo.decomposition
        batch, cells = padded.shape[0], math.prod(d.local_shape)
        shape = (batch, self.out_channels, *d.local_shape)
        _checked(self, self.halo, dy, "output gradient", self.dtype, shape, whole_groups=True)
        with self._labels["backward"]:
            dx = self._backward(dy, padded, batch, cells)
        self._padded.give(padded)
        return dx

    def _backward(self, dy: Any, padded: Any, batch: int, cells: int) -> Any:
        d = self.halo.decomposition
        # One check first, which a misfit dy on another rank refuses (whatever follows:
        # the halo's adjoint or only the gradients' all-reduce); input_grad=False skips the
        # adjoint, so it is compared too.
        agree_all(d.split_groups(), ("HaloConv.backward", batch, self.out_channels,
                                     d.global_shape, self.dtype.str, self.input_grad),
                  f"HaloConv.backward(batch={batch}, out_channels={self.out_channels}, "
                  f"global_shape={d.global_shape}, dtype={self.dtype}, "
                  f"input_grad={self.input_grad})")
        xp = array_module(dy)
        dy3 = xp.ascontiguousarray(dy).reshape(batch, self.out_channels, cells)
        w = self.weight.data
        grads = []
        if self.weight.requires_grad:
            dw = xp.empty(w.shape, self.dtype)
            for index, window in self._windows():
                win = padded[window].reshape(batch, self.in_channels, cells)
                dw[(slice(None), slice(None), *index)] = xp.tensordot(dy3, win, ((0, 2), (0, 2)))
            grads.append((self.weight, dw))
        if self.bias is not None and self.bias.requires_grad:
            grads.append((self.bias, dy3.sum(axis=(0, 2))))
        self._reduce(grads, xp)
        if not self.input_grad:
            return None
        dpad = self._grad_padded.get(self.halo, padded.shape[:2], dy, zero=True)
        for index, window in self._windows():
            wt = w[(slice(None), slice(None), *index)].T
            dpad[window] += xp.matmul(wt, dy3).reshape(batch, self.in_channels, *d.local_shape)
        return xp.ascontiguousarray(self.halo.adjoint(dpad))

    def _reduce(self, grads: list, xp: Any) -> None:
        """Sum the gradients over every split axis's group (one buffer), then accumulate."""
        if not grads:
            return
        groups = self.halo.decomposition.split_groups()
        if groups:
            flat = xp.concatenate([g.reshape(-1) for _, g in grads])
            for group in groups:
                group.all_reduce(flat, out=flat)
            at = 0
            for i, (p, g) in enumerate(grads):
                grads[i] = (p, flat[at:at + g.size].reshape(g.shape))
                at += g.size
        for p, g in grads:
            p.accumulate_grad(g)
