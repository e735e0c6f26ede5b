"""3D tensor parallelism: ``Linear3D`` and ``LayerNorm3D`` on the cube's groups.

On a cube of ``d**3`` ranks with coordinates ``(i, j, k)`` a layer has an
*input group* ``a`` (``3d_input``, varying ``j``), a *weight group* ``w``
(``3d_weight``, varying ``i``) and an *output group* ``c`` (``3d_output``,
varying ``k``). Writing ``a, w, c`` also for this rank's position in each:

=============  ===============================  ======================
array          rows (axis 0)                    columns (last axis)
=============  ===============================  ======================
input ``x``    block ``w``, sub-block ``a``     block ``c``
weight ``W``   block ``a``, sub-block ``w``     block ``c``
output ``y``   block ``w``, sub-block ``c``     block ``a``
=============  ===============================  ======================

(``W`` is ``(out_features, in_features)``; blocks follow the balanced split, a
sub-block splits its block again.) The output layout is the input layout with
the input and output groups exchanged, so consecutive layers alternate
``swap=False`` / ``swap=True``: a property of each layer, not a global switch.
Every rank holds ``1/d**3`` of each weight and ``1/d**3`` of each activation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy

from ..backend import array_module
from ..collectives import balanced_sizes, block_slice
from ..group import Group
from ..initializer_3d import ParallelMode
from .core import Module, Parameter
from .init import BIAS_STREAM, InitMethod, get_init_method, init_weight_block, uniform

__all__ = ["Layout3D", "layout_3d", "Linear3D", "LayerNorm3D", "block_slice", "nested_slice"]


def nested_slice(n: int, parts: int, outer: int, inner: int) -> slice:
    """Sub-block ``inner`` of block ``outer``: both levels split ``parts`` ways."""
    block = block_slice(n, parts, outer)
    sub = block_slice(block.stop - block.start, parts, inner)
    return slice(block.start + sub.start, block.start + sub.stop)


@dataclass(frozen=True)
class Layout3D:
    """The three groups of one 3D layer and the array layouts they imply.

    Attributes
    ----------
    input, weight, output : Group
        The layer's input group ``a``, weight group ``w`` and output group ``c``.
    """

    input: Group
    weight: Group
    output: Group

    @property
    def depth(self) -> int:
        """Cube depth ``d``."""
        return self.weight.size

    def swapped(self) -> "Layout3D":
        """The layout of the next layer: input and output groups exchanged."""
        return Layout3D(self.output, self.weight, self.input)

    def input_block(self, rows: int, cols: int) -> tuple[slice, slice]:
        """This rank's ``(row, column)`` slices of a full ``(rows, cols)`` input."""
        d = self.depth
        return (nested_slice(rows, d, self.weight.rank, self.input.rank),
                block_slice(cols, d, self.output.rank))

    def output_block(self, rows: int, cols: int) -> tuple[slice, slice]:
        """This rank's slices of a full ``(rows, cols)`` output."""
        return self.swapped().input_block(rows, cols)

    def weight_block(self, out_features: int, in_features: int) -> tuple[slice, slice]:
        """This rank's slices of a full ``(out_features, in_features)`` weight."""
        d = self.depth
        return (nested_slice(out_features, d, self.input.rank, self.weight.rank),
                block_slice(in_features, d, self.output.rank))

    def split_input(self, x_full: Any) -> Any:
        """Return this rank's block of a full input ``(rows, ..., cols)`` (a copy)."""
        r, c = self.input_block(x_full.shape[0], x_full.shape[-1])
        return x_full[r, ..., c].copy()

    def gather_input(self, x_local: Any) -> Any:
        """All-gather an input-layout array into the full array on every rank."""
        rows = self.input.all_gather(x_local, axis=0)
        rows = self.weight.all_gather(rows, axis=0)
        return self.output.all_gather(rows, axis=-1)

    def split_output(self, y_full: Any) -> Any:
        """Return this rank's block of a full output (a copy)."""
        return self.swapped().split_input(y_full)

    def gather_output(self, y_local: Any) -> Any:
        """All-gather an output-layout array into the full array on every rank."""
        return self.swapped().gather_input(y_local)


def layout_3d(swap: bool = False, layer: str = "3D layer") -> Layout3D:
    """Return the :class:`Layout3D` of the current 3D parallel state.

    Parameters
    ----------
    swap : bool
        Exchange the input and output groups (every second layer).
    layer : str
        Name used in the error message.

    Raises
    ------
    RuntimeError
        When no parallel state exists or it is not in 3D mode.
    """
    from .. import manager

    try:
        groups = [manager.get_3d_group(m) for m in (ParallelMode.PARALLEL_3D_INPUT,
                                                    ParallelMode.PARALLEL_3D_WEIGHT,
                                                    ParallelMode.PARALLEL_3D_OUTPUT)]
    except RuntimeError as err:
        raise RuntimeError(f"{layer} needs a 3D parallel state: {err}") from None
    layout = Layout3D(*groups)
    return layout.swapped() if swap else layout


