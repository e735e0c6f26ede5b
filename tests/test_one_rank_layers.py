"""A layer input that one rank alone refuses raises on every rank (no rank waits for ever)."""

import time

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, assert_close, raises_everywhere
from pympar import debug, manager
from pympar.debug import CollectiveMismatchError
from pympar.modules import (ColumnParallelLinear, ContextAttention, LayerNorm, LayerNorm3D, Linear,
                            Linear3D, ParallelAttention, RowParallelLinear)
from test_attention import serial_reference


@pytest.fixture
def tp_world(clean_state):
    """Tensor parallelism over the world, under a timeout: a rank left waiting raises
    instead of hanging the run."""
    manager.initialize_parallel(WORLD.size)
    debug.set_timeout(8)
    yield
    debug.set_timeout(None)


def _everywhere_within(pattern, func, *args):
    start = time.monotonic()
    if WORLD.size == 1:  # nobody else: the refusal itself is what comes back
        with pytest.raises((TypeError, ValueError), match="expected|must"):
            func(*args)
    else:
        raises_everywhere(CollectiveMismatchError, pattern, func, *args)
    agree(time.monotonic() - start < 10, "the refusal took more than 10 s to reach every rank")


def _data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((3, 2, 8)), rng.standard_normal((3, 2, 4))


@pytest.mark.mpi(min_size=1)
def test_row_forward_refused_on_one_rank(tp_world):
    x, dy = _data()
    ref = Linear(8, 4, dtype=np.float64, seed=2)
    row = RowParallelLinear(8, 4, dtype=np.float64, seed=2)
    assert_close(row.forward(x), ref.forward(x), what="y")  # the correct case first
    assert_close(row.backward(dy), ref.backward(dy), what="dx")
    bad = x.astype(np.float32) if WORLD.rank == 0 else x
    _everywhere_within(r"RowParallelLinear\.forward, refused by this rank|disagree", row.forward,
                       bad)
    assert_close(row.forward(x), ref.forward(x), what="y after the refusal")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sp", [False, True])
def test_column_refused_on_one_rank(tp_world, sp):
    x, _ = _data()
    dy = np.random.default_rng(6).standard_normal((3, 2, 6))
    ref = Linear(8, 6, dtype=np.float64, seed=1)
    rows = np.array_split(np.arange(3), WORLD.size)[WORLD.rank]
    col = ColumnParallelLinear(8, 6, gather_output=True, use_sequence_parallel=sp,
                               dtype=np.float64, seed=1)
    xin = x[rows] if sp else x
    assert_close(col.forward(xin), ref.forward(x), what="y")
    dx_ref = ref.backward(dy)
    assert_close(col.backward(dy), dx_ref[rows] if sp else dx_ref, what="dx")
    # A forward input of the wrong width on one rank: the gather comes next.
    bad = xin[..., :-1] if WORLD.rank == WORLD.size - 1 else xin
    _everywhere_within(r"ColumnParallelLinear\.forward, refused by this rank|disagree",
                       col.forward, bad)
    col.forward(xin)
    # An output gradient of the wrong shape on one rank: the input gradient's sum follows.
    bad = dy[:, :, :-1] if WORLD.rank == 0 else dy
    _everywhere_within(r"ColumnParallelLinear\.backward, refused by this rank|disagree",
                       col.backward, bad)


@pytest.mark.mpi(min_size=1)
def test_row_backward_refused_on_one_rank(tp_world):
    x, dy = _data()
    row = RowParallelLinear(8, 4, dtype=np.float64, seed=2)
    row.forward(x)
    bad = [dy] if WORLD.rank == 0 else dy  # not an array on rank 0
    _everywhere_within(r"RowParallelLinear\.backward, refused by this rank|disagree",
                       row.backward, bad)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(8 % WORLD.size != 0, reason="8 heads split over every rank")
def test_attention_key_lengths_that_differ_raise(tp_world):
    seq, batch, hidden, heads = 5, 2, 16, 8
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((seq, batch, hidden)), rng.standard_normal((seq, batch, hidden))
    lens = np.array([seq, 2])
    y_ref, dx_ref, *_ = serial_reference(hidden, heads, 5, False, lens, x, dy)
    layer = ParallelAttention(hidden, heads, dtype=np.float64, seed=5)
    assert_close(layer.forward(x, key_lengths=lens), y_ref, what="forward")  # the correct case
    assert_close(layer.backward(dy), dx_ref, what="dx")
    if WORLD.size > 1:  # the mask is local: only the lengths' check can tell
        start = time.monotonic()
        mine = lens if WORLD.rank else np.array([3, 2])
        raises_everywhere(CollectiveMismatchError, "key_lengths", layer.forward, x, mine)
        # Given on one rank only: that check meets the others' output projection's.
        raises_everywhere(CollectiveMismatchError, "disagree", layer.forward, x,
                          None if WORLD.rank else lens)
        agree(time.monotonic() - start < 10, "the mismatches took more than 10 s to raise")
    # An input, then an output gradient, that one rank alone refuses.
    bad = x[..., :-1] if WORLD.rank == 0 else x
    _everywhere_within(r"ParallelAttention\.forward, refused by this rank|disagree",
                       layer.forward, bad)
    layer.forward(x, key_lengths=lens)
    bad = dy.astype(np.float32) if WORLD.rank == 0 else dy
    _everywhere_within(r"ParallelAttention\.backward, refused by this rank|disagree",
                       layer.backward, bad)
    # Lengths one rank alone refuses (out of range there).
    bad = np.array([seq + 1, 2]) if WORLD.rank == 0 else lens
    _everywhere_within(r"ParallelAttention\.forward, refused by this rank|disagree|key_lengths",
                       layer.forward, x, bad)


