"""Memory accounting: bytes per rank of parameters, gradients, optimizer state, activations."""

import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import block, rng_array
from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import backend, manager
from pympar.group import Group
from pympar.memory import (activation_bytes, gradient_bytes, memory_report, optimizer_bytes,
                           parameter_bytes, workspace_bytes)
from pympar.modules import GELU, ColumnParallelLinear, Parameter, RowParallelLinear, Sequential
from pympar.optim import SGD, AdamW
from pympar.zero import ZeroRedundancyOptimizer, share_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_memory  # noqa: E402

FEATURES, HIDDEN, ROWS = 6, 26, 7


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"], ids=["f32", "bf16"])
def test_report_matches_formulas_per_rank(dtype):
    if dtype == "bfloat16":
        if backend.bfloat16 is None:
            pytest.skip("ml_dtypes (bfloat16) is not installed")
        dtype = backend.bfloat16
    size = np.dtype(dtype).itemsize
    tp = 2 if WORLD.size % 2 == 0 else 1
    manager.initialize_parallel(tensor_parallel_size=tp)
    try:
        dp = manager.get_data_parallel_group()
        h = block(HIDDEN, tp, manager.get_tensor_parallel_rank())
        h = h.stop - h.start
        model = Sequential(
            ColumnParallelLinear(FEATURES, HIDDEN, gather_output=False, dtype=dtype, seed=1),
            GELU(),
            RowParallelLinear(HIDDEN, FEATURES, input_is_parallel=True, dtype=dtype, seed=2))
        opt = ZeroRedundancyOptimizer(model, AdamW, lr=1e-3)
        n_local = h * FEATURES + h + FEATURES * h + FEATURES
        x = rng_array(0, (ROWS, FEATURES), np.float32).astype(dtype)
        y = model(x)
        # Column caches its input, GELU its input and tanh, Row its input: ROWS rows each.
        cached = activation_bytes(model)
        agree(cached == ROWS * (FEATURES + 3 * h) * size, f"activations {cached}")
        model.backward(y)
        opt.step()
        report = memory_report(model, opt)
        d, r = dp.size, dp.rank
        params = model.parameters()
        rows = share_rows([p.shape for p in params], d)
        totals = [sum(n[k] * (p.size // p.shape[0]) for n, p in zip(rows, params))
                  for k in range(d)]
        share, largest = totals[r], max(totals)
        master = 4 if size == 2 else 0
        # The float32 gradient shares are the reduce-scatter's output (one bucket here): sized
        # for the largest rank's share.
        expected = {"parameters": n_local * size,
                    "gradients": n_local * size + master * largest,
                    "optimizer": (8 + master) * share,
                    "activations": 0}
        got = {k: report[k] for k in expected}
        agree(got == expected, f"{got} != {expected}")
        agree(report["total"] == sum(report[k] for k in expected) + report["workspace"],
              f"total {report}")
        agree(0 < workspace_bytes(opt) <= 4 * (25 * 2**20 + n_local * 4), "workspace")
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_shared_arrays_count_once_and_bad_optimizer():
    base = np.zeros((4, 3))
    a, b = Parameter(base), Parameter(base[:2])
    agree(parameter_bytes([a, b]) == base.nbytes + base[:2].nbytes, "views are distinct blocks")
    agree(parameter_bytes([a, a]) == base.nbytes, "same parameter twice")
    agree(gradient_bytes([a]) == 0, "no gradient yet")
    opt = SGD([a], lr=0.1, momentum=0.9)
    agree(optimizer_bytes(opt) == base.nbytes, f"SGD momentum {optimizer_bytes(opt)}")
    agree(optimizer_bytes(SGD([a], lr=0.1)) == 0, "SGD without momentum holds no state")
    raises_everywhere(TypeError, "pympar optimizer", optimizer_bytes, object())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(16, 8), (13, 5)], ids=["even", "uneven"])
def test_benchmark_formulas_hold(shape):
    """bench_memory's formulas are exact on an even shape and within one row per parameter."""
    world = Group(MPI.COMM_WORLD, "world", range(WORLD.size), owns_comm=False)
    configs = ["AdamW", "ZeRO", "recompute"] + (["ZeRO + bf16"] if backend.bfloat16 else [])
    for config in configs:
        entry = bench_memory.measure(*shape, world, config)
        # Ranks' shares differ by at most one row of each of the four parameters.
        hidden = shape[0]
        uneven = config.startswith("ZeRO") and hidden % WORLD.size
        slack = 16 * (hidden + 1 + 4 * hidden + 1) if uneven else 0
        for kind in bench_memory.KINDS:
            got, want = entry["measured"][kind], entry["formula"][kind]
            agree(abs(got - want) <= slack, f"{config} {kind}: {got} vs formula {want}")
