"""Shard-local init of affine weights and biases, from a parameter's placement.

A layer says where its shard sits in the full (serial) parameter with a
:class:`~pympar.partition.Placement`; :func:`init_shard` generates exactly that block of the
full parameter from the per-row Philox streams of :mod:`pympar.modules.philox`. So the shards
of every layout (tensor-parallel sizes, fused strides, 3D blocks) equal the serial layer's
parameters cut by the same placement, bitwise, and the full parameter is never allocated.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Union

import numpy

from .. import manager
from ..backend import check_dtype
from ..partition import Placement, Split
from .init_methods import InitMethod, uniform
from .philox import BIAS_STREAM, WEIGHT_STREAM, weight_block

__all__ = ["init_shard", "init_bias", "initialize_affine_weight", "bias_init"]


def init_shard(
    placement: Placement,
    init_method: Union[str, InitMethod] = "xavier_uniform",
    dtype: Any = numpy.float32,
    *,
    seed: int = 0,
    xp: ModuleType | None = None,
    stream: int = WEIGHT_STREAM,
) -> Any:
    """This rank's block, given by ``placement``, of a deterministically initialized parameter.

    Parameters
    ----------
    placement : Placement
        A 2-D ``(out_features, in_features)`` weight (fans from its full shape), or a 1-D
        vector, drawn as the single row of a ``(1, n)`` weight.
    init_method : str or InitMethod
        See :mod:`pympar.modules.init_methods`.
    dtype : dtype
        Result dtype (float64 values are cast once).
    seed : int
        Philox key; the same seed gives the same full parameter on every layout.
    xp : module, optional
        ``numpy`` (default) or ``cupy``.
    stream : int
        Philox stream (:data:`~pympar.modules.philox.WEIGHT_STREAM` or ``BIAS_STREAM``).

    Returns
    -------
    array of shape ``placement.local_shape``
    """
    ranges = placement.axis_ranges
    if len(placement.shape) == 2:
        return weight_block(placement.shape, ranges[0], ranges[1], init_method, dtype, seed, xp,
                            stream)
    if len(placement.shape) == 1:
        return weight_block((1, placement.shape[0]), [slice(0, 1)], ranges[0], init_method,
                            dtype, seed, xp, stream)[0]
    raise ValueError(f"init_shard: only 1-D and 2-D parameters, got shape {placement.shape}")


def init_bias(
    kind: str,
    placement: Placement,
    fan_in: int,
    dtype: Any = numpy.float32,
    *,
    seed: int = 0,
    xp: ModuleType | None = None,
    layer: str = "layer",
) -> Any:
    """This rank's block of a bias: torch ``nn.Linear``'s ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``
    (``kind="uniform"``, a stream independent of the weight's) or zeros.

    Raises
    ------
    ValueError
        Naming ``layer`` for another ``kind`` or ``fan_in < 1``.
    """
    if kind == "zeros":
        xp = numpy if xp is None else xp
        check_dtype(xp, numpy.dtype(dtype), layer)
        return xp.zeros(placement.local_shape, dtype=dtype)
    if kind != "uniform":
        raise ValueError(f"{layer}: bias_init must be 'uniform' (torch nn.Linear) or 'zeros', "
                         f"not {kind!r}")
    if fan_in < 1:
        raise ValueError(f"{layer}: fan_in must be >= 1, got {fan_in}")
    bound = 1.0 / math.sqrt(fan_in)
    return init_shard(placement, uniform(-bound, bound), dtype, seed=seed, xp=xp,
                      stream=BIAS_STREAM)


def _split(size: int, tp_world_size: int, rank: int | None, stride: int, axis: int) -> Split:
    """The tensor-parallel split of one axis; every rank needs an item of every fused part."""
    if tp_world_size < 1:
        raise ValueError(f"tp_world_size must be >= 1, got {tp_world_size}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if rank is None:
        # tp_world_size=1 has one possible rank: serial use needs no parallel state.
        rank = 0 if tp_world_size == 1 else manager.get_tensor_parallel_rank()
    if not 0 <= rank < tp_world_size:
        raise ValueError(f"rank {rank} out of range for tp_world_size {tp_world_size}")
    if size < stride * tp_world_size:
        raise ValueError(f"cannot partition an axis of {size} items into stride={stride} parts "
                         f"over {tp_world_size} ranks: every rank needs at least one item of "
                         "every part")
    return Split(axis, tp_world_size, int(rank), stride)


def initialize_affine_weight(
    init_shape: tuple[int, int],
    tp_world_size: int,
    partition_dim: int,
    init_method: Union[str, InitMethod] = "xavier_uniform",
    dtype: Any = numpy.float32,
    *,
    rank: int | None = None,
    seed: int = 0,
    stride: int = 1,
    xp: ModuleType | None = None,
) -> Any:
    """Return this rank's shard of a deterministically initialized affine weight.

    The shard is the block ``Placement(init_shape, (Split(partition_dim, tp_world_size, rank,
    stride),))`` of the ``tp_world_size=1`` weight, bitwise; see :func:`init_shard`.

    Parameters
    ----------
    init_shape : (int, int)
        Logical ``(out_features, in_features)`` (torch layout); fan_in/fan_out come from it.
    tp_world_size : int
        Number of ranks sharing the weight.
    partition_dim : {0, 1}
        0 splits output features (column-parallel), 1 splits input features (row-parallel).
    init_method : str or InitMethod, default "xavier_uniform"
        A name (``"xavier_uniform"``, ``"xavier_normal"``, ``"kaiming_uniform"``, ``"normal"``
        (std 0.02), ``"uniform"``, ``"zeros"``) or a callable ``fn(rng, out, fan_in, fan_out)``
        such as ``normal(0.006)``.
    dtype : dtype, default numpy.float32
        Result dtype (float64 values are cast once).
    rank : int, optional
        This rank's position in the tensor-parallel group. ``None`` asks
        ``pympar.manager.get_tensor_parallel_rank()`` (which raises if pympar is not
        initialized), except that ``tp_world_size=1`` always means rank 0.
    seed : int, default 0
        Philox key; the same seed gives the same logical weight on every rank.
    stride : int, default 1
        Fused parts along ``partition_dim``; see :func:`pympar.partition.strided_slices`.
    xp : module, optional
        ``numpy`` (default) or ``cupy`` for the result's array module.

    Returns
    -------
    array
        The shard: ``(len_local, in_features)`` for ``partition_dim=0``, ``(out_features,
        len_local)`` for ``partition_dim=1``.

    Raises
    ------
    ValueError
        For a non-2-D ``init_shape``, ``partition_dim`` not in (0, 1), ``tp_world_size < 1``,
        ``rank`` out of range, ``stride < 1``, or a partition axis shorter than
        ``stride * tp_world_size``.
    """
    if len(init_shape) != 2 or min(init_shape) < 1:
        raise ValueError(f"init_shape must be (out_features, in_features) >= 1, got {init_shape}")
    if partition_dim not in (0, 1):
        raise ValueError(f"partition_dim must be 0 or 1, got {partition_dim}")
    split = _split(int(init_shape[partition_dim]), tp_world_size, rank, stride, partition_dim)
    return init_shard(Placement(tuple(init_shape), (split,)), init_method, dtype, seed=seed, xp=xp)


def bias_init(
    num_features: int,
    fan_in: int,
    tp_world_size: int = 1,
    dtype: Any = numpy.float32,
    *,
    rank: int | None = None,
    seed: int = 0,
    stride: int = 1,
    xp: ModuleType | None = None,
) -> Any:
    """Return this rank's shard of a ``torch.nn.Linear``-style bias, U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    The logical bias is one row of ``num_features`` values drawn from a stream independent of
    the weight's (same ``seed``), split like the weight's output axis. Pass
    ``tp_world_size=1`` for a replicated bias (e.g. row-parallel layers).

    Parameters
    ----------
    num_features : int
        Logical bias length (``out_features``).
    fan_in : int
        Logical ``in_features`` of the layer, fixing the bound.
    tp_world_size, rank, stride, xp, dtype, seed
        As in :func:`initialize_affine_weight`.

    Returns
    -------
    1-D array
    """
    split = _split(int(num_features), tp_world_size, rank, stride, 0)
    return init_bias("uniform", Placement((int(num_features),), (split,)), fan_in, dtype,
                     seed=seed, xp=xp, layer="bias_init")
