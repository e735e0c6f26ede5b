"""Deterministic sharded initialization: shards reassemble bitwise, memory stays shard-sized."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from pympar import manager
from pympar.modules import (
    Linear,
    bias_init,
    init_shard,
    initialize_affine_weight,
    normal,
    xavier_uniform,
)
from pympar.partition import Placement, Split
from layer_helpers import owned


def _returning_init(rng, out, fan_in, fan_out):
    # A user init in the "return an array" style.
    return rng.uniform(-0.5, 0.5, out.shape) * math.sqrt(fan_in / fan_out)


METHODS = ["xavier_uniform", "xavier_normal", "kaiming_uniform", "normal", "zeros",
           normal(0.3, mean=1.0), _returning_init]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m if isinstance(m, str) else "callable")
@pytest.mark.parametrize("partition_dim", [0, 1])
@pytest.mark.parametrize("stride", [1, 3])
def test_shards_reassemble_bitwise(method, partition_dim, stride):
    shape = (13, 14)
    full = initialize_affine_weight(shape, 1, partition_dim, method, np.float32, rank=0, seed=7)
    assert full.shape == shape and full.dtype == np.float32
    for tp in (1, 2, 3, 4):
        rebuilt = np.full(shape, np.nan, dtype=np.float32)
        for rank in range(tp):
            shard = initialize_affine_weight(shape, tp, partition_dim, method, np.float32,
                                             rank=rank, seed=7, stride=stride)
            idx = owned(shape[partition_dim], tp, rank, stride)
            if partition_dim == 0:
                rebuilt[idx, :] = shard
            else:
                rebuilt[:, idx] = shard
        assert rebuilt.tobytes() == full.tobytes(), (tp, stride)
    if stride == 1:
        # Plain concatenation in rank order is the full weight.
        shards = [initialize_affine_weight(shape, 3, partition_dim, method, rank=r, seed=7)
                  for r in range(3)]
        assert np.concatenate(shards, axis=partition_dim).tobytes() == full.tobytes()


def test_dtypes_round_the_same_float64_values():
    shape = (6, 5)
    f64 = initialize_affine_weight(shape, 1, 0, "xavier_normal", np.float64, rank=0, seed=3)
    for dtype in (np.float32, np.float16):
        got = initialize_affine_weight(shape, 2, 1, "xavier_normal", dtype, rank=1, seed=3)
        assert got.dtype == dtype
        assert np.array_equal(got, f64[:, 3:].astype(dtype))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = initialize_affine_weight(shape, 1, 0, "xavier_normal", ml_dtypes.bfloat16, rank=0, seed=3)
    assert bf.tobytes() == f64.astype(ml_dtypes.bfloat16).tobytes()


def test_seeds_and_streams_differ():
    a = initialize_affine_weight((4, 8), 1, 0, "normal", rank=0, seed=0)
    b = initialize_affine_weight((4, 8), 1, 0, "normal", rank=0, seed=1)
    assert not np.array_equal(a, b)
    # Rows are independent streams, not copies of one another.
    assert not np.array_equal(a[0], a[1])
    bias = bias_init(8, 8, seed=0)
    assert not np.allclose(bias, initialize_affine_weight((1, 8), 1, 0, "uniform", seed=0)[0])


def test_bias_init_shards_and_bounds():
    full = bias_init(11, 16, 1, np.float64, seed=5)
    assert full.shape == (11,)
    assert np.abs(full).max() <= 1 / math.sqrt(16)
    for stride in (1, 2):
        rebuilt = np.empty_like(full)
        for rank in range(3):
            rebuilt[owned(11, 3, rank, stride)] = bias_init(
                11, 16, 3, np.float64, rank=rank, seed=5, stride=stride)
        assert rebuilt.tobytes() == full.tobytes()


def test_a_block_split_on_both_axes_is_the_serial_weight_cut_alike():
    full = initialize_affine_weight((9, 10), 1, 0, "xavier_uniform", np.float64, rank=0, seed=2)
    placement = Placement((9, 10), (Split(0, 3, 1), Split(1, 2, 0, stride=2)))
    rows, cols = placement.axis_ranges
    block = init_shard(placement, "xavier_uniform", np.float64, seed=2)
    expected = np.concatenate([full[rows[0]][:, c] for c in cols], axis=1)
    assert block.shape == placement.local_shape == (3, 6)
    assert np.array_equal(block, expected)


def test_fans_come_from_the_full_shape():
    # xavier_uniform bound from the full (out, in), not from the shard.
    shard = initialize_affine_weight((400, 300), 4, 0, xavier_uniform(), np.float64, rank=2)
    bound = math.sqrt(6 / 700)
    assert np.abs(shard).max() <= bound
    assert abs(shard.std() - bound / math.sqrt(3)) < 0.03 * bound
    normal_shard = initialize_affine_weight((400, 300), 4, 1, "xavier_normal", np.float64, rank=1)
    assert abs(normal_shard.std() - math.sqrt(2 / 700)) < 0.03 * math.sqrt(2 / 700)


def test_linear_default_init_matches_torch_distribution():
    layer = Linear(512, 256, dtype=np.float64, seed=11)
    bound = 1 / math.sqrt(512)
    w, b = layer.weight.data, layer.bias.data
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.01 * bound
    assert abs(w.mean()) < 0.01 * bound
    assert abs(b.std() - bound / math.sqrt(3)) < 0.1 * bound


def test_bad_arguments():
    with pytest.raises(ValueError, match="tp_world_size"):
        initialize_affine_weight((4, 4), 0, 0, rank=0)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        initialize_affine_weight((4, 4), 2, 0, rank=2)
    with pytest.raises(ValueError, match="partition_dim"):
        initialize_affine_weight((4, 4), 2, 2, rank=0)
    with pytest.raises(ValueError, match="cannot partition"):
        initialize_affine_weight((5, 4), 2, 0, rank=0, stride=3)
    with pytest.raises(ValueError, match="unknown init_method"):
        initialize_affine_weight((4, 4), 1, 0, "glorot", rank=0)
    with pytest.raises(ValueError, match="seed"):
        initialize_affine_weight((4, 4), 1, 0, rank=0, seed=-1)
    with pytest.raises(ValueError, match="init_shape"):
        initialize_affine_weight((4,), 1, 0, rank=0)


def test_rank_none():
    # tp_world_size=1 never needs the parallel state.
    assert np.array_equal(initialize_affine_weight((3, 4), 1, 0, seed=1),
                          initialize_affine_weight((3, 4), 1, 0, rank=0, seed=1))
    if not manager.is_initialized():
        with pytest.raises(RuntimeError, match="not initialized"):
            initialize_affine_weight((4, 4), 2, 0)


@pytest.mark.parametrize("partition_dim", [0, 1])
def test_peak_memory_is_one_shard(partition_dim):
    shape, tp = (4096, 4096), 4
    shard_bytes = shape[0] * shape[1] // tp * 4
    row_bytes = shape[1] * 8
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        shard = initialize_affine_weight(shape, tp, partition_dim, "xavier_uniform", np.float32,
                                         rank=1, seed=0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert shard.nbytes == shard_bytes
    assert peak < shard_bytes + 4 * row_bytes, (peak, shard_bytes)