@pytest.mark.mpi(min_size=1)
def test_context_attention_dtype_refused_on_one_rank(clean_state):
    manager.initialize_parallel(context_parallel_size=WORLD.size)
    seq, batch, hidden, heads = 9, 2, 8, 2
    rng = np.random.default_rng(8)
    x, dy = rng.standard_normal((seq, batch, hidden)), rng.standard_normal((seq, batch, hidden))
    y_ref, *_ = serial_reference(hidden, heads, 4, False, None, x, dy)
    rows = np.array_split(np.arange(seq), WORLD.size)[WORLD.rank]
    layer = ContextAttention(hidden, heads, scheme="ring", dtype=np.float64, seed=4)
    assert_close(layer.forward(x[rows]), y_ref[rows], what="forward")  # the correct case
    bad = x[rows].astype(np.float32) if WORLD.rank == 0 else x[rows]
    start = time.monotonic()
    error = ValueError if WORLD.size == 1 else CollectiveMismatchError
    raises_everywhere(error, r"float32", layer.forward, bad)
    agree(time.monotonic() - start < 10, "the refusal took more than 10 s to reach every rank")


@pytest.mark.mpi(min_size=8)
def test_layernorm3d_forward_refused_on_one_rank(cube):
    debug.set_timeout(8)
    try:
        hidden = 7
        ref = LayerNorm(hidden, dtype=np.float64)
        x = np.random.default_rng(9).standard_normal((8, hidden)) * 3 + 1
        norm = LayerNorm3D(hidden, dtype=np.float64)
        layout = norm.layout
        y = norm.forward(layout.split_input(x))  # the correct case
        assert_close(layout.gather_input(y), ref.forward(x), what="forward")
        # One rank of every output group (the only group of the forward's collective).
        block = layout.split_input(x)
        bad = block.astype(np.float32) if layout.output.rank == 0 else block
        start = time.monotonic()
        raises_everywhere(CollectiveMismatchError, r"LayerNorm3D\(7, .*\.forward.*float32",
                          norm.forward, bad)
        agree(time.monotonic() - start < 10, "the refusal took more than 10 s to reach every rank")
    finally:
        debug.set_timeout(None)


@pytest.mark.mpi(min_size=8)
def test_linear3d_input_refused_on_one_rank(cube):
    """One rank of the cube passes a block of another dtype, then one an output gradient
    of another shape: every rank raises, none waits in the 3D layer's gathers."""
    debug.set_timeout(8)
    try:
        ref = Linear(8, 12, dtype=np.float64, seed=3)
        layer = Linear3D(8, 12, dtype=np.float64, seed=3)
        layout = layer.layout
        rng = np.random.default_rng(10)
        x, dy = rng.standard_normal((6, 8)), rng.standard_normal((6, 12))
        y = layer.forward(layout.split_input(x))  # the correct case
        assert_close(layout.gather_output(y), ref.forward(x), what="forward")
        layer.backward(layout.split_output(dy))
        block = layout.split_input(x)
        bad = block.astype(np.float32) if WORLD.rank == 3 else block
        start = time.monotonic()
        raises_everywhere(CollectiveMismatchError, r"Linear3D\(8->12, .*\.forward.*float32",
                          layer.forward, bad)
        layer.forward(block)
        grad = layout.split_output(dy)
        bad = grad[:, :-1] if WORLD.rank == 5 else grad
        raises_everywhere(CollectiveMismatchError, r"Linear3D\(8->12, .*\.backward",
                          layer.backward, bad)
        agree(time.monotonic() - start < 10, "the refusals took more than 10 s to reach every rank")
    finally:
        debug.set_timeout(None)


@pytest.mark.mpi(min_size=2)
def test_a_refusal_reaches_every_rank_in_debug_mode(tp_world):
    """In debug mode too a layer's input refused on one rank raises on every rank."""
    x, _ = _data()
    row = RowParallelLinear(8, 4, dtype=np.float64, seed=2)
    bad = x.astype(np.float32) if WORLD.rank == 0 else x
    with debug.debug_mode(enabled=True, timeout=8.0):
        _everywhere_within(r"RowParallelLinear\(8->4.*\.forward.*float32", row.forward, bad)
        ref = Linear(8, 4, dtype=np.float64, seed=2)
        assert_close(row.forward(x), ref.forward(x), what="y after the refusal")
