"""Per-row Philox streams: any block of a logical weight, bitwise the same on every layout.

Every row ``i`` of a logical weight of shape ``(out_features, in_features)`` is drawn from its
own Philox stream (key = ``seed``, counter = ``[0, 0, i, stream]``), so any row can be
reproduced without generating the rows before it. A rank therefore builds its block row by
row, holding at most its block plus one float64 row, and the blocks of every layout
reassemble bitwise into the serial weight. Values are generated in float64 and cast once, so
every dtype holds the rounding of the same float64 numbers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Sequence, Union

import numpy

from ..backend import check_dtype
from .init_methods import InitMethod, get_init_method

__all__ = ["WEIGHT_STREAM", "BIAS_STREAM", "DROPOUT_STREAM", "row_generator", "weight_block"]

#: Counter word 3 of the weight stream; separates independent uses of one seed.
WEIGHT_STREAM = 0
#: Counter word 3 of the bias stream.
BIAS_STREAM = 1
#: Counter word 3 of the dropout masks.
DROPOUT_STREAM = 2


def row_generator(seed: int, stream: int) -> tuple[numpy.random.Generator, Callable[[int], None]]:
    """One Generator plus a function that rewinds it to the start of row ``i``.

    Re-seating the state of one Philox is several times cheaper than building a Generator
    per row.

    Parameters
    ----------
    seed : int
        Philox key, ``0 <= seed < 2**64``.
    stream : int
        Counter word 3 (see :data:`WEIGHT_STREAM`, :data:`BIAS_STREAM`).

    Returns
    -------
    rng : numpy.random.Generator
    seek : callable
        ``seek(i)`` positions ``rng`` at the start of row ``i``.
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


def weight_block(init_shape: tuple[int, int], rows: Sequence[slice], cols: Sequence[slice],
                 init_method: Union[str, InitMethod], dtype: Any, seed: int,
                 xp: ModuleType | None, stream: int) -> Any:
    """The block ``W[rows][:, cols]`` of a logical weight, without building ``W``.

    The generator behind :func:`~pympar.modules.init_shard` (which documents the arguments;
    ``rows`` and ``cols`` are a :class:`~pympar.partition.Placement`'s ``axis_ranges``).
    Rows are generated one at a time (full rows: a row's random stream cannot skip
    columns), so extra memory is one float64 row. A CuPy result is generated on the host
    and copied once.
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
    rng, seek = row_generator(seed, stream)
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
    check_dtype(xp, result.dtype, "init_shard")
    return xp.asarray(result)
