"""Column/Row parallel layers against a serial Linear built from the same full weights."""

import itertools
import time

import numpy as np
import pytest

from layer_helpers import DTYPES, XPS, block, get_xp, rng_array, tolerance
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere
from pympar import manager
from pympar.debug import CollectiveMismatchError
from pympar.modules import GELU, ColumnParallelLinear, Linear, RowParallelLinear

S, B, IN, OUT = 7, 2, 5, 7  # uneven for every TP size tested


def tp_sizes():
    return [tp for tp in (1, 2, 4) if WORLD.size % tp == 0]


def serial_reference(dtype, xp, seed=3):
    ref = Linear(IN, OUT, dtype=dtype, seed=seed, xp=xp)
    x = rng_array(10, (S, B, IN), dtype, xp)
    dy = rng_array(11, (S, B, OUT), dtype, xp)
    y = ref.forward(x)
    dx = ref.backward(dy)
    return x, dy, y, dx, ref.weight.grad, ref.bias.grad, ref


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_column_parallel(clean_state, xp_name, dtype):
    xp = get_xp(xp_name)
    x, dy, y_ref, dx_ref, dw_ref, db_ref, ref = serial_reference(dtype, xp)
    tol = tolerance(dtype)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        rows, cols = block(S, tp, r), block(OUT, tp, r)
        for gather, sp, skip in itertools.product([True, False], repeat=3):
            what = f"tp={tp} gather_output={gather} sp={sp} skip_bias_add={skip}"
            layer = ColumnParallelLinear(IN, OUT, gather_output=gather, use_sequence_parallel=sp,
                                         skip_bias_add=skip, dtype=dtype, seed=3, xp=xp)
            assert_equal(layer.weight.data, ref.weight.data[cols], f"{what} weight shard")
            out = layer.forward(x[rows] if sp else x)
            y, bias = out if skip else (out, None)
            if skip:
                y = y + bias
            full_rows = slice(None)
            expected = y_ref[full_rows] if gather else y_ref[..., cols]
            assert_close(y, expected, **tol, what=f"{what} forward")
            g = dy if gather else dy[..., cols]
            dbias = g.reshape(-1, g.shape[-1]).sum(axis=0) if skip else None
            dx = layer.backward(g, dbias) if skip else layer.backward(g)
            assert_close(dx, dx_ref[rows] if sp else dx_ref, **tol, what=f"{what} dx")
            assert_close(layer.weight.grad, dw_ref[cols], **tol, what=f"{what} dW")
            assert_close(layer.bias.grad, db_ref[cols], **tol, what=f"{what} db")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_parallel(clean_state, xp_name, dtype):
    xp = get_xp(xp_name)
    x, dy, y_ref, dx_ref, dw_ref, db_ref, ref = serial_reference(dtype, xp)
    tol = tolerance(dtype)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        rows, cols = block(S, tp, r), block(IN, tp, r)
        for parallel_in, sp, skip in itertools.product([True, False], repeat=3):
            what = f"tp={tp} input_is_parallel={parallel_in} sp={sp} skip_bias_add={skip}"
            layer = RowParallelLinear(IN, OUT, input_is_parallel=parallel_in,
                                      use_sequence_parallel=sp, skip_bias_add=skip,
                                      dtype=dtype, seed=3, xp=xp)
            assert_equal(layer.weight.data, ref.weight.data[:, cols], f"{what} weight shard")
            assert_equal(layer.bias.data, ref.bias.data, f"{what} bias")
            out = layer.forward(x[..., cols] if parallel_in else x)
            y = out[0] + out[1] if skip else out
            assert_close(y, y_ref[rows] if sp else y_ref, **tol, what=f"{what} forward")
            g = dy[rows] if sp else dy
            if skip:
                local_db = g.reshape(-1, OUT).sum(axis=0)
                dx = layer.backward(g, local_db)
            else:
                dx = layer.backward(g)
            assert_close(dx, dx_ref[..., cols] if parallel_in else dx_ref, **tol, what=f"{what} dx")
            assert_close(layer.weight.grad, dw_ref[:, cols], **tol, what=f"{what} dW")
            assert_close(layer.bias.grad, db_ref, **tol, what=f"{what} db")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence-parallel"])
