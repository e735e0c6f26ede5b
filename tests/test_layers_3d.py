"""Linear3D and LayerNorm3D at depth 2 on 8 ranks against serial layers."""

import numpy as np
import pytest

from layer_helpers import DTYPES, XPS, get_xp, rng_array, tolerance
from mpi_helpers import WORLD, assert_close, assert_equal, raises_everywhere
from pympar import manager
from pympar.modules import LayerNorm, LayerNorm3D, Linear, Linear3D, layout_3d

ROWS, IN, MID, OUT = 9, 5, 7, 6  # nothing divides evenly at d=2


@pytest.fixture
def cube():
    manager.destroy_parallel()
    if WORLD.size % 8:
        pytest.skip("3D layers here use a depth-2 cube (multiples of 8 ranks)")
    manager.initialize_parallel(8, tensor_parallel_mode="3d")
    yield
    manager.destroy_parallel()


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
    rows, cols = fc1.layout.weight_block(MID, IN)
    assert_equal(fc1.weight.data, ref1.weight.data[rows, cols], "fc1 weight block")
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
def test_layernorm3d(cube, swap, xp_name):
    xp = get_xp(xp_name)
    dtype, hidden = np.float64, 7
    ref = LayerNorm(hidden, dtype=dtype, xp=xp)
    ref.weight.data[...] = rng_array(3, hidden, dtype, xp)
    ref.bias.data[...] = rng_array(4, hidden, dtype, xp)
    x = rng_array(5, (ROWS, hidden), dtype, xp) * 3 + 1
    dy = rng_array(6, (ROWS, hidden), dtype, xp)
    y_ref = ref.forward(x)
    dx_ref = ref.backward(dy)

    norm = LayerNorm3D(hidden, swap=swap, dtype=dtype, xp=xp)
    layout = norm.layout
    _, cols = layout.input_block(ROWS, hidden)
    norm.weight.data[...] = ref.weight.data[cols]
    norm.bias.data[...] = ref.bias.data[cols]
    y = norm.forward(layout.split_input(x))
    assert_close(y, layout.split_input(y_ref), what="LayerNorm3D forward")
    dx = norm.backward(layout.split_input(dy))
    assert_close(dx, layout.split_input(dx_ref), what="LayerNorm3D dx")
    assert_close(norm.weight.grad, ref.weight.grad[cols], what="dgamma")
    assert_close(norm.bias.grad, ref.bias.grad[cols], what="dbeta")


@pytest.mark.mpi(min_size=1)
def test_3d_layers_need_a_3d_state():
    manager.destroy_parallel()
    raises_everywhere(RuntimeError, "Linear3D needs a 3D parallel state", Linear3D, 8, 8)
    manager.initialize_parallel()
    try:
        raises_everywhere(RuntimeError, "LayerNorm3D needs a 3D parallel state.*tensor_parallel_mode",
                          LayerNorm3D, 8)
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=8)
def test_linear3d_bad_input(cube):
    layer = Linear3D(8, 8, dtype=np.float64)
    raises_everywhere(ValueError, r"Linear3D.*local input block of shape \(rows, \.\.\., 4\)",
                      layer.forward, np.zeros((2, 8)))
    raises_everywhere(RuntimeError, "Linear3D.backward called before forward",
                      layer.backward, np.zeros((2, 4)))
    raises_everywhere(ValueError, "full weight must have shape", layer.load_full_weight,
                      np.zeros((4, 4)))
    assert layout_3d().depth == 2
