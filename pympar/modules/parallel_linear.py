"""Megatron-style tensor-parallel affine layers with hand-written backward.

``ColumnParallelLinear`` splits the output features over the tensor-parallel
group, ``RowParallelLinear`` the input features; a Column followed by a Row
needs one all-reduce in forward and one in backward (or, with sequence
parallelism, an all-gather and a reduce-scatter of the sequence axis instead).
Both are built from :mod:`pympar.mappings`, whose backward methods are the exact
adjoints of their forwards, so each layer's backward is the textbook chain rule.

Each layer starts its forward and backward with one agreement
(:meth:`~pympar.modules.Module.agreement`) on its label (class, global sizes, flags, dtype)
and on its input's dtype and unsplit extents, so ranks that built different layers, or
that pass an input only some refuse, raise
:class:`~pympar.errors.CollectiveMismatchError` on every rank (e.g. a Column 8->6 -> Row
6->4 chain on one rank and 8->8->4 on another). Statistics keep each mapping's own label.
"""

from __future__ import annotations

import math
from typing import Any, Union

import numpy

from .. import mappings
from ..backend import array_module
from ..group import Group
from ..manager import resolve_group
from ..partition import Placement, Split
from .core import Module, described_init
from .validation import check_array
from .parameter import Parameter
from .init_methods import InitMethod
from .sharded_init import init_bias, init_shard

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _matmul_into(xp: Any, a2d: Any, b: Any, rows: int, cols: int, dtype: Any) -> Any:
    out = xp.empty((rows, cols), dtype=dtype)
    xp.matmul(a2d, b, out=out)
    return out


def _rows(a: Any) -> Any:
    """``a`` as 2-D ``(rows, last axis)``; unlike ``reshape(-1, n)``, also where a rank's
    share of the features is empty (more ranks than features: ``n == 0``)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


class _TensorParallelLinear(Module):
    """Shared parts: group, shapes, input checks and the local affine math."""

    def _setup(self, in_features: int, out_features: int, group: Group | None,
               dtype: Any, skip_bias_add: bool, use_sequence_parallel: bool,
               input_grad: bool) -> None:
        """Store the common settings (the label comes later: :meth:`_name_calls`)."""
        self.input_grad = bool(input_grad)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.dtype = numpy.dtype(dtype)
        self.group = resolve_group(group, type(self).__name__)
        self.skip_bias_add = bool(skip_bias_add)
        self.use_sequence_parallel = bool(use_sequence_parallel)

    def _name_calls(self, flags: str, init: str) -> None:
        """Label forward and backward with what every rank must share: class, sizes, flags;
        and agree on the init (``init``: :func:`~pympar.modules.core.described_init`), so
        that ranks holding blocks of different full weights raise."""
        self.label_calls(f"{type(self).__name__}({self.in_features}->{self.out_features}, "
                         f"{flags}, bias={self.bias is not None}, "
                         f"skip_bias_add={self.skip_bias_add}, "
                         f"sequence_parallel={self.use_sequence_parallel}, "
                         f"dtype={self.dtype.name})", (init,))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group.name}, dtype={self.dtype.name}")

    def _check_gradients(self, dy: Any, shape: tuple, dbias: Any, bias_shape: tuple) -> None:
        """The backward's arguments: ``dy`` of ``shape``, and any ``dbias`` (with
        ``skip_bias_add``) of ``bias_shape``, both of the layer's dtype."""
        check_array(self, dy, None, self.dtype, "output gradient", shape)
        if dbias is not None:
            check_array(self, dbias, None, self.dtype, "bias gradient", bias_shape)

    def _local_affine(self, x: Any) -> tuple[Any, Any]:
        """Return ``x @ W_local.T`` (no bias) and ``x`` as 2-D for the backward cache."""
        # Written out: this is the hot path of every forward.
        xp = numpy if type(x) is numpy.ndarray else array_module(x)
        x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        w = self.weight.data
        y2d = xp.empty((x2d.shape[0], w.shape[0]), dtype=w.dtype)
        xp.matmul(x2d, w.T, out=y2d)
        return y2d.reshape(*x.shape[:-1], w.shape[0]), x2d

    def _local_affine_backward(self, dy: Any, x2d: Any, x_shape: tuple) -> Any:
        """Accumulate ``dW`` (unless frozen) from the local output gradient and return
        ``dy @ W_local`` (None with ``input_grad=False``)."""
        xp = array_module(dy)
        w = self.weight.data
        dy2d = _rows(dy)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(
                _matmul_into(xp, dy2d.T, x2d, w.shape[0], w.shape[1], w.dtype), consume=True)
        if not self.input_grad:
            return None
        return _matmul_into(xp, dy2d, w, dy2d.shape[0], w.shape[1], w.dtype).reshape(
            *x_shape[:-1], w.shape[1])

    def _init_parameters(self, weight_split: Split, bias_split: Split | None, bias: bool,
                         init_method: Union[str, InitMethod], bias_init: str, seed: int,
                         xp: Any) -> None:
        """Create ``weight`` (and ``bias``) as this rank's blocks of the serial layer's."""
        placement = Placement((self.out_features, self.in_features), (weight_split,))
        self.weight = Parameter(init_shard(placement, init_method, self.dtype, seed=seed, xp=xp),
                                placement=placement)
        self.bias = None
        if bias:
            placement = Placement((self.out_features,), () if bias_split is None else (bias_split,))
            self.bias = Parameter(init_bias(bias_init, placement, self.in_features, self.dtype,
                                            seed=seed, xp=xp, layer=type(self).__name__),
                                  placement=placement)


