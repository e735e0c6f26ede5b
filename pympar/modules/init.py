"""Deterministic, shard-local weight initialization.

Every row ``i`` of a logical weight of shape ``(out_features, in_features)`` is drawn from its
own Philox stream (key = ``seed``, counter = ``[0, 0, i, stream]``), so any row can be
reproduced without generating the rows before it. A rank therefore builds its shard row by
row, holding at most its shard plus one float64 row, and the shards of every tensor-parallel
size reassemble bitwise into the ``tp_world_size=1`` weight. Values are generated in float64
and cast once, so every dtype holds the rounding of the same float64 numbers.

Init methods
------------
An init method is a callable ``fn(rng, out, fan_in, fan_out)``: ``rng`` is a
:class:`numpy.random.Generator` positioned at the start of one row, ``out`` a 1-D float64
NumPy array of that row's length. It fills ``out`` in place and returns ``None`` (or returns an
array of ``out``'s shape, which is copied in). It must consume ``rng`` deterministically.
The factories below build such callables; ``init_method`` arguments also accept their names
as strings, meaning the factory with default arguments.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable, Union

import numpy

from ..collectives import block_slice

__all__ = [
    "InitMethod",
    "xavier_uniform",
    "xavier_normal",
    "kaiming_uniform",
    "normal",
    "uniform",
    "zeros",
    "get_init_method",
    "partition_slices",
    "partition_indices",
    "init_weight_block",
    "initialize_affine_weight",
    "bias_init",
]

InitMethod = Callable[[numpy.random.Generator, numpy.ndarray, int, int], Any]
"""Signature of an init method: ``fn(rng, out, fan_in, fan_out) -> None``."""

# Counter word 3 separates independent uses of one seed.
WEIGHT_STREAM = 0
BIAS_STREAM = 1
DROPOUT_STREAM = 2


def xavier_uniform(gain: float = 1.0) -> InitMethod:
    """Glorot uniform: U(-b, b) with ``b = gain * sqrt(6 / (fan_in + fan_out))``."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_uniform(rng, out, gain * math.sqrt(6.0 / (fan_in + fan_out)))

    init.__qualname__ = f"xavier_uniform(gain={gain})"
    return init


def xavier_normal(gain: float = 1.0) -> InitMethod:
    """Glorot normal: N(0, s^2) with ``s = gain * sqrt(2 / (fan_in + fan_out))``."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_normal(rng, out, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))

    init.__qualname__ = f"xavier_normal(gain={gain})"
    return init


def kaiming_uniform(a: float = math.sqrt(5.0)) -> InitMethod:
    """He uniform for a leaky-ReLU gain, fan-in mode: U(-b, b), ``b = sqrt(6 / ((1 + a^2) fan_in))``.

    The default ``a = sqrt(5)`` is what ``torch.nn.Linear`` uses, giving ``b = 1 / sqrt(fan_in)``.
    (``torch.nn.init.kaiming_uniform_`` itself defaults to ``a = 0``; pass ``a=0`` for that.)
    """

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_uniform(rng, out, math.sqrt(6.0 / ((1.0 + a * a) * fan_in)))

    init.__qualname__ = f"kaiming_uniform(a={a})"
    return init


def normal(std: float = 0.02, mean: float = 0.0) -> InitMethod:
    """N(mean, std^2), independent of fan; the string ``"normal"`` means ``std=0.02``."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_normal(rng, out, mean, std)

    init.__qualname__ = f"normal(std={std}, mean={mean})"
    return init


def uniform(low: float = 0.0, high: float = 1.0) -> InitMethod:
    """U(low, high), independent of fan."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        rng.random(out=out)
        out *= high - low
        out += low

    init.__qualname__ = f"uniform(low={low}, high={high})"
    return init


def zeros() -> InitMethod:
    """All zeros (consumes no random numbers)."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        out.fill(0.0)

    init.__qualname__ = "zeros()"
    return init


def _fill_uniform(rng: numpy.random.Generator, out: numpy.ndarray, bound: float) -> None:
    rng.random(out=out)
    out *= 2.0 * bound
    out -= bound


def _fill_normal(rng: numpy.random.Generator, out: numpy.ndarray, mean: float, std: float) -> None:
    rng.standard_normal(out=out)
    out *= std
    if mean:
        out += mean


