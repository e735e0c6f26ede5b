"""input_grad=False and frozen parameters: only the asked-for work, bitwise the same results.

Each check runs one layer twice from the same seed and data: the full backward, and the
backward with the input gradient skipped or a parameter frozen. Outputs and the gradients
still computed must be bitwise equal; a frozen parameter's grad stays None; the collective
that only served the input gradient is not issued (pympar.stats).
"""

import itertools

import numpy as np
import pytest

from layer_helpers import rng_array
from mpi_helpers import WORLD, agree, assert_equal, raises_everywhere, to_numpy
from pympar import manager, stats
from pympar.modules import (GELU, ColumnParallelLinear, LayerNorm, LayerNorm3D, Linear, Linear3D,
                            RowParallelLinear, Sequential)
from pympar.optim import SGD

S, IN, OUT = 7, 5, 6


def run(layer, x, dy, freeze=()):
    """One forward + backward; returns the output, dx and every parameter's grad."""
    for name in freeze:
        getattr(layer, name).requires_grad = False
    layer.zero_grad(set_to_none=True)
    out = layer.forward(x)
    y = out[0] if isinstance(out, tuple) else out
    dx = layer.backward(dy)
    return y, dx, {n: p.grad for n, p in layer.named_parameters()}


def compare(make, x, dy, what):
    """input_grad=False and each frozen parameter against the full backward of ``make()``."""
    full_y, full_dx, full_grads = run(make(input_grad=True), x, dy)
    agree(full_dx is not None and all(g is not None for g in full_grads.values()),
          f"{what}: full backward computes everything")
    cases = [("input_grad=False", make(input_grad=False), ())]
    cases += [(f"{n} frozen", make(input_grad=True), (n,)) for n in full_grads]
    for label, layer, frozen in cases:
        y, dx, grads = run(layer, x, dy, frozen)
        assert_equal(y, full_y, f"{what} {label}: output")
        if frozen:
            assert_equal(dx, full_dx, f"{what} {label}: dx")
        else:
            agree(dx is None, f"{what} {label}: backward returns None")
        for n, g in grads.items():
            if n in frozen:
                agree(g is None, f"{what} {label}: frozen {n} got a gradient")
            else:
                assert_equal(g, full_grads[n], f"{what} {label}: d{n}")


@pytest.mark.mpi(min_size=1)
def test_serial_layers():
    x, dy = rng_array(1, (S, 2, IN), np.float64), rng_array(2, (S, 2, OUT), np.float64)
    compare(lambda **kw: Linear(IN, OUT, dtype=np.float64, seed=3, **kw), x, dy, "Linear")
    norm_dy = rng_array(3, (S, 2, IN), np.float64)
    compare(lambda **kw: LayerNorm(IN, dtype=np.float64, **kw), x, norm_dy, "LayerNorm")


@pytest.mark.mpi(min_size=1)
def test_sequential_and_requires_grad_():
    x, dy = rng_array(1, (S, IN), np.float64), rng_array(2, (S, IN), np.float64)

    def model(input_grad=True):
        inner = Sequential(Linear(IN, OUT, dtype=np.float64, seed=1), GELU())
        return Sequential(inner, Linear(OUT, IN, dtype=np.float64, seed=2), input_grad=input_grad)

    full_y, full_dx, full_grads = run(model(), x, dy)
    skipped = model(input_grad=False)
    agree(not skipped.input_grad and not skipped[0][0].input_grad and skipped[1].input_grad,
          "Sequential(input_grad=False) reaches the first layer inside a nested container")
    y, dx, grads = run(skipped, x, dy)
    agree(dx is None, "Sequential returns None")
    assert_equal(y, full_y, "Sequential output")
    for n, g in grads.items():
        assert_equal(g, full_grads[n], f"Sequential d{n}")
    frozen = model()
    frozen[0].requires_grad_(False)
    before = {n: p.data.copy() for n, p in frozen.named_parameters()}
    y, dx, grads = run(frozen, x, dy)
    assert_equal(dx, full_dx, "dx with the first layer frozen")
    agree(grads["0.0.weight"] is None and grads["0.0.bias"] is None, "frozen grads stay None")
    assert_equal(grads["1.weight"], full_grads["1.weight"], "unfrozen grad")
    SGD(frozen.parameters(), lr=0.1).step()
    after = dict(frozen.named_parameters())
    assert_equal(after["0.0.weight"].data, before["0.0.weight"], "frozen data after a step")
    agree(not np.array_equal(after["1.weight"].data, before["1.weight"]), "unfrozen data moved")