class ColumnParallelLinear(_TensorParallelLinear):
    """``y = x @ W.T + b`` with the output features split over the TP group.

    Rank ``r`` holds row block ``r`` of the full ``(out_features, in_features)``
    weight (balanced split, :func:`~pympar.partition.strided_slices`)
    and the matching bias entries.

    Parameters
    ----------
    in_features, out_features : int
        Full (unsplit) feature counts; ``out_features`` need not divide.
    bias : bool
        Whether to learn a bias.
    gather_output : bool
        True: all-gather the output so every rank holds ``(..., out_features)``.
        False: return this rank's ``(..., out_local)`` block (feed it to a
        :class:`RowParallelLinear` with ``input_is_parallel=True``).
    use_sequence_parallel : bool
        The input is split along the sequence (axis 0) over the group; it is
        all-gathered in forward and the input gradient reduce-scattered.
    skip_bias_add : bool
        Do not add the bias; ``forward`` returns ``(y, bias)`` with the bias
        in the layout of ``y`` (so the caller can fuse it), and ``backward``
        takes the bias gradient as ``dbias``.
    init_method : str or callable
        Weight init, see :func:`~pympar.modules.initialize_affine_weight`;
        the default has the distribution of ``torch.nn.Linear``.
    bias_init : {"uniform", "zeros"}
        ``"uniform"`` is torch ``nn.Linear``'s ``U(-1/sqrt(in), 1/sqrt(in))``.
    dtype : dtype
        Parameter and input dtype.
    group : Group, optional
        Tensor-parallel group; the current one by default.
    seed : int
        Init seed: the shards of all TP sizes come from the same full weight.
    stride : int
        Fused parts of the output axis (e.g. 3 for a fused QKV weight); each
        rank holds its block of every part. Needs ``gather_output=False``.
    xp : module, optional
        ``numpy`` (default) or ``cupy``: where the parameters live.
    input_grad : bool, default True
        False: ``backward`` computes no input gradient, issues no all-reduce (or, with
        sequence parallelism, no reduce-scatter) for it, and returns None.

    Attributes
    ----------
    weight : Parameter
        ``(out_local, in_features)``; its ``placement`` splits axis 0 over ``group``
        (with ``stride``).
    bias : Parameter or None
        ``(out_local,)``, split like the weight's rows.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = True, use_sequence_parallel: bool = False,
                 skip_bias_add: bool = False, init_method: Union[str, InitMethod] = "kaiming_uniform",
                 bias_init: str = "uniform", dtype: Any = numpy.float32,
                 group: Group | None = None, seed: int = 0, stride: int = 1,
                 xp: Any = None, input_grad: bool = True) -> None:
        super().__init__()
        self._setup(in_features, out_features, group, dtype, skip_bias_add, use_sequence_parallel,
                    input_grad)
        if stride > 1 and gather_output:
            raise ValueError(f"ColumnParallelLinear: stride={stride} keeps fused parts per rank; "
                             "gathering them would interleave the parts, use gather_output=False")
        self.gather_output = bool(gather_output)
        self.stride = int(stride)
        split = Split.over(self.group, 0, self.stride)
        self._init_parameters(split, split, bias, init_method, bias_init, seed, xp)
        self._name_calls(f"gather_output={self.gather_output}, stride={self.stride}",
                         described_init(seed, init_method, bias_init if bias else None))

    def forward(self, x: Any) -> Any:
        """Return the (gathered or local) output; ``(y, bias)`` with ``skip_bias_add``."""
        sp = self.use_sequence_parallel
        with self.agreement("forward", x, self.group, (0,) if sp else (), 0 if sp else None,
                            validate=(check_array, self, x, self.in_features, self.dtype,
                                      "input", None, 2 if sp else 1)) as rows:
            if sp:
                total = mappings.gather_from_sequence(x, self.group, global_size=sum(rows))
            else:
                total = mappings.copy_to_all(x, self.group)
            y, x2d = self._local_affine(total)
            if self.bias is not None and not self.skip_bias_add:
                y += self.bias.data
            self.save_for_backward(x2d, total.shape)
            if self.gather_output:
                y = mappings.gather_from_hidden(y, self.group, global_size=self.out_features)
            if not self.skip_bias_add:
                return y
            bias = self.bias.data if self.bias is not None else None
            if bias is not None and self.gather_output:
                bias = mappings.gather_from_hidden(bias, self.group,
                                                   global_size=self.out_features)
            return y, bias

    def backward(self, dy: Any, dbias: Any = None) -> Any:
        """Return the input gradient (None with ``input_grad=False``); accumulate the
        gradients of the weight and bias unless they are frozen.

        Parameters
        ----------
        dy : array
            Gradient of the output, in the layout ``forward`` returned.
        dbias : array, optional
            With ``skip_bias_add``: the gradient of the returned bias.
        """
        x2d, total_shape = self.saved_tensors()
        width = self.out_features if self.gather_output else self.weight.data.shape[0]
        with self.agreement("backward", dy, self.group, () if self.gather_output else (-1,),
                            validate=(self._check_gradients, dy, (*total_shape[:-1], width),
                                      dbias, (width,))):
            return self._backward(dy, dbias, x2d, total_shape)

    def _backward(self, dy: Any, dbias: Any, x2d: Any, total_shape: tuple) -> Any:
        if self.gather_output:
            dy = mappings.gather_from_hidden.backward(dy, self.group)
            if dbias is not None:
                dbias = mappings.gather_from_hidden.backward(dbias, group=self.group)
        if self.bias is not None and self.bias.requires_grad:
            if not self.skip_bias_add:
                dbias = _rows(dy).sum(axis=0)
            if dbias is not None:
                self.bias.accumulate_grad(dbias)
        dtotal = self._local_affine_backward(dy, x2d, total_shape)
        if dtotal is None:
            return None
        if self.use_sequence_parallel:
            return mappings.gather_from_sequence.backward(dtotal, group=self.group)
        # dtotal is a fresh array of this layer: sum it in place (MPI_IN_PLACE skips a copy
        # and a new output array; 8 MiB on 2 ranks: 1.5 instead of 2.4 ms).
        return mappings.copy_to_all.backward(dtotal, group=self.group, out=dtotal)


class RowParallelLinear(_TensorParallelLinear):
    """``y = x @ W.T + b`` with the input features split over the TP group.

    Rank ``r`` holds columns ``r`` of the full ``(out_features, in_features)``
    weight (balanced split). Each rank's partial product is summed over the
    group (all-reduce, or reduce-scatter along the sequence with sequence
    parallelism) and the full, replicated bias is added after the sum.

    Parameters
    ----------
    in_features, out_features : int
        Full feature counts; ``in_features`` need not divide.
    bias : bool
        Whether to learn a (replicated) bias.
    input_is_parallel : bool
        True: the input is already this rank's ``(..., in_local)`` block (e.g.
        a :class:`ColumnParallelLinear` with ``gather_output=False``). False:
        the input is replicated and this rank keeps its block.
    use_sequence_parallel : bool
        Reduce-scatter the output along the sequence (axis 0) instead of
        all-reducing it; the bias gradient is then summed over the group.
    skip_bias_add : bool
        Return ``(y, bias)`` without adding the bias; ``backward`` then takes
        ``dbias``.
    init_method, bias_init, dtype, group, seed, xp
        As in :class:`ColumnParallelLinear`.
    input_grad : bool, default True
        False: ``backward`` computes no input gradient, issues no all-gather for it, and
        returns None.

    Attributes
    ----------
    weight : Parameter
        ``(out_features, in_local)``; its ``placement`` splits axis 1 over ``group``.
    bias : Parameter or None
        ``(out_features,)``, replicated on every rank of the group (placement replicated).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, use_sequence_parallel: bool = False,
                 skip_bias_add: bool = False, init_method: Union[str, InitMethod] = "kaiming_uniform",
                 bias_init: str = "uniform", dtype: Any = numpy.float32,
                 group: Group | None = None, seed: int = 0, xp: Any = None,
                 input_grad: bool = True) -> None:
        super().__init__()
        self._setup(in_features, out_features, group, dtype, skip_bias_add, use_sequence_parallel,
                    input_grad)
        self.input_is_parallel = bool(input_is_parallel)
        self._init_parameters(Split.over(self.group, 1), None, bias, init_method, bias_init,
                              seed, xp)
        self._name_calls(f"input_is_parallel={self.input_is_parallel}",
                         described_init(seed, init_method, bias_init if bias else None))

    def forward(self, x: Any) -> Any:
        """Return the reduced output; ``(y, bias)`` with ``skip_bias_add``."""
        width = self.weight.data.shape[1] if self.input_is_parallel else self.in_features
        with self.agreement("forward", x, self.group, (-1,) if self.input_is_parallel else (),
                            validate=(check_array, self, x, width, self.dtype, "input", None,
                                      2 if self.use_sequence_parallel else 1)):
            return self._forward(x)

    def _forward(self, x: Any) -> Any:
        if not self.input_is_parallel:
            x = mappings.scatter_to_hidden(x, group=self.group)
        partial, x2d = self._local_affine(x)
        if self.use_sequence_parallel:
            y = mappings.reduce_scatter_to_sequence(partial, group=self.group)
        else:
            # partial is a fresh array of this layer: reduce it in place.
            y = mappings.reduce_from_all(partial, group=self.group, out=partial)
        self.save_for_backward(x2d, x.shape, y.shape)
        if self.skip_bias_add:
            return y, (self.bias.data if self.bias is not None else None)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy: Any, dbias: Any = None) -> Any:
        """Return the input gradient in the input's layout (None with ``input_grad=False``);
        accumulate the gradients of the weight and bias unless they are frozen; ``dy`` and
        ``dbias`` as in :meth:`ColumnParallelLinear.backward`."""
        x2d, x_shape, y_shape = self.saved_tensors()
        with self.agreement("backward", dy, self.group,
                            (0,) if self.use_sequence_parallel else (),
                            validate=(self._check_gradients, dy, y_shape, dbias,
                                      (self.out_features,))):
            return self._backward(dy, dbias, x2d, x_shape)

    def _backward(self, dy: Any, dbias: Any, x2d: Any, x_shape: tuple) -> Any:
        if self.bias is not None and self.bias.requires_grad:
            if not self.skip_bias_add:
                dbias = _rows(dy).sum(axis=0)
            if self.use_sequence_parallel:
                # Each rank saw only its sequence block; the bias is shared by all rows.
                # Every rank joins the sum, a rank without a bias gradient with zeros.
                if dbias is None:
                    dbias = array_module(dy).zeros_like(self.bias.data)
                dbias = self.group.all_reduce(dbias)
            if dbias is not None:
                self.bias.accumulate_grad(dbias)
        if not (self.input_grad or self.weight.requires_grad):
            # Neither remaining gradient needs the gathered output gradient.
            return None
        if self.use_sequence_parallel:
            dpartial = mappings.reduce_scatter_to_sequence.backward(dy, group=self.group,
                                                                    global_size=x_shape[0])
        else:
            dpartial = mappings.reduce_from_all.backward(dy, group=self.group)
        dx = self._local_affine_backward(dpartial, x2d, x_shape)
        if dx is None or self.input_is_parallel:
            return dx
        return mappings.scatter_to_hidden.backward(dx, group=self.group, global_size=self.in_features)