_NAMED: dict[str, Callable[[], InitMethod]] = {
    "xavier_uniform": xavier_uniform,
    "xavier_normal": xavier_normal,
    "kaiming_uniform": kaiming_uniform,
    "normal": normal,
    "uniform": uniform,
    "zeros": zeros,
}


def get_init_method(init_method: Union[str, InitMethod]) -> InitMethod:
    """Resolve a name (``"xavier_uniform"``, ``"xavier_normal"``, ``"kaiming_uniform"``,
    ``"normal"``, ``"uniform"``, ``"zeros"``) or an init-method callable.

    Raises
    ------
    ValueError
        For an unknown name or a non-callable.
    """
    if isinstance(init_method, str):
        if init_method not in _NAMED:
            raise ValueError(
                f"unknown init_method {init_method!r}; expected one of {sorted(_NAMED)} "
                "or a callable fn(rng, out, fan_in, fan_out)"
            )
        return _NAMED[init_method]()
    if callable(init_method):
        return init_method
    raise ValueError(f"init_method must be a name or a callable, got {init_method!r}")


def partition_slices(size: int, tp_world_size: int, rank: int, stride: int = 1) -> list[slice]:
    """Ranges of a partitioned axis owned by one rank, in the order they are stored locally.

    The axis of ``size`` items is split into ``stride`` parts by the balanced
    :func:`numpy.array_split` rule (the first ``size % stride`` parts get one more), then each
    part is split the same way over ``tp_world_size`` ranks; rank ``r`` holds its piece of every
    part, concatenated in part order. With ``stride=1`` the shards of ranks 0, 1, ... concatenate
    into the whole axis.

    Parameters
    ----------
    size : int
        Length of the logical (unsharded) axis.
    tp_world_size : int
        Number of ranks sharing the axis.
    rank : int
        This rank's position, ``0 <= rank < tp_world_size``.
    stride : int, default 1
        Number of fused parts (e.g. 3 for a fused QKV weight).

    Returns
    -------
    list of slice
        ``stride`` non-empty slices with step 1.

    Raises
    ------
    ValueError
        If ``tp_world_size < 1``, ``stride < 1``, ``rank`` is out of range, or
        ``size < stride * tp_world_size`` (some rank would own an empty piece).
    """
    _check_partition(size, tp_world_size, rank, stride)
    out = []
    for part in range(stride):
        whole = block_slice(size, stride, part)
        mine = block_slice(whole.stop - whole.start, tp_world_size, rank)
        out.append(slice(whole.start + mine.start, whole.start + mine.stop))
    return out


def partition_indices(size: int, tp_world_size: int, rank: int, stride: int = 1) -> numpy.ndarray:
    """Global indices owned by ``rank``, as an int64 array; see :func:`partition_slices`."""
    pieces = [numpy.arange(s.start, s.stop) for s in partition_slices(size, tp_world_size, rank, stride)]
    return numpy.concatenate(pieces).astype(numpy.int64, copy=False)


def _check_partition(size: int, tp_world_size: int, rank: int, stride: int) -> None:
    if tp_world_size < 1:
        raise ValueError(f"tp_world_size must be >= 1, got {tp_world_size}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if not 0 <= rank < tp_world_size:
        raise ValueError(f"rank {rank} out of range for tp_world_size {tp_world_size}")
    if size < stride * tp_world_size:
        raise ValueError(
            f"cannot partition an axis of {size} items into stride={stride} parts over "
            f"{tp_world_size} ranks: every rank needs at least one item of every part"
        )


def _rank_or_default(rank: int | None, tp_world_size: int) -> int:
    if rank is not None:
        return int(rank)
    if tp_world_size == 1:
        # The only possible rank; avoids requiring an initialized parallel state for serial use.
        return 0
    from pympar.manager import get_tensor_parallel_rank

    return int(get_tensor_parallel_rank())


def _row_generator(seed: int, stream: int) -> tuple[numpy.random.Generator, Callable[[int], None]]:
    """One Generator plus a function that rewinds it to the start of row ``i``.

    Re-seating the state of one Philox is several times cheaper than building a Generator
    per row.
    """
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed}")
    bitgen = numpy.random.Philox(key=seed)
    rng = numpy.random.Generator(bitgen)
    state = bitgen.state
    counter = state["state"]["counter"]

    def seek(row: int) -> None:
        counter[:] = (0, 0, row, stream)
        # Drop any buffered output of the previous row.
        state["buffer_pos"] = 4
        state["has_uint32"] = 0
        bitgen.state = state

    return rng, seek


