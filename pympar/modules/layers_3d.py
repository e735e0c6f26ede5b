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

The layout is checked: the 3D layers tag the blocks they return with their layout (see
:mod:`pympar.modules.layout_tags`; element-wise layers keep the tag), and a layer given a
block tagged with another layout raises ``ValueError`` naming ``swap=``, on every rank,
instead of computing a wrong answer.

Forward and backward start with one agreement over the cube
(:meth:`~pympar.modules.Module.agreement`) on the layer's label (global sizes, bias and
dtype; ``eps`` for the norm), its groups' axes (``swap``), its init (seed and method) and its
input block's dtype and unsplit extents, so ranks that
built different layers, or that pass a block only some refuse, raise
:class:`~pympar.errors.CollectiveMismatchError` on every rank. Statistics record the
collectives under the label (``"Linear3D(8->16, bias=True, dtype=float64).forward:all_gather"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy

from .. import manager
from ..backend import array_module
from ..group import Group
from ..initializer_3d import ParallelMode
from ..partition import Placement, Split
from .core import Module, _copy_into, described_init
from .validation import check_array
from .parameter import Parameter
from .init_methods import InitMethod
from .layout_tags import tag, tag_of
from .normalization import layer_norm_backward, layer_norm_forward, local_row_sums
from .sharded_init import init_bias, init_shard

__all__ = ["Layout3D", "layout_3d", "Linear3D", "LayerNorm3D"]


@dataclass(frozen=True)
class Layout3D:
    """The three groups of one 3D layer and the array layouts they imply.

    Attributes
    ----------
    input, weight, output : Group
        The layer's input group ``a``, weight group ``w`` and output group ``c``.
    cube : Group or None
        Every rank of the cube: the 3D layers agree over it before they communicate (the
        current tensor-parallel group by default). Without it they agree over the
        input group only, and a block refused on one rank reaches only that group.
    """

    input: Group
    weight: Group
    output: Group
    cube: Union[Group, None] = None

    @property
    def depth(self) -> int:
        """Cube depth ``d``."""
        return self.weight.size

    @property
    def key(self) -> tuple[str, str, str]:
        """The names of the three groups: equal keys mean the same activation layout."""
        return (self.input.name, self.weight.name, self.output.name)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axis keys of the three groups (their names without the members' ranks), alike
        on every rank of the cube: the layers agree on them, so ranks built with another
        ``swap`` raise."""
        return tuple(g.name.removesuffix("-" + "-".join(map(str, g.ranks)))
                     for g in (self.input, self.weight, self.output))

    def swapped(self) -> "Layout3D":
        """The layout of the next layer: input and output groups exchanged."""
        return Layout3D(self.output, self.weight, self.input, self.cube)

    @property
    def agreeing(self) -> Group:
        """The group the 3D layers agree over: the cube, else the input group."""
        return self.input if self.cube is None else self.cube

    def input_placement(self, shape: tuple[int, ...]) -> Placement:
        """Where this rank's block of a full input ``(rows, ..., cols)`` sits.

        Rows: block ``w``, sub-block ``a``; columns: block ``c``.
        """
        return Placement(tuple(shape), (Split.over(self.weight, 0), Split.over(self.input, 0),
                                        Split.over(self.output, len(shape) - 1)))

    def weight_placement(self, out_features: int, in_features: int) -> Placement:
        """Where this rank's block of a full ``(out_features, in_features)`` weight sits.

        Rows: block ``a``, sub-block ``w``; columns: block ``c``.
        """
        return Placement((out_features, in_features), (Split.over(self.input, 0),
                                                        Split.over(self.weight, 0),
                                                        Split.over(self.output, 1)))

    def split_input(self, x_full: Any) -> Any:
        """Return this rank's block of a full input ``(rows, ..., cols)`` (a copy, tagged)."""
        return tag(self.input_placement(x_full.shape).take(x_full), self.key)

    def gather_input(self, x_local: Any) -> Any:
        """All-gather an input-layout array into the full array on every rank."""
        self.check(x_local, "gather_input")
        rows = self.input.all_gather(x_local, axis=0)
        rows = self.weight.all_gather(rows, axis=0)
        return self.output.all_gather(rows, axis=-1)

    def split_output(self, y_full: Any) -> Any:
        """Return this rank's block of a full output (a copy, tagged)."""
        return self.swapped().split_input(y_full)

    def gather_output(self, y_local: Any) -> Any:
        """All-gather an output-layout array into the full array on every rank."""
        return self.swapped().gather_input(y_local)

    def check(self, block: Any, who: str, what: str = "input") -> None:
        """Raise ``ValueError`` when ``block`` is tagged with another layout than this one."""
        key = tag_of(block)
        if key is not None and key != self.key:
            raise ValueError(
                f"{who}: its {what} block is in the layout of the other 3D layer kind (input "
                f"and output groups exchanged): a 3D layer taking the output of a swap=False "
                f"layer needs swap=True, and vice versa")


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
    try:
        groups = [manager.get_3d_group(m) for m in (ParallelMode.PARALLEL_3D_INPUT,
                                                    ParallelMode.PARALLEL_3D_WEIGHT,
                                                    ParallelMode.PARALLEL_3D_OUTPUT)]
    except RuntimeError as err:
        raise RuntimeError(f"{layer} needs a 3D parallel state: {err}") from None
    layout = Layout3D(*groups, manager.resolve_group(None, layer))
    return layout.swapped() if swap else layout


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
        the output of a ``swap=False`` layer, and vice versa. A block in the
        other layout raises ``ValueError`` (see the module docstring).
    init_method : str or callable
        As :func:`~pympar.modules.initialize_affine_weight`; the same seed
        gives the same full weight as a serial :class:`~pympar.modules.Linear`.
    dtype : dtype
        Parameter and input dtype.
    seed : int
        Init seed.
    layout : Layout3D, optional
        Groups to use; by default those of the current 3D parallel state.
    xp : module, optional
        ``numpy`` or ``cupy``.
    input_grad : bool, default True
        False: ``backward`` computes no input gradient (nor its reduce-scatter) and returns
        None.

    Attributes
    ----------
    weight : Parameter
        Local block of the ``(out_features, in_features)`` weight; its ``placement`` is
        :meth:`Layout3D.weight_placement`.
    bias : Parameter or None
        Local block of the ``(out_features,)`` bias (the weight's row block).
    layout : Layout3D
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, swap: bool = False,
                 init_method: Union[str, InitMethod] = "kaiming_uniform",
                 dtype: Any = numpy.float32, seed: int = 0, layout: Layout3D | None = None,
                 xp: Any = None, input_grad: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.dtype = numpy.dtype(dtype)
        self.input_grad = bool(input_grad)
        self.layout = layout if layout is not None else layout_3d(swap, "Linear3D")
        d = self.layout.depth
        if min(self.in_features, self.out_features) < d * d:
            raise ValueError(f"Linear3D: features ({self.in_features}, {self.out_features}) "
                             f"must be at least depth**2 = {d * d}")
        placement = self.layout.weight_placement(self.out_features, self.in_features)
        self.weight = Parameter(init_shard(placement, init_method, self.dtype, seed=seed, xp=xp),
                                placement=placement)
        # Rows of the weight (and bias) block each weight-group rank holds: known, so the
        # gathers over the weight group skip their exchange of sizes.
        block = Placement((self.out_features,), placement.splits[:1])
        self._gathered_rows = tuple(block.then(Split(0, d, w)).local_shape[0] for w in range(d))
        self.bias = None
        if bias:
            placement = Placement((self.out_features,), placement.splits[:2])
            # Same stream and bound as Linear's bias, so the full bias equals Linear's.
            self.bias = Parameter(init_bias("uniform", placement, self.in_features, self.dtype,
                                            seed=seed, xp=xp, layer="Linear3D"),
                                  placement=placement)
        self.label_calls(f"Linear3D({self.in_features}->{self.out_features}, bias={bias}, "
                         f"dtype={self.dtype.name})",
                         (f"groups {self.layout.axes}",
                          described_init(seed, init_method, "uniform" if bias else None)))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"depth={self.layout.depth}, input={self.layout.input.name}, "
                f"output={self.layout.output.name}, dtype={self.dtype.name}")

    def load_full_weight(self, weight: Any, bias: Any = None) -> None:
        """Copy this rank's blocks of a full ``(out, in)`` weight (and bias) in place."""
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{self!r}: full weight must have shape {expected}, got {weight.shape}")
        _copy_into(self.weight.data, self.weight.placement.take(weight))
        if bias is not None and self.bias is not None:
            _copy_into(self.bias.data, self.bias.placement.take(bias))

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
        """Return the output block (output layout) for the input block ``x`` (input layout)."""
        layout = self.layout
        with self.agreement("forward", x, layout.agreeing, (0, -1),
                            validate=(self._check, layout, x, "input")):
            return self._forward(x)

    def _check(self, layout: Layout3D, block: Any, what: str, shape: tuple | None = None) -> None:
        """The layout first (a block in the wrong layout may also have the wrong shape),
        then the array."""
        layout.check(block, repr(self), what)
        if shape is None:
            check_array(self, block, self.weight.data.shape[1], self.dtype,
                        what="local input block", min_ndim=2)
        else:
            check_array(self, block, None, self.dtype, what=f"{what} block", shape=shape)

    def _forward(self, x: Any) -> Any:
        layout, in_local = self.layout, self.weight.data.shape[1]
        xp = array_module(x)
        x_rows = layout.input.all_gather(x, axis=0)
        w_rows = layout.weight.all_gather(self.weight.data, axis=0, sizes=self._gathered_rows)
        x2d = x_rows.reshape(-1, in_local)
        partial = xp.matmul(x2d, w_rows.T).reshape(*x_rows.shape[:-1], w_rows.shape[0])
        y = layout.output.reduce_scatter(partial, axis=0)
        if self.bias is not None:
            y += layout.weight.all_gather(self.bias.data, axis=0, sizes=self._gathered_rows)
        # Keep only what the requested gradients need.
        self.save_for_backward(x2d if self.weight.requires_grad else None, x_rows.shape,
                               w_rows if self.input_grad else None, y.shape)
        return tag(y, layout.swapped().key)

    def backward(self, dy: Any) -> Any:
        """Return the input-gradient block (None with ``input_grad=False``); accumulate the
        gradients of unfrozen weight and bias."""
        layout = self.layout
        saved = self.saved_tensors()
        with self.agreement("backward", dy, layout.agreeing, (0, -1),
                            validate=(self._check, layout.swapped(), dy, "output gradient",
                                      saved[3])):
            return self._backward(dy, *saved)

    def _backward(self, dy: Any, x2d: Any, x_rows_shape: tuple, w_rows: Any,
                  y_shape: tuple) -> Any:
        layout = self.layout
        bias_grad = self.bias is not None and self.bias.requires_grad
        if not (self.input_grad or self.weight.requires_grad or bias_grad):
            return None
        if (self.input_grad and w_rows is None) or (self.weight.requires_grad and x2d is None):
            raise RuntimeError(f"{self!r}: input_grad or requires_grad changed between forward "
                               "and backward")
        rows_out = sum(self._gathered_rows)
        dy_rows = layout.output.all_gather(dy, axis=0).reshape(-1, rows_out)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(layout.weight.reduce_scatter(dy_rows.T @ x2d, axis=0),
                                        consume=True)
        if bias_grad:
            # dy_rows already holds the output group's rows: its column sums are that sum.
            db = dy_rows.sum(axis=0)
            self.bias.accumulate_grad(layout.weight.reduce_scatter(db, axis=0), consume=True)
        if not self.input_grad:
            return None
        dx_rows = (dy_rows @ w_rows).reshape(x_rows_shape)
        return tag(layout.input.reduce_scatter(dx_rows, axis=0), layout.key)


class LayerNorm3D(Module):
    """Layer normalization over the hidden axis of a 3D input-layout activation.

    The math is :class:`~pympar.modules.LayerNorm`'s (the shared
    :func:`~pympar.modules.normalization.layer_norm_forward` and ``layer_norm_backward``);
    the hidden axis is split over the output group, so the row sums are all-reduced over
    it. ``gamma`` and ``beta`` hold hidden block ``c`` and their gradients are summed over
    the ranks that share it (weight x input groups, the ranks holding other rows).

    Parameters
    ----------
    hidden : int
        Full hidden size.
    eps : float
        Added to the biased variance.
    swap : bool
        Use the layout of a :class:`Linear3D` input with the same ``swap``.
    dtype : dtype
        Parameter and input dtype.
    layout : Layout3D, optional
        Groups to use; by default those of the current 3D parallel state.
    xp : module, optional
        ``numpy`` or ``cupy``.
    input_grad : bool, default True
        False: ``backward`` computes no input gradient (nor its all-reduce) and returns None.

    Attributes
    ----------
    weight, bias : Parameter
        ``gamma`` and ``beta``, hidden block ``c`` (placement split over the output group).
    """

    def __init__(self, hidden: int, eps: float = 1e-5, swap: bool = False,
                 dtype: Any = numpy.float32, layout: Layout3D | None = None, xp: Any = None,
                 input_grad: bool = True) -> None:
        super().__init__()
        self.hidden, self.eps, self.dtype = int(hidden), float(eps), numpy.dtype(dtype)
        self.input_grad = bool(input_grad)
        self.layout = layout if layout is not None else layout_3d(swap, "LayerNorm3D")
        placement = Placement((self.hidden,), (Split.over(self.layout.output, 0),))
        xp = numpy if xp is None else xp
        width = placement.local_shape[0]
        self.weight = Parameter(xp.ones(width, dtype=self.dtype), placement=placement)
        self.bias = Parameter(xp.zeros(width, dtype=self.dtype), placement=placement)
        self.label_calls(f"LayerNorm3D({self.hidden}, eps={self.eps!r}, dtype={self.dtype.name})",
                         (f"groups {self.layout.axes}",))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, depth={self.layout.depth}, eps={self.eps}"

    def _check(self, block: Any, what: str, shape: tuple | None = None) -> None:
        """The layout first, then the array (see :meth:`Linear3D._check`)."""
        self.layout.check(block, repr(self), what)
        if shape is None:
            check_array(self, block, self.weight.data.shape[0], self.dtype,
                        what="local input block", min_ndim=2)
        else:
            check_array(self, block, None, self.dtype, what=f"{what} block", shape=shape)

    def _row_sums(self, *terms: Any) -> list[Any]:
        """Row sums over the full (distributed) hidden axis, all terms in one all-reduce."""
        local = local_row_sums(*terms)
        return list(self.layout.output.all_reduce(array_module(local[0]).stack(local)))

    def forward(self, x: Any) -> Any:
        """Normalize each row of the input block ``x`` (same layout out)."""
        with self.agreement("forward", x, self.layout.agreeing, (0, -1),
                            validate=(self._check, x, "input")):
            y, xhat, rstd = layer_norm_forward(x, self.weight.data, self.bias.data, self.eps,
                                               self.hidden, self._row_sums)
            self.save_for_backward(xhat, rstd)
            return tag(y, self.layout.key)

    def backward(self, dy: Any) -> Any:
        """Return the input-gradient block (None with ``input_grad=False``); accumulate the
        gradients of unfrozen ``gamma`` and ``beta``."""
        xhat, rstd = self.saved_tensors()
        with self.agreement("backward", dy, self.layout.agreeing, (0, -1),
                            validate=(self._check, dy, "output gradient", xhat.shape)):
            return self._backward(dy, xhat, rstd)

    def _backward(self, dy: Any, xhat: Any, rstd: Any) -> Any:
        trained = [p for p in (self.weight, self.bias) if p.requires_grad]
        dx, dgamma, dbeta = layer_norm_backward(dy, xhat, rstd, self.weight.data, self.hidden,
                                                self._row_sums, param_grads=bool(trained),
                                                input_grad=self.input_grad)
        if trained:
            xp = array_module(dy)
            shared = xp.stack([dgamma, dbeta])
            shared = self.layout.weight.all_reduce(self.layout.input.all_reduce(shared))
            for p, g in zip((self.weight, self.bias), shared):
                if p.requires_grad:
                    p.accumulate_grad(g)
        return None if dx is None else tag(dx, self.layout.key)
