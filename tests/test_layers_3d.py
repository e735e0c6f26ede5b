"""Linear3D and LayerNorm3D at depth 2 on 8 ranks against serial layers."""

import re
import time

import numpy as np
import pytest

from layer_helpers import DTYPES, XPS, get_xp, rng_array, tolerance
from mpi_helpers import agree, assert_close, assert_equal, raises_everywhere
from pympar import manager, stats
from pympar.debug import CollectiveMismatchError
from pympar.modules import GELU, LayerNorm, LayerNorm3D, Linear, Linear3D, layout_3d

ROWS, IN, MID, OUT = 9, 5, 7, 6  # nothing divides evenly at d=2


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_linear3d_layers_alternate_layouts(cube, xp_name, dtype):
    xp = get_xp(xp_name)
    tol = tolerance(dtype)
    ref1, ref2 = (Linear(IN, MID, dtype=dtype, seed=4, xp=xp),
                  Linear(MID, OUT, dtype=dtype, seed=5, xp=xp))
    x = rng_array(1, (ROWS, IN), dtype, xp)
    dy = rng_array(2, (ROWS, OUT), dtype, xp)
    h_ref = ref1.forward(x)
    y_ref = ref2.forward(h_ref)
    dx_ref = ref1.backward(ref2.backward(dy))

    fc1 = Linear3D(IN, MID, dtype=dtype, seed=4, xp=xp)
    fc2 = Linear3D(MID, OUT, swap=True, dtype=dtype, seed=5, xp=xp)
    assert_equal(fc1.weight.data, fc1.weight.placement.take(ref1.weight.data), "fc1 weight block")
    h = fc1.forward(fc1.layout.split_input(x))
    assert_close(h, fc1.layout.split_output(h_ref), **tol, what="fc1 output block")
    assert_close(h, fc2.layout.split_input(h_ref), **tol, what="fc2 input layout = fc1 output")
    y = fc2.forward(h)
    assert_close(fc2.layout.gather_output(y), y_ref, **tol, what="gathered output")
    dx = fc1.backward(fc2.backward(fc2.layout.split_output(dy)))
    assert_close(dx, fc1.layout.split_input(dx_ref), **tol, what="dx block")
    assert_close(fc1.layout.gather_input(dx), dx_ref, **tol, what="gathered dx")
    for layer, ref in ((fc1, ref1), (fc2, ref2)):
        dw, db = layer.full_weight_grad()
        assert_close(dw, ref.weight.grad, **tol, what=f"{layer.in_features}->{layer.out_features} dW")
        assert_close(db, ref.bias.grad, **tol, what=f"{layer.in_features}->{layer.out_features} db")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("hidden", [7, 1], ids=["hidden-7", "hidden-1-fewer-than-depth"])
def test_layernorm3d(cube, swap, xp_name, hidden):
    xp = get_xp(xp_name)
    dtype = np.float64
    ref = LayerNorm(hidden, dtype=dtype, xp=xp)
    ref.weight.data[...] = rng_array(3, hidden, dtype, xp)
    ref.bias.data[...] = rng_array(4, hidden, dtype, xp)
    x = rng_array(5, (ROWS, hidden), dtype, xp) * 3 + 1
    dy = rng_array(6, (ROWS, hidden), dtype, xp)
    y_ref = ref.forward(x)
    dx_ref = ref.backward(dy)

    norm = LayerNorm3D(hidden, swap=swap, dtype=dtype, xp=xp)
    layout = norm.layout
    # NumPy's own split of the hidden axis over the output group, not pympar's rule.
    cols = np.array_split(np.arange(hidden), layout.depth)[layout.output.rank]
    norm.weight.data[...] = ref.weight.data[cols]
    norm.bias.data[...] = ref.bias.data[cols]
    y = norm.forward(layout.split_input(x))
    assert_close(y, layout.split_input(y_ref), what="LayerNorm3D forward")
    assert_close(layout.gather_input(y), y_ref, what="LayerNorm3D gathered forward")
    dx = norm.backward(layout.split_input(dy))
    assert_close(dx, layout.split_input(dx_ref), what="LayerNorm3D dx")
    assert_close(layout.gather_input(dx), dx_ref, what="LayerNorm3D gathered dx")
    assert_close(norm.weight.grad, ref.weight.grad[cols], what="dgamma")
    assert_close(norm.bias.grad, ref.bias.grad[cols], what="dbeta")
    # Gathered over the output group, the parameter gradients are the serial ones.
    assert_close(layout.output.all_gather(norm.weight.grad, axis=0), ref.weight.grad,
                 what="gathered dgamma")
    assert_close(layout.output.all_gather(norm.bias.grad, axis=0), ref.bias.grad,
                 what="gathered dbeta")


@pytest.mark.mpi(min_size=1)
def test_3d_layers_need_a_3d_state(clean_state):
    raises_everywhere(RuntimeError, "Linear3D needs a 3D parallel state", Linear3D, 8, 8)
    manager.initialize_parallel()
    raises_everywhere(RuntimeError, "LayerNorm3D needs a 3D parallel state.*tensor_parallel_mode",
                      LayerNorm3D, 8)