def _check_local(layer: Module, x: Any, cols: int, dtype: Any) -> None:
    if x.ndim < 2 or x.shape[-1] != cols or x.dtype != dtype:
        raise ValueError(f"{layer!r}: expected a local input block of shape (rows, ..., {cols}) "
                         f"and dtype {numpy.dtype(dtype).name}, got {tuple(x.shape)} {x.dtype}")


class Linear3D(Module):
    """``y = x @ W.T + b`` on a 3D cube: weight and activations split ``d**3`` ways.

    Forward: all-gather ``x`` over the input group (rows), all-gather ``W``
    over the weight group (rows), one local matmul, reduce-scatter ``y`` over
    the output group (rows), add the bias block. Backward applies the adjoint
    of each step.

    Parameters
    ----------
    in_features, out_features : int
        Full feature counts (balanced split, need not divide).
    bias : bool
        Whether to learn a bias; rank ``(a, w, c)`` holds sub-block ``w`` of
        block ``a``, replicated over the output group.
    swap : bool
        Exchange input and output groups: use ``True`` for a layer that takes
        the output of a ``swap=False`` layer, and vice versa.
    init_method : str or callable
        As :func:`~pympar.modules.initialize_affine_weight`; the same seed
        gives the same full weight as a serial :class:`~pympar.modules.Linear`.
    dtype : dtype
    seed : int
    layout : Layout3D, optional
        Groups to use; by default those of the current 3D parallel state.
    xp : module, optional
        ``numpy`` or ``cupy``.

    Attributes
    ----------
    weight : Parameter
        Local block of the ``(out_features, in_features)`` weight.
    bias : Parameter or None
    layout : Layout3D
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, swap: bool = False,
                 init_method: Union[str, InitMethod] = "kaiming_uniform",
                 dtype: Any = numpy.float32, seed: int = 0, layout: Layout3D | None = None,
                 xp: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.dtype = numpy.dtype(dtype)
        self.layout = layout if layout is not None else layout_3d(swap, "Linear3D")
        d = self.layout.depth
        if min(self.in_features, self.out_features) < d * d:
            raise ValueError(f"Linear3D: features ({self.in_features}, {self.out_features}) "
                             f"must be at least depth**2 = {d * d}")
        rows, cols = self.layout.weight_block(self.out_features, self.in_features)
        # Rows of the weight (and bias) block each weight-group rank holds: known, so the
        # gathers over the weight group skip their exchange of sizes.
        block_rows = block_slice(self.out_features, d, self.layout.input.rank)
        self._gathered_rows = balanced_sizes(block_rows.stop - block_rows.start, d)
        weight = init_weight_block((self.out_features, self.in_features), [rows], [cols],
                                   get_init_method(init_method), self.dtype, seed=seed, xp=xp)
        self.weight = Parameter(weight, group=self.layout.weight)
        if bias:
            bound = 1.0 / numpy.sqrt(self.in_features)
            # Same stream as pympar.modules.bias_init, so the full bias equals Linear's.
            b = init_weight_block((1, self.out_features), [slice(0, 1)], [rows],
                                  uniform(-bound, bound), self.dtype, seed=seed, xp=xp,
                                  stream=BIAS_STREAM)[0]
            self.bias = Parameter(b, group=self.layout.weight)
        else:
            self.bias = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"depth={self.layout.depth}, input={self.layout.input.name}, "
                f"output={self.layout.output.name}, dtype={self.dtype.name}")

    def load_full_weight(self, weight: Any, bias: Any = None) -> None:
        """Copy this rank's blocks of a full ``(out, in)`` weight (and bias) in place."""
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{self!r}: full weight must have shape {expected}, got {weight.shape}")
        rows, cols = self.layout.weight_block(*expected)
        self.weight.data[...] = weight[rows, cols]
        if bias is not None and self.bias is not None:
            self.bias.data[...] = bias[rows]

    def _gather_full(self, weight: Any, bias: Any) -> tuple[Any, Any]:
        layout = self.layout
        rows = layout.input.all_gather(layout.weight.all_gather(weight, axis=0), axis=0)
        full_bias = None
        if bias is not None:
            full_bias = layout.input.all_gather(layout.weight.all_gather(bias, axis=0), axis=0)
        return layout.output.all_gather(rows, axis=1), full_bias

    def full_weight(self) -> tuple[Any, Any]:
        """All-gather the full ``(out, in)`` weight and bias; collective over the cube."""
        return self._gather_full(self.weight.data, None if self.bias is None else self.bias.data)

    def full_weight_grad(self) -> tuple[Any, Any]:
        """All-gather the full weight and bias gradients; collective over the cube."""
        return self._gather_full(self.weight.grad, None if self.bias is None else self.bias.grad)

    def forward(self, x: Any) -> Any:
        """Return the output block for the input block ``x`` (input layout)."""
        layout = self.layout
        in_local = self.weight.data.shape[1]
        _check_local(self, x, in_local, self.dtype)
        xp = array_module(x)
        x_rows = layout.input.all_gather(x, axis=0)
        w_rows = layout.weight.all_gather(self.weight.data, axis=0, sizes=self._gathered_rows)
        x2d = x_rows.reshape(-1, in_local)
        partial = xp.matmul(x2d, w_rows.T).reshape(*x_rows.shape[:-1], w_rows.shape[0])
        y = layout.output.reduce_scatter(partial, axis=0)
        if self.bias is not None:
            y += layout.weight.all_gather(self.bias.data, axis=0, sizes=self._gathered_rows)
        self.save_for_backward(x2d, x_rows.shape, w_rows, y.shape)
        return y

    def backward(self, dy: Any) -> Any:
        """Return the input-gradient block; accumulate weight and bias gradients."""
        x2d, x_rows_shape, w_rows, y_shape = self.saved_tensors()
        if tuple(dy.shape) != tuple(y_shape) or dy.dtype != self.dtype:
            raise ValueError(f"{self!r}: expected output gradient of shape {tuple(y_shape)} and "
                             f"dtype {self.dtype.name}, got {tuple(dy.shape)} {dy.dtype}")
        layout = self.layout
        dy_rows = layout.output.all_gather(dy, axis=0).reshape(-1, w_rows.shape[0])
        dx_rows = (dy_rows @ w_rows).reshape(x_rows_shape)
        self.weight.accumulate_grad(layout.weight.reduce_scatter(dy_rows.T @ x2d, axis=0),
                                    consume=True)
        if self.bias is not None:
            # dy_rows already holds the output group's rows: its column sums are that sum.
            db = dy_rows.sum(axis=0)
            self.bias.accumulate_grad(layout.weight.reduce_scatter(db, axis=0), consume=True)
        return layout.input.reduce_scatter(dx_rows, axis=0)


