"""Spectral convolutions (the layer of Fourier neural operators) on fields split over a group.

A field is ``(batch, x1, ..., xd, channels)``, channels last as every layer here, with ``x1``
split over ``group`` by the balanced rule. The layer keeps ``modes[k]`` Fourier modes per
axis (the lowest ``modes[-1]`` of the real transform along ``xd``; the lowest and highest
``modes[k]`` along the others, as FNO does), multiplies each kept mode by its own
``(in_channels, out_channels)`` complex matrix, and transforms back.

Where the modes are cut, and what crosses the network:

* ``d >= 2``: the ranks transform their whole axes ``x2..xd`` and keep the kept modes
  **before** the all-to-all that makes ``x1`` whole, so only kept modes cross the network
  (both ways, forward and backward); then ``x1`` is transformed and truncated.
* ``d == 1``: no axis is whole. Each rank applies the kept rows of the DFT matrix to its own
  points and a reduce-scatter sums them, leaving every rank a block of kept modes; an
  all-gather of the output modes and the kept columns of the inverse DFT give its points back.

The weights are **split by mode** over ``group``, along the mode axis that the exchange splits
(``x2``'s for ``d >= 2``, ``x1``'s for ``d == 1``): each rank multiplies exactly the modes it
holds, so a rank stores ``1/P`` of the weights, their gradients are complete without any
reduction over ``group`` (reduce them over the data-parallel group only, see
:func:`pympar.modules.fno.split_parameters`), and nothing else crosses the network.
Replicated weights would cost every rank the full weights (the largest tensors of an FNO) and an all-reduce of their
gradients over ``group``; split by channel, every rank would need every mode of its channels,
a second all-to-all each way (``benchmarks/bench_fft.py`` prices the three).

Weights are stored as two real parameters, ``weight_real`` and ``weight_imag``, so the
optimizers and checkpoints handle them as any other; their full shape is
``(K1, ..., Kd, in_channels, out_channels)`` with ``K = 2 * modes`` but ``Kd = modes[-1]``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Sequence

import numpy

from .. import collectives
from ..backend import array_module
from ..fft._local import ADJOINT_NORM, c2c, c2r, r2c, scale_conjugate_pairs
from ..group import Group
from ..partition import Placement, Split, balanced_sizes
from .core import Module, described_init
from .validation import check_array
from .parameter import Parameter

__all__ = ["SpectralConv", "SpectralConv1d", "SpectralConv2d", "SpectralConv3d"]

_NORM = "backward"  # NumPy's default: the forward transform unscaled, the inverse 1/N
_ADJOINT = ADJOINT_NORM[_NORM]


def _keep(x: Any, axis: int, n: int, m: int, half: bool) -> Any:
    """The kept modes along ``axis`` of a spectrum of ``n`` modes (``half``: the lowest ``m``;
    else the lowest and highest ``m``)."""
    lead = (slice(None),) * axis
    if half:
        return x[lead + (slice(0, m),)]
    xp = array_module(x)
    return xp.concatenate((x[lead + (slice(0, m),)], x[lead + (slice(n - m, n),)]), axis=axis)


def _pad(x: Any, axis: int, n: int, m: int, half: bool) -> Any:
    """The adjoint of :func:`_keep`: the kept modes back in a spectrum of ``n``, zeros
    elsewhere."""
    xp = array_module(x)
    shape = list(x.shape)
    shape[axis] = n
    out = xp.zeros(shape, x.dtype)
    lead = (slice(None),) * axis
    if half:
        out[lead + (slice(0, m),)] = x
    else:
        out[lead + (slice(0, m),)] = x[lead + (slice(0, m),)]
        out[lead + (slice(n - m, n),)] = x[lead + (slice(m, 2 * m),)]
    return out


def _contract(h: Any, w: Any, conj: bool) -> Any:
    """``z[b, k, o] = sum_i h[b, k, i] w[k, i, o]`` per mode ``k`` (``conj``: with ``w``'s
    conjugate transpose, ``w[k]^H``), ``h`` being ``(batch, modes, channels)``."""
    xp = array_module(h)
    wk = xp.conj(w).transpose(0, 2, 1) if conj else w
    return xp.matmul(h.transpose(1, 0, 2), wk).transpose(1, 0, 2)


class SpectralConv(Module):
    """Spectral convolution over ``len(modes)`` spatial axes, ``x1`` split over ``group``.

    Parameters
    ----------
    in_channels, out_channels : int
        Channels in and out (the last axis).
    modes : sequence of int
        Modes kept per spatial axis; ``2 * modes[k] <= n_k`` for all but the last axis,
        ``modes[-1] <= n_d // 2 + 1`` (checked in :meth:`forward`).
    group : Group, optional
        The spatial group that splits ``x1``; None: one rank holds the whole field.
    dtype : {numpy.float32, numpy.float64}
        Of the field and of the real and imaginary parts of the weights.
    seed : int
        Init seed: weights uniform in ``[0, 1/(in * out))`` (FNO's init), real and imaginary
        parts from per-row streams along the split mode axis, so every layout holds slices of
        the same full weights.
    xp : module, optional
        ``numpy`` (default) or ``cupy``.
    input_grad : bool, default True
        False: :meth:`backward` returns None.

    Attributes
    ----------
    weight_real, weight_imag : Parameter
        This rank's block of the weights (see the module docstring).
    """

    def __init__(self, in_channels: int, out_channels: int, modes: Sequence[int],
                 group: Group | None = None, dtype: Any = numpy.float32, seed: int = 0,
                 xp: ModuleType | None = None, input_grad: bool = True) -> None:
        super().__init__()
        self.modes = tuple(int(m) for m in modes)
        if not self.modes or min(self.modes) < 1:
            raise ValueError(f"{type(self).__name__}: modes must be >= 1 per axis, got {modes}")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.dtype = numpy.dtype(dtype)
        if self.dtype not in (numpy.float32, numpy.float64):
            raise ValueError(f"{type(self).__name__}: dtype must be float32 or float64, "
                             f"got {self.dtype}")
        self.complex = numpy.result_type(self.dtype, numpy.complex64)
        self.group = group if group is not None and group.size > 1 else None
        self.input_grad = bool(input_grad)
        d = len(self.modes)
        kept = tuple(2 * m for m in self.modes[:-1]) + (self.modes[-1],)
        self.split_axis = 0 if d == 1 else 1  # the weight's mode axis the exchange splits
        full = kept + (self.in_channels, self.out_channels)
        splits = (Split(self.split_axis, group.size, group.rank),) if self.group else ()
        placement = Placement(full, splits)
        xp = numpy if xp is None else xp
        real, imag = self._init(placement, seed)
        # In the label of every collective, which their checks compare: the exchanged shapes
        # do not show the modes kept along x1 (cut after the exchange) nor the init.
        self._settings = (f"{self.in_channels}->{self.out_channels}, modes={self.modes}, "
                          f"dtype={self.dtype.name}, {described_init(seed)}")
        self.weight_real = Parameter(xp.asarray(real), placement=placement)
        self.weight_imag = Parameter(xp.asarray(imag), placement=placement)

    def _init(self, placement: Placement, seed: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        ranges = placement.axis_ranges[self.split_axis]
        rows = [j for r in ranges for j in range(r.start, r.stop)]
        row_shape = tuple(n for k, n in enumerate(placement.shape) if k != self.split_axis)
        scale = 1.0 / (self.in_channels * self.out_channels)
        parts = [scale * numpy.random.default_rng([seed, j]).random((2, *row_shape))
                 for j in rows]
        both = (numpy.stack(parts, axis=1 + self.split_axis) if parts else
                numpy.empty((2, *placement.local_shape)))
        return both[0].astype(self.dtype), both[1].astype(self.dtype)

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr``."""
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"modes={self.modes}, group={self.group.name if self.group else None}, "
                f"dtype={self.dtype.name}")

    # ------------------------------------------------------------------ helpers
    def _weight(self) -> Any:
        """This rank's complex weights as ``(modes, in, out)``."""
        xp = array_module(self.weight_real.data)
        w = xp.empty(self.weight_real.shape, self.complex)
        w.real, w.imag = self.weight_real.data, self.weight_imag.data
        return w.reshape(-1, self.in_channels, self.out_channels)

    def _accumulate(self, h: Any, dz: Any) -> None:
        """``dW = conj(h)^T dz`` per mode, into the real and imaginary parts' gradients."""
        if not (self.weight_real.requires_grad or self.weight_imag.requires_grad):
            return
        xp = array_module(dz)
        dw = xp.matmul(xp.conj(h).transpose(1, 2, 0), dz.transpose(1, 0, 2))
        dw = dw.reshape(self.weight_real.shape)
        if self.weight_real.requires_grad:
            self.weight_real.accumulate_grad(xp.ascontiguousarray(dw.real), consume=True)
        if self.weight_imag.requires_grad:
            self.weight_imag.accumulate_grad(xp.ascontiguousarray(dw.imag), consume=True)

    def _check_modes(self, lengths: Sequence[int], first: int = 0) -> None:
        """Refuse more modes than the grid holds; ``lengths`` of spatial axes ``first``..."""
        d = len(self.modes)
        for k, n in enumerate(lengths, start=first):
            m, last = self.modes[k], k == d - 1
            most = n // 2 + 1 if last else n // 2
            if m > most:
                rule = "n // 2 + 1 of the real transform" if last else "n // 2, lowest and highest"
                raise ValueError(f"{self!r}: {m} modes along spatial axis {k + 1}, a grid of "
                                 f"{n} points, holds at most {most} ({rule})")

    def _label(self, direction: str, grid: str = "") -> str:
        """The label of the collectives of ``direction``: the settings, ``grid`` and, in a
        backward without the input gradient (one collective fewer), ``input_grad``."""
        flag = "" if direction == "forward" or self.input_grad else ", input_grad=False"
        return f"{type(self).__name__}.{direction}({self._settings}{grid}{flag})"

    def _refuse(self, err: Exception, direction: str = "forward") -> None:
        if self.group is not None:
            collectives.refuse(self.group, f"{type(self).__name__}.{direction}", err)

    # ------------------------------------------------------------------ forward / backward
    def forward(self, x: Any) -> Any:
        """The spectral convolution of ``x`` (``(batch, x1 block, x2, ..., xd, in_channels)``);
        returns ``(batch, x1 block, x2, ..., xd, out_channels)``."""
        d = len(self.modes)
        try:
            check_array(self, x, self.in_channels, self.dtype, min_ndim=d + 2)
            if x.ndim != d + 2:
                raise ValueError(f"{self!r}: expected a {d + 2}-d input (batch, {d} spatial "
                                 f"axes, channels), got shape {tuple(x.shape)}")
            self._check_modes(tuple(x.shape[2:-1]), first=1)  # the whole axes x2..xd
        except (TypeError, ValueError) as err:
            self._refuse(err)
            raise
        return self._forward_1d(x) if d == 1 else self._forward_nd(x)

    def backward(self, dy: Any) -> Any:
        """The input gradient (None with ``input_grad=False``); accumulates the weights'."""
        saved = self.saved_tensors()
        try:
            check_array(self, dy, None, self.dtype, what="output gradient",
                        shape=saved[-1][:-1] + (self.out_channels,))
        except (TypeError, ValueError) as err:  # the others are about to communicate
            self._refuse(err, "backward")
            raise
        return (self._backward_1d if len(self.modes) == 1 else self._backward_nd)(dy, *saved)

    # d >= 2: local transforms of x2..xd, one all-to-all each way
    def _exchange(self, y: Any, split: int, concat: int, name: str,
                  lengths: tuple[int, ...]) -> Any:
        if self.group is None:
            return y
        # The label carries the grid's whole axes, which the agreement check compares: the
        # kept modes of grids 2k and 2k + 1 points alike have the same shape.
        return collectives.all_to_all(self.group, y, split, concat, None, None,
                                      self._label(name, f", grid {lengths}"))

    def _forward_nd(self, x: Any) -> Any:
        d, axes = len(self.modes), tuple(range(2, len(self.modes) + 1))
        lengths = tuple(x.shape[2:-1])  # x2..xd, whole on every rank
        h = r2c(x, axes, _NORM)
        for axis in axes:  # only the kept modes cross the network
            h = _keep(h, axis, h.shape[axis], self.modes[axis - 1], axis == d)
        h = self._exchange(h, 2, 1, "forward", lengths)
        n1 = h.shape[1]
        self._check_modes((n1,))  # x1 is whole now, of one extent on every rank: all raise
        h = _keep(c2c(h, (1,), _NORM, False, overwrite=True), 1, n1, self.modes[0], False)
        batch, kept_shape = h.shape[0], h.shape[1:-1]
        modes = int(numpy.prod(kept_shape))  # explicit: a rank may hold no batch rows
        h = array_module(h).ascontiguousarray(h).reshape(batch, modes, self.in_channels)
        w = self._weight()
        z = _contract(h, w, conj=False).reshape((batch, *kept_shape, self.out_channels))
        g = self._padded_spectrum(z, n1, lengths, _NORM, "forward")
        y = c2r(g, axes, lengths, _NORM, overwrite=True)
        self.save_for_backward(h, w, n1, lengths, kept_shape, tuple(x.shape))
        return y

    def _padded_spectrum(self, z: Any, n1: int, lengths: tuple, norm: str,
                         direction: str) -> Any:
        """The kept modes ``z`` (x1 whole) as the whole half spectrum in the field's layout:
        x1 zero-padded and transformed back, exchanged, the other axes zero-padded."""
        d = len(self.modes)
        g = c2c(_pad(z, 1, n1, self.modes[0], False), (1,), norm, True, overwrite=True)
        g = self._exchange(g, 1, 2, direction, lengths)
        for axis in range(2, d + 1):
            last = axis == d
            n = lengths[axis - 2] // 2 + 1 if last else lengths[axis - 2]
            g = _pad(g, axis, n, self.modes[axis - 1], last)
        return g

    def _backward_nd(self, dy: Any, h: Any, w: Any, n1: int, lengths: tuple, kept_shape: tuple,
                     x_shape: tuple) -> Any:
        d, axes = len(self.modes), tuple(range(2, len(self.modes) + 1))
        # adjoint of the inverse local transform (c2r, then the pads)
        g = r2c(dy, axes, _ADJOINT)
        scale_conjugate_pairs(g, d, lengths[-1], 2.0)
        for axis in axes:
            g = _keep(g, axis, g.shape[axis], self.modes[axis - 1], axis == d)
        g = self._exchange(g, 2, 1, "backward", lengths)
        dz = _keep(c2c(g, (1,), _ADJOINT, False, overwrite=True), 1, n1, self.modes[0], False)
        batch = dz.shape[0]
        modes = int(numpy.prod(kept_shape))
        dz = array_module(dz).ascontiguousarray(dz).reshape(batch, modes, self.out_channels)
        self._accumulate(h, dz)
        if not self.input_grad:
            return None
        dh = _contract(dz, w, conj=True).reshape((batch, *kept_shape, self.in_channels))
        dh = self._padded_spectrum(dh, n1, lengths, _ADJOINT, "backward")
        scale_conjugate_pairs(dh, d, lengths[-1], 0.5)
        return c2r(dh, axes, lengths, _ADJOINT, overwrite=True)

    # d == 1: partial DFTs of the local points, a reduce-scatter and an all-gather of modes
    def _dft(self, x: Any) -> tuple[Any, Any, int]:
        """The kept rows of the DFT of this rank's points, ``(points, modes)``, and of the
        inverse real DFT (conjugate pairs counted twice, ``1/n``), and the global length."""
        xp = array_module(x)
        local = x.shape[1]
        if self.group is None:
            n, start = local, 0
        else:
            extents = collectives.all_gather(self.group, numpy.array([local], numpy.int64),
                                             0, None, None, self._label("forward"))
            n, start = int(extents.sum()), int(extents[:self.group.rank].sum())
        self._check_modes((n,))
        m = self.modes[0]
        points = numpy.arange(start, start + local)[:, None]
        phase = (-2j * numpy.pi / n) * (points * numpy.arange(m)[None, :])
        forward = numpy.exp(phase).astype(self.complex)
        weights = numpy.ones(m)
        weights[1:(n + 1) // 2] = 2.0
        inverse = (numpy.conj(forward) * (weights / n)).astype(self.complex)
        return xp.asarray(forward), xp.asarray(inverse), n

    def _forward_1d(self, x: Any) -> Any:
        xp = array_module(x)
        forward, inverse, n = self._dft(x)
        name = self._label("forward")
        z = xp.matmul(forward.T, x)  # (batch, m, in): this rank's share of every kept mode
        if self.group is not None:
            z = collectives.reduce_scatter(self.group, z, 1, None, "sum", name)
        w = self._weight()
        h = xp.ascontiguousarray(z)
        z = _contract(h, w, conj=False)
        if self.group is not None:
            z = collectives.all_gather(self.group, xp.ascontiguousarray(z), 1, None,
                                       balanced_sizes(self.modes[0], self.group.size), name)
        y = xp.matmul(inverse, z).real.astype(self.dtype)
        self.save_for_backward(h, w, forward, inverse, tuple(x.shape))
        return xp.ascontiguousarray(y)

    def _backward_1d(self, dy: Any, h: Any, w: Any, forward: Any, inverse: Any,
                     x_shape: tuple) -> Any:
        xp = array_module(dy)
        name = self._label("backward")
        dz = xp.matmul(xp.conj(inverse).T, dy)  # (batch, m, out)
        if self.group is not None:
            dz = collectives.reduce_scatter(self.group, dz, 1, None, "sum", name)
        dz = xp.ascontiguousarray(dz)
        self._accumulate(h, dz)
        if not self.input_grad:
            return None
        dh = _contract(dz, w, conj=True)
        if self.group is not None:
            dh = collectives.all_gather(self.group, xp.ascontiguousarray(dh), 1, None,
                                        balanced_sizes(self.modes[0], self.group.size), name)
        return xp.ascontiguousarray(xp.matmul(xp.conj(forward), dh).real.astype(self.dtype))


def _modes(d: int, modes: int | Sequence[int]) -> tuple[int, ...]:
    modes = (modes,) * d if isinstance(modes, (int, numpy.integer)) else tuple(modes)
    if len(modes) != d:
        raise ValueError(f"SpectralConv{d}d: expected {d} modes, got {modes}")
    return modes


class _SpectralConvNd(SpectralConv):
    """A :class:`SpectralConv` of fields of :attr:`dims` dimensions (one class per count)."""

    dims = 0

    def __init__(self, in_channels: int, out_channels: int, modes: int | Sequence[int],
                 group: Group | None = None, dtype: Any = numpy.float32, seed: int = 0,
                 xp: ModuleType | None = None, input_grad: bool = True) -> None:
        super().__init__(in_channels, out_channels, _modes(self.dims, modes), group, dtype, seed,
                         xp, input_grad)


class SpectralConv1d(_SpectralConvNd):
    """Spectral convolution of 1-D fields ``(batch, x1, channels)``; ``modes`` an int.

    See :class:`SpectralConv` for the parameters.
    """

    dims = 1


class SpectralConv2d(_SpectralConvNd):
    """Spectral convolution of 2-D fields ``(batch, x1, x2, channels)``; ``modes`` an int or
    two ints.

    See :class:`SpectralConv` for the parameters.
    """

    dims = 2


class SpectralConv3d(_SpectralConvNd):
    """Spectral convolution of 3-D fields ``(batch, x1, x2, x3, channels)``; ``modes`` an int
    or three ints.

    See :class:`SpectralConv` for the parameters.
    """

    dims = 3