def tp_sizes():
    return [tp for tp in (1, 2, 4) if WORLD.size % tp == 0]


@pytest.mark.mpi(min_size=1)
def test_column_and_row(clean_state):
    x = rng_array(1, (S, 2, IN), np.float64)
    dy = rng_array(2, (S, 2, OUT), np.float64)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        rows = np.array_split(np.arange(S), tp)[r]
        cols_out = np.array_split(np.arange(OUT), tp)[r]
        cols_in = np.array_split(np.arange(IN), tp)[r]
        for gather, sp in itertools.product([True, False], repeat=2):
            compare(lambda **kw: ColumnParallelLinear(IN, OUT, gather_output=gather,
                                                      use_sequence_parallel=sp, dtype=np.float64,
                                                      seed=3, **kw),
                    x[rows] if sp else x, dy if gather else dy[..., cols_out],
                    f"Column tp={tp} gather={gather} sp={sp}")
        for parallel_in, sp in itertools.product([True, False], repeat=2):
            compare(lambda **kw: RowParallelLinear(IN, OUT, input_is_parallel=parallel_in,
                                                   use_sequence_parallel=sp, dtype=np.float64,
                                                   seed=3, **kw),
                    x[..., cols_in] if parallel_in else x, dy[rows] if sp else dy,
                    f"Row tp={tp} parallel_in={parallel_in} sp={sp}")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(WORLD.size % 2 != 0, reason="TP=2 needs an even number of ranks")
def test_skipped_input_gradient_issues_no_all_reduce(clean_state):
    """Column -> GELU -> Row at TP=2: one all-reduce per step fewer without the input grad."""
    manager.initialize_parallel(2)
    x = rng_array(1, (S, IN), np.float32)
    dy = rng_array(2, (S, IN), np.float32)
    counts = {}
    for input_grad in (True, False):
        model = Sequential(ColumnParallelLinear(IN, OUT, gather_output=False, seed=1), GELU(),
                           RowParallelLinear(OUT, IN, input_is_parallel=True, seed=2),
                           input_grad=input_grad)
        model.forward(x)
        with stats.record() as rec:
            model.forward(x)
            model.backward(dy)
        counts[input_grad] = {op: row[0] for (_, op), row in rec.rows.items()}
    agree(counts[True] == {"reduce_from_all.forward": 1, "copy_to_all.backward": 1}
          and counts[False] == {"reduce_from_all.forward": 1}, f"collectives per step: {counts}")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("swap", [False, True])
def test_3d_layers(cube, swap):
    hidden = 9
    probe = Linear3D(IN, hidden, swap=swap, dtype=np.float64)
    x = probe.layout.split_input(rng_array(1, (S, IN), np.float64))
    dy = probe.layout.split_output(rng_array(2, (S, hidden), np.float64))
    compare(lambda **kw: Linear3D(IN, hidden, swap=swap, dtype=np.float64, seed=4, **kw),
            x, dy, f"Linear3D swap={swap}")
    norm_x = probe.layout.split_input(rng_array(3, (S, hidden), np.float64))
    norm_dy = probe.layout.split_input(rng_array(4, (S, hidden), np.float64))
    compare(lambda **kw: LayerNorm3D(hidden, swap=swap, dtype=np.float64, **kw),
            norm_x, norm_dy, f"LayerNorm3D swap={swap}")
    layer = Linear3D(IN, hidden, swap=swap, dtype=np.float64, seed=4)
    layer.forward(x)
    layer.input_grad = False
    layer.forward(x)
    layer.input_grad = True
    raises_everywhere(RuntimeError, "changed between forward and backward", layer.backward, dy)
    agree(to_numpy(layer.weight.data).shape == layer.weight.placement.local_shape, "shape")
