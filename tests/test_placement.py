"""Every parameter's placement cuts the serial layer's full array into the parallel shard.

For each layer type and layout, ``p.placement.take(full)`` of the serial layer's arrays (same
seed) must equal the parallel layer's parameter bitwise, and the shards of all ranks sharing a
parameter must tile the full array (checked with NumPy's own split, not pympar's rule).
"""

import numpy as np
import pytest

from layer_helpers import owned
from mpi_helpers import WORLD, agree, assert_equal
from pympar import manager
from pympar.modules import (GELU, ColumnParallelLinear, LayerNorm, LayerNorm3D, Linear, Linear3D,
                            RowParallelLinear, Sequential)

IN, OUT = 5, 13  # uneven over 2 and 4 ranks; 13 >= stride 3 x 4 ranks


def tp_sizes():
    return [tp for tp in (1, 2, 4) if WORLD.size % tp == 0]


def check_take(layer, serial, what):
    for (name, p), (ref_name, ref) in zip(layer.named_parameters(), serial.named_parameters()):
        agree(name == ref_name, f"{what}: parameter {name} vs serial {ref_name}")
        assert_equal(p.placement.take(ref.data), p.data, f"{what} {name}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stride", [1, 3])
def test_column_and_row_placements(clean_state, stride):
    serial = Linear(IN, OUT, dtype=np.float64, seed=9)
    serial_row = Linear(OUT, IN, dtype=np.float64, seed=9)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        col = ColumnParallelLinear(IN, OUT, gather_output=False, dtype=np.float64, seed=9,
                                   stride=stride)
        check_take(col, serial, f"Column tp={tp} stride={stride}")
        # The rows kept are NumPy's split of each fused part, independent of pympar's rule.
        assert_equal(col.weight.data, serial.weight.data[owned(OUT, tp, r, stride)],
                     f"Column tp={tp} stride={stride} rows")
        row = RowParallelLinear(OUT, IN, input_is_parallel=True, dtype=np.float64, seed=9)
        check_take(row, serial_row, f"Row tp={tp}")
        assert_equal(row.weight.data, serial_row.weight.data[:, owned(OUT, tp, r)],
                     f"Row tp={tp} columns")
        agree(row.bias.placement.replicated and not (tp > 1 and col.weight.placement.replicated),
              "Row bias replicated, Column weight split")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_serial_placements_are_whole_arrays():
    for layer in (Linear(IN, OUT, seed=1), LayerNorm(OUT)):
        for name, p in layer.named_parameters():
            agree(p.placement.replicated and p.placement.shape == p.shape, f"{layer!r} {name}")
            assert_equal(p.placement.take(p.data), p.data, f"{layer!r} {name}")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("swap", [False, True])
def test_3d_placements(cube, swap):
    hidden = 9
    serial = Linear(IN * 2, hidden, dtype=np.float32, seed=4)
    layer = Linear3D(IN * 2, hidden, swap=swap, dtype=np.float32, seed=4)
    check_take(layer, serial, f"Linear3D swap={swap}")
    # The blocks of the 8 ranks tile the full weight: each element held exactly once.
    count = np.zeros((hidden, IN * 2), dtype=np.int64)
    layer.weight.placement.put(np.ones(layer.weight.shape, dtype=np.int64), count)
    total = np.zeros_like(count)
    WORLD.Allreduce(count, total)
    agree(bool((total == WORLD.size // 8).all()), f"weight blocks tile the full array: {total}")
    norm = LayerNorm3D(hidden, swap=swap, dtype=np.float64)
    ref = LayerNorm(hidden, dtype=np.float64)
    ref.weight.data[...] = np.random.default_rng(1).standard_normal(hidden)
    ref.bias.data[...] = np.random.default_rng(2).standard_normal(hidden)
    for p, full in ((norm.weight, ref.weight.data), (norm.bias, ref.bias.data)):
        p.data[...] = p.placement.take(full)
        cols = np.array_split(np.arange(hidden), 2)[norm.layout.output.rank]
        assert_equal(p.data, full[cols], f"LayerNorm3D swap={swap} {p.name}")


@pytest.mark.mpi(min_size=1)
def test_named_parameters_do_not_depend_on_the_layout(clean_state):
    serial = Sequential(Linear(IN, OUT), GELU(), Linear(OUT, IN))
    manager.initialize_parallel(tp_sizes()[-1])
    parallel = Sequential(ColumnParallelLinear(IN, OUT, gather_output=False), GELU(),
                          RowParallelLinear(OUT, IN, input_is_parallel=True))
    names = [n for n, _ in parallel.named_parameters()]
    agree(names == [n for n, _ in serial.named_parameters()] == list(parallel.state_dict())
          == ["0.weight", "0.bias", "2.weight", "2.bias"], f"names {names}")
    agree([n for n, _ in parallel.named_parameters("model")][0] == "model.0.weight", "prefix")