class LayerNorm3D(Module):
    """Layer normalization over the hidden axis of a 3D input-layout activation.

    The hidden axis is split over the output group, so the row statistics are
    all-reduced over it; ``gamma`` and ``beta`` hold hidden block ``c`` and
    their gradients are summed over the ranks that share it (weight x input
    groups, the ranks holding other rows).

    Parameters
    ----------
    hidden : int
        Full hidden size.
    eps : float
    swap : bool
        Use the layout of a :class:`Linear3D` input with the same ``swap``.
    dtype : dtype
    layout : Layout3D, optional
    xp : module, optional

    Attributes
    ----------
    weight, bias : Parameter
        ``gamma`` and ``beta``, hidden block ``c``.
    """

    def __init__(self, hidden: int, eps: float = 1e-5, swap: bool = False,
                 dtype: Any = numpy.float32, layout: Layout3D | None = None, xp: Any = None) -> None:
        super().__init__()
        self.hidden, self.eps, self.dtype = int(hidden), float(eps), numpy.dtype(dtype)
        self.layout = layout if layout is not None else layout_3d(swap, "LayerNorm3D")
        cols = block_slice(self.hidden, self.layout.depth, self.layout.output.rank)
        xp = numpy if xp is None else xp
        width = cols.stop - cols.start
        self.weight = Parameter(xp.ones(width, dtype=self.dtype), group=self.layout.output)
        self.bias = Parameter(xp.zeros(width, dtype=self.dtype), group=self.layout.output)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, depth={self.layout.depth}, eps={self.eps}"

    def _row_sum(self, *arrays: Any) -> Any:
        """Sum each array over the full (distributed) hidden axis in one all-reduce."""
        xp = array_module(arrays[0])
        local = xp.stack([a.sum(axis=-1) for a in arrays])
        return self.layout.output.all_reduce(local)

    def _shared_grad(self, *arrays: Any) -> Any:
        """Sum row-reduced parameter gradients over the ranks holding other rows."""
        xp = array_module(arrays[0])
        local = xp.stack([a.reshape(-1, a.shape[-1]).sum(axis=0) for a in arrays])
        return self.layout.weight.all_reduce(self.layout.input.all_reduce(local))

    def forward(self, x: Any) -> Any:
        """Normalize each row of the input block ``x``."""
        _check_local(self, x, self.weight.data.shape[0], self.dtype)
        (mean,) = self._row_sum(x) / self.hidden
        centered = x - mean[..., None]
        (var,) = self._row_sum(centered * centered) / self.hidden
        rstd = 1.0 / array_module(x).sqrt(var + self.eps)
        xhat = centered
        xhat *= rstd[..., None]
        self.save_for_backward(xhat, rstd)
        return xhat * self.weight.data + self.bias.data

    def backward(self, dy: Any) -> Any:
        """Return the input-gradient block; accumulate ``gamma`` and ``beta`` gradients."""
        xhat, rstd = self.saved_tensors()
        if tuple(dy.shape) != tuple(xhat.shape):
            raise ValueError(f"{self!r}: expected output gradient of shape {xhat.shape}, "
                             f"got {tuple(dy.shape)}")
        dgamma, dbeta = self._shared_grad(dy * xhat, dy)
        self.weight.accumulate_grad(dgamma, consume=True)
        self.bias.accumulate_grad(dbeta, consume=True)
        g = dy * self.weight.data
        mean_g, mean_gx = self._row_sum(g, g * xhat) / self.hidden
        g -= mean_g[..., None]
        g -= xhat * mean_gx[..., None]
        g *= rstd[..., None]
        return g