@pytest.mark.mpi(min_size=8)
def test_linear3d_bad_input(cube):
    layer = Linear3D(8, 8, dtype=np.float64)
    raises_everywhere(ValueError, r"Linear3D.*local input block of shape \(rows, \.\.\., 4\)",
                      layer.forward, np.zeros((2, 8)))
    raises_everywhere(RuntimeError, "Linear3D.backward called before forward",
                      layer.backward, np.zeros((2, 4)))
    raises_everywhere(ValueError, "full weight must have shape", layer.load_full_weight,
                      np.zeros((4, 4)))


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("between", ["nothing", "GELU"])
def test_consecutive_linear3d_with_the_same_layout_raise(cube, between):
    """Issue: a second Linear3D lacking swap=True gave a wrong answer with no error. Here
    the local shapes fit (8 features split 4 + 4 both ways), only the layout differs."""
    fc1 = Linear3D(8, 8, dtype=np.float64, seed=1)
    fc2 = Linear3D(8, 8, dtype=np.float64, seed=2)  # should be swap=True
    act = GELU()
    x = fc1.layout.split_input(rng_array(1, (ROWS, 8), np.float64))
    h = fc1.forward(x)
    h = act.forward(h) if between == "GELU" else h
    raises_everywhere(ValueError, r"Linear3D.*layout.*swap=True", fc2.forward, h)
    norm = LayerNorm3D(8, dtype=np.float64)  # the layout of fc1's input, not its output
    raises_everywhere(ValueError, r"LayerNorm3D.*layout.*swap=", norm.forward, h)
    # The right layout works and keeps its tag through the element-wise layer.
    good = Linear3D(8, 8, swap=True, dtype=np.float64, seed=2)
    y = good.forward(h)
    assert_close(good.layout.gather_output(y),
                 Linear(8, 8, dtype=np.float64, seed=2).forward(good.layout.gather_input(h)),
                 what="swap=True after swap=False")
    # A gradient block in the wrong layout is refused too.
    raises_everywhere(ValueError, r"output gradient block is in the layout", good.backward,
                      good.layout.split_input(rng_array(3, (ROWS, 8), np.float64)))
    assert_equal(layout_3d(swap=True).key, good.layout.key, "layout_3d(swap=True) key")


@pytest.mark.mpi(min_size=8)
def test_3d_collectives_are_labelled_with_their_layer(cube):
    fc = Linear3D(IN, MID, seed=4, dtype=np.float64)
    norm = LayerNorm3D(MID, swap=True, dtype=np.float64)
    x = fc.layout.split_input(rng_array(1, (ROWS, IN), np.float64, np))
    with stats.record() as rec:
        y = norm.forward(fc.forward(x))
        fc.backward(norm.backward(np.ones_like(y)))
    # each layer's label also names its sizes: "Linear3D(5->7, bias=True, dtype=float64)"
    names = {re.sub(r"\(.*\)", "", op.partition(":")[0]) for (_, op) in rec.rows}
    expected = {"Linear3D.forward", "Linear3D.backward", "LayerNorm3D.forward",
                "LayerNorm3D.backward"}
    assert names == expected, names


@pytest.mark.mpi(min_size=8)
def test_3d_ranks_with_different_layers_raise(cube):
    # eps changes no shape and a bias only adds a collective after the others: the labels
    # tell them apart. Each differs within every input (output) group, so every rank raises.
    layout = layout_3d()
    x = rng_array(1, (ROWS, IN), np.float64)
    fc = Linear3D(IN, MID, dtype=np.float64, seed=4)  # the correct case
    ref = Linear(IN, MID, dtype=np.float64, seed=4)
    h = fc.forward(layout.split_input(x))
    assert_close(fc.layout.gather_output(h), ref.forward(x), what="Linear3D forward")
    norm = LayerNorm3D(MID, eps=0.5, swap=True, dtype=np.float64)
    assert_close(norm.layout.gather_input(norm.forward(h)),
                 LayerNorm(MID, eps=0.5, dtype=np.float64).forward(ref.forward(x)),
                 what="LayerNorm3D forward")
    start = time.monotonic()
    norm = LayerNorm3D(MID, eps=0.5 if norm.layout.output.rank == 0 else 0.25, swap=True,
                       dtype=np.float64)
    raises_everywhere(CollectiveMismatchError, r"LayerNorm3D\(7, eps=0.(5|25)", norm.forward, h)
    fc = Linear3D(IN, MID, bias=layout.input.rank == 0, dtype=np.float64, seed=4)
    raises_everywhere(CollectiveMismatchError, r"Linear3D\(5->7, bias=(True|False)", fc.forward,
                      layout.split_input(x))
    agree(time.monotonic() - start < 10, "the mismatches took more than 10 s to raise")