def test_column_gelu_row_mlp(clean_state, sp):
    dtype, hidden, ffn = np.float64, 6, 10
    x = rng_array(20, (S, B, hidden), dtype)
    dy = rng_array(21, (S, B, hidden), dtype)
    fc1, act, fc2 = Linear(hidden, ffn, dtype=dtype, seed=1), GELU(), Linear(ffn, hidden, dtype=dtype, seed=2)
    y_ref = fc2.forward(act.forward(fc1.forward(x)))
    dx_ref = fc1.backward(act.backward(fc2.backward(dy)))
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        rows = block(S, tp, r) if sp else slice(None)
        col = ColumnParallelLinear(hidden, ffn, gather_output=False, use_sequence_parallel=sp,
                                   dtype=dtype, seed=1)
        gelu = GELU()
        row = RowParallelLinear(ffn, hidden, input_is_parallel=True, use_sequence_parallel=sp,
                                dtype=dtype, seed=2)
        y = row.forward(gelu.forward(col.forward(x[rows])))
        dx = col.backward(gelu.backward(row.backward(dy[rows])))
        what = f"tp={tp} sp={sp}"
        assert_close(y, y_ref[rows], what=f"{what} y")
        assert_close(dx, dx_ref[rows], what=f"{what} dx")
        f = block(ffn, tp, r)
        assert_close(col.weight.grad, fc1.weight.grad[f], what=f"{what} dW1")
        assert_close(col.bias.grad, fc1.bias.grad[f], what=f"{what} db1")
        assert_close(row.weight.grad, fc2.weight.grad[:, f], what=f"{what} dW2")
        assert_close(row.bias.grad, fc2.bias.grad, what=f"{what} db2")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_bad_input_names_the_layer(clean_state):
    raises_everywhere(RuntimeError, "ColumnParallelLinear needs a tensor-parallel group",
                      ColumnParallelLinear, 4, 4)
    raises_everywhere(RuntimeError, "RowParallelLinear needs a tensor-parallel group",
                      RowParallelLinear, 4, 4)
    manager.initialize_parallel(WORLD.size if WORLD.size <= 4 else 2)
    col = ColumnParallelLinear(4, 8, dtype=np.float64)
    raises_everywhere(ValueError, r"ColumnParallelLinear.*expected input of shape \(\.\.\., 4\)",
                      col.forward, np.zeros((3, 5)))
    raises_everywhere(ValueError, "dtype float64", col.forward, np.zeros((3, 4), np.float32))
    raises_everywhere(RuntimeError, "ColumnParallelLinear.backward called before forward",
                      col.backward, np.zeros((3, 8)))
    col.forward(np.zeros((3, 4)))
    raises_everywhere(ValueError, r"expected output gradient of shape \(3, 8\)",
                      col.backward, np.zeros((3, 7)))
    row = RowParallelLinear(8, 4, input_is_parallel=False, dtype=np.float64)
    raises_everywhere(ValueError, r"RowParallelLinear.*\(\.\.\., 8\)", row.forward, np.zeros((2, 4)))
    raises_everywhere(ValueError, "stride=3", ColumnParallelLinear, 4, 12, stride=3)
    # With sequence parallelism axis 0 is the sequence: a 1-D input has none.
    for layer in (ColumnParallelLinear(4, 8, use_sequence_parallel=True, dtype=np.float64),
                  RowParallelLinear(4, 6, use_sequence_parallel=True, dtype=np.float64)):
        raises_everywhere(ValueError, "expected input of shape", layer.forward, np.zeros(4))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_bias_gradient_of_another_shape_on_one_rank_raises_everywhere(clean_state, kind):
    """skip_bias_add: the dbias a backward takes is checked with dy, on every rank."""
    manager.initialize_parallel(WORLD.size if WORLD.size <= 4 else 2)
    layer = (ColumnParallelLinear(4, 6, skip_bias_add=True, dtype=np.float64) if kind == "column"
             else RowParallelLinear(4, 6, skip_bias_add=True, dtype=np.float64))
    y, bias = layer.forward(np.ones((3, 4)))
    tp = manager.get_tensor_parallel_world_size()
    last = manager.get_tensor_parallel_rank() == tp - 1  # one rank of every group
    dbias = np.ones(bias.size + last)
    raises_everywhere(Exception, "bias gradient", layer.backward, np.ones_like(y), dbias)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_layers_raise(clean_state):
    # A Column 8->h -> Row h->4 chain: the Row all-reduce has shape (rows, 4) whatever h is,
    # so only the layers' labels (their global sizes) tell rank 0's h=6 from the others' h=8.
    manager.initialize_parallel(WORLD.size)
    x = rng_array(20, (3, 8), np.float64)
    dy = rng_array(21, (3, 4), np.float64)
    for h in (6, 8):  # the correct case first: every rank builds the same chain
        col = ColumnParallelLinear(8, h, gather_output=False, dtype=np.float64, seed=1)
        row = RowParallelLinear(h, 4, input_is_parallel=True, dtype=np.float64, seed=2)
        fc1, fc2 = Linear(8, h, dtype=np.float64, seed=1), Linear(h, 4, dtype=np.float64, seed=2)
        assert_close(row.forward(col.forward(x)), fc2.forward(fc1.forward(x)), what=f"h={h} y")
        assert_close(col.backward(row.backward(dy)), fc1.backward(fc2.backward(dy)),
                     what=f"h={h} dx")
        f = block(h, WORLD.size, WORLD.rank)
        assert_close(col.weight.grad, fc1.weight.grad[f], what=f"h={h} dW1")
        assert_close(row.weight.grad, fc2.weight.grad[:, f], what=f"h={h} dW2")
        assert_close(row.bias.grad, fc2.bias.grad, what=f"h={h} db2")
    h = 6 if WORLD.rank == 0 else 8
    col = ColumnParallelLinear(8, h, gather_output=False, dtype=np.float64, seed=1)
    row = RowParallelLinear(h, 4, input_is_parallel=True, dtype=np.float64, seed=2)
    start = time.monotonic()
    raises_everywhere(CollectiveMismatchError, r"ColumnParallelLinear\(8->(6|8)",
                      lambda: row.forward(col.forward(x)))
    agree(time.monotonic() - start < 10, "the mismatch took more than 10 s to raise")
    # The same chain on every rank but the sequence-parallel flag on rank 0 only.
    row = RowParallelLinear(8, 4, use_sequence_parallel=WORLD.rank == 0, dtype=np.float64, seed=2)
    raises_everywhere(CollectiveMismatchError, r"sequence_parallel=(True|False)", row.forward, x)