def init_weight_block(
    init_shape: tuple[int, int],
    rows: list[slice],
    cols: list[slice],
    init_method: Union[str, InitMethod] = "xavier_uniform",
    dtype: Any = numpy.float32,
    *,
    seed: int = 0,
    xp: ModuleType | None = None,
    stream: int = WEIGHT_STREAM,
) -> Any:
    """Materialize the block ``W[rows][:, cols]`` of a logical weight without building ``W``.

    Rows are generated one at a time (full rows: a row's random stream cannot skip columns),
    so extra memory is one float64 row. Useful for layouts that shard both axes (3D).

    Parameters
    ----------
    init_shape : (int, int)
        Logical ``(out_features, in_features)``; fans come from it.
    rows, cols : list of slice
        Ranges (step 1) of rows and columns to keep, concatenated in the given order.
    init_method : str or InitMethod
        See the module docstring.
    dtype : dtype
        Result dtype; values are generated in float64 and cast once.
    seed : int
        Philox key, ``0 <= seed < 2**64``.
    xp : module, optional
        ``numpy`` (default) or ``cupy``; a CuPy result is generated on the host and copied once.
    stream : int
        Counter word separating independent uses of the same seed.

    Returns
    -------
    array of shape (sum of row-slice lengths, sum of column-slice lengths)
    """
    fn = get_init_method(init_method)
    n_out, n_in = (int(d) for d in init_shape)
    # torch convention for a 2-D weight: fan_in = in_features, fan_out = out_features.
    fan_in, fan_out = n_in, n_out
    rows = [slice(*s.indices(n_out)[:2]) for s in rows]
    cols = [slice(*s.indices(n_in)[:2]) for s in cols]
    n_rows = sum(s.stop - s.start for s in rows)
    col_dst = []
    offset = 0
    for s in cols:
        col_dst.append(slice(offset, offset + s.stop - s.start))
        offset += s.stop - s.start
    result = numpy.empty((n_rows, offset), dtype=dtype)
    rng, seek = _row_generator(seed, stream)
    row_buf = numpy.empty(n_in, dtype=numpy.float64)
    local = 0
    for s in rows:
        for i in range(s.start, s.stop):
            seek(i)
            ret = fn(rng, row_buf, fan_in, fan_out)
            if ret is not None:
                row_buf[...] = ret
            for src, dst in zip(cols, col_dst):
                result[local, dst] = row_buf[src]
            local += 1
    if xp is None or xp is numpy:
        return result
    return xp.asarray(result)


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

    The full weight is never allocated: rows are generated one at a time from per-row Philox
    streams. For every ``tp_world_size`` the shards, placed at the indices given by
    :func:`partition_slices`, equal the ``tp_world_size=1`` weight bitwise.

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
        Fused parts along ``partition_dim``; see :func:`partition_slices`.
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
    if tp_world_size < 1:
        raise ValueError(f"tp_world_size must be >= 1, got {tp_world_size}")
    rank = _rank_or_default(rank, tp_world_size)
    mine = partition_slices(int(init_shape[partition_dim]), tp_world_size, rank, stride)
    everything = [slice(0, int(init_shape[1 - partition_dim]))]
    rows, cols = (mine, everything) if partition_dim == 0 else (everything, mine)
    return init_weight_block(init_shape, rows, cols, init_method, dtype, seed=seed, xp=xp)


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
    the weight's (same ``seed``), sharded by :func:`partition_slices` like the weight's output
    axis. Pass ``tp_world_size=1`` for a replicated bias (e.g. row-parallel layers).

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
    if fan_in < 1:
        raise ValueError(f"fan_in must be >= 1, got {fan_in}")
    rank = _rank_or_default(rank, tp_world_size)
    mine = partition_slices(int(num_features), tp_world_size, rank, stride)
    bound = 1.0 / math.sqrt(fan_in)
    block = init_weight_block(
        (1, int(num_features)),
        [slice(0, 1)],
        mine,
        uniform(-bound, bound),
        dtype,
        seed=seed,
        xp=xp,
        stream=BIAS_STREAM,
    )
    return block[0]
