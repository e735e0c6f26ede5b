"""Serial layers: finite-difference gradients, references, registration and state dicts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from layer_helpers import numeric_grad

from pympar.modules import (
    GELU,
    Dropout,
    LayerNorm,
    Linear,
    Module,
    MSELoss,
    Parameter,
    ReLU,
    Sequential,
    SoftmaxCrossEntropy,
)


def check_module_grads(module, x, seed=0):
    """Compare backward's input and parameter gradients with central differences."""
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(module(x).shape)
    module.zero_grad(set_to_none=True)
    module(x)
    dx = module.backward(dy)

    def loss():
        return float(np.sum(module(x) * dy))

    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(p.grad, numeric_grad(loss, p.data), rtol=1e-6, atol=1e-8,
                                   err_msg=name)


def randn(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def gelu_reference(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (4,)])
def test_linear_grads(shape):
    check_module_grads(Linear(4, 3, dtype=np.float64, seed=1), randn(*shape))


def test_linear_no_bias_and_forward_value():
    layer = Linear(4, 3, bias=False, dtype=np.float64, seed=2)
    assert layer.bias is None and [n for n, _ in layer.named_parameters()] == ["weight"]
    x = randn(2, 5, 4)
    np.testing.assert_allclose(layer(x), x @ layer.weight.data.T, rtol=1e-14)
    check_module_grads(layer, x)


def test_linear_validates_input():
    layer = Linear(4, 3)
    with pytest.raises(ValueError, match=r"Linear\(in_features=4.*\(\.\.\., 4\)"):
        layer(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="float32"):
        layer(np.zeros((2, 4), np.float64))


def test_activation_and_norm_grads():
    x = randn(3, 6)
    check_module_grads(GELU(), x.copy())
    check_module_grads(ReLU(), x + 0.01 * np.sign(x))  # keep away from the kink
    ln = LayerNorm(6, dtype=np.float64)
    ln.weight.data[:] = randn(6, seed=2)
    ln.bias.data[:] = randn(6, seed=3)
    check_module_grads(ln, randn(2, 3, 6))
    check_module_grads(LayerNorm(6, elementwise_affine=False, dtype=np.float64), x.copy())


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-14), (np.float32, 1e-5)])
def test_gelu_matches_tanh_formula(dtype, tol):
    x = (randn(64, 33) * 3).astype(dtype)
    x_before = x.copy()
    gelu = GELU()
    for _ in range(2):  # the second pass reuses the buffer released by backward
        y = gelu(x)
        assert y.dtype == dtype
        np.testing.assert_allclose(y, gelu_reference(x.astype(np.float64)), rtol=tol, atol=tol)
        dx = gelu.backward(np.ones_like(x))
        h = 1e-6
        x64 = x.astype(np.float64)
        ref = (gelu_reference(x64 + h) - gelu_reference(x64 - h)) / (2 * h)
        np.testing.assert_allclose(dx, ref, rtol=max(tol, 1e-8), atol=max(tol, 1e-8))
    assert np.array_equal(x, x_before)


def test_layernorm_matches_reference():
    x = randn(4, 5, 8) * 3 + 1
    ln = LayerNorm((8,), eps=1e-5, dtype=np.float64)
    ln.weight.data[:] = randn(8, seed=4)
    ln.bias.data[:] = randn(8, seed=5)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    ref = (x - mean) / np.sqrt(var + 1e-5) * ln.weight.data + ln.bias.data
    np.testing.assert_allclose(ln(x), ref, rtol=1e-12, atol=1e-12)
    # Non-contiguous input is accepted and gives the same result.
    xt = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    np.testing.assert_allclose(ln(xt), ref, rtol=1e-12, atol=1e-12)
    dx = ln.backward(np.ones_like(x))
    assert dx.shape == x.shape


def test_softmax_cross_entropy():
    logits = randn(3, 4, 5) * 4
    target = np.random.default_rng(2).integers(0, 5, size=(3, 4))
    loss_fn = SoftmaxCrossEntropy()
    lse = np.log(np.exp(logits).sum(-1))
    picked = np.take_along_axis(logits, target[..., None], -1)[..., 0]
    assert loss_fn(logits, target) == pytest.approx(float((lse - picked).mean()), rel=1e-12)
    loss_fn(logits, target)
    dlogits = loss_fn.backward(2.0)
    ref = numeric_grad(lambda: 2.0 * loss_fn.forward(logits, target), logits)
    np.testing.assert_allclose(dlogits, ref, rtol=1e-6, atol=1e-9)
    # Large logits stay finite.
    big = np.array([[1000.0, -1000.0, 0.0]])
    assert loss_fn(big, np.array([1])) == pytest.approx(2000.0)
    with pytest.raises(ValueError, match="targets"):
        loss_fn(logits, target[:, :2])
    with pytest.raises(ValueError, match="lie in"):
        loss_fn(logits, np.full((3, 4), 5))


def test_mse_loss():
    pred, target = randn(4, 3), randn(4, 3, seed=9)
    loss_fn = MSELoss()
    assert loss_fn(pred, target) == pytest.approx(float(((pred - target) ** 2).mean()), rel=1e-12)
    loss_fn(pred, target)
    dpred = loss_fn.backward(0.5)
    ref = numeric_grad(lambda: 0.5 * loss_fn.forward(pred, target), pred)
    np.testing.assert_allclose(dpred, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("layer", [Linear(2, 2), GELU(), ReLU(), LayerNorm(2), Dropout(0.5),
                                   SoftmaxCrossEntropy(), MSELoss()], ids=lambda m: type(m).__name__)
def test_backward_before_forward(layer):
    with pytest.raises(RuntimeError, match=f"{type(layer).__name__}.backward called before forward"):
        layer.backward(np.ones((1, 2), np.float32))


def test_backward_releases_cache():
    layer = Linear(2, 2)
    layer.backward(layer(np.ones((1, 2), np.float32)))
    with pytest.raises(RuntimeError, match="before forward"):
        layer.backward(np.ones((1, 2), np.float32))


def test_sequential_chains_forward_and_backward():
    model = Sequential(Linear(4, 6, dtype=np.float64, seed=1), GELU(),
                       LayerNorm(6, dtype=np.float64), Linear(6, 3, dtype=np.float64, seed=2))
    x = randn(5, 4)
    l0, g, ln, l1 = model
    assert len(model) == 4 and model[3] is l1
    np.testing.assert_allclose(model(x), l1(ln(g(l0(x)))), rtol=1e-14)
    check_module_grads(model, x)


def test_grads_accumulate_and_zero_grad():
    layer = Linear(3, 2, dtype=np.float64)
    x, dy = randn(4, 3), randn(4, 2)
    layer(x)
    layer.backward(dy)
    first = layer.weight.grad.copy()
    layer(x)
    layer.backward(dy)
    np.testing.assert_allclose(layer.weight.grad, 2 * first)
    buffer = layer.weight.grad
    layer.zero_grad()
    assert layer.weight.grad is buffer and not buffer.any()
    layer.zero_grad(set_to_none=True)
    assert layer.weight.grad is None
    layer(x)
    layer.backward(dy)
    np.testing.assert_allclose(layer.weight.grad, first)
    with pytest.raises(ValueError, match="gradient shape"):
        layer.weight.accumulate_grad(np.zeros((3, 2)))


class Block(Module):
    def __init__(self):
        super().__init__()
        self.fc1 = Linear(2, 3, seed=1)
        self.scale = Parameter(np.ones(3, np.float32))
        self.inner = Sequential(ReLU(), Linear(3, 2, seed=2))
        self.fc1_again = self.fc1  # a shared module is counted once


def test_registration_order_and_names():
    block = Block()
    names = [n for n, _ in block.named_parameters()]
    assert names == ["scale", "fc1.weight", "fc1.bias", "inner.1.weight", "inner.1.bias"]
    assert len(block.parameters()) == 5
    assert [type(m).__name__ for m in block.children()] == ["Linear", "Sequential"]
    assert [type(m).__name__ for m in block.modules()] == [
        "Block", "Linear", "Sequential", "ReLU", "Linear"]
    block.scale = None
    assert "scale" not in [n for n, _ in block.named_parameters()]
    block.eval()
    assert not any(m.training for m in block.modules())
    block.train()
    assert all(m.training for m in block.modules())


def test_state_dict_round_trip_and_errors():
    a, b = Block(), Block()
    for p in b.parameters():
        p.data += 1
    sd = a.state_dict()
    assert list(sd) == [n for n, _ in a.named_parameters()]
    sd["scale"][:] = 7  # a copy, not a view
    assert not (a.scale.data == 7).any()
    sd = a.state_dict()
    b.load_state_dict(sd)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert np.array_equal(pa.data, pb.data), n
    bad = dict(sd, **{"fc1.weight": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match=r"'fc1.weight' \(Linear\) has shape \(2, 3\)"):
        b.load_state_dict(bad)
    bad = dict(sd, **{"scale": np.zeros(3, np.float64)})
    with pytest.raises(ValueError, match="Block.load_state_dict: key 'scale'.*dtype float64"):
        b.load_state_dict(bad)
    partial = {k: v for k, v in sd.items() if k != "scale"}
    with pytest.raises(ValueError, match=r"missing keys \['scale'\]"):
        b.load_state_dict(partial)
    with pytest.raises(ValueError, match="unexpected keys"):
        b.load_state_dict(dict(sd, extra=np.zeros(1)))
    missing, unexpected = b.load_state_dict(dict(partial, extra=np.zeros(1)), strict=False)
    assert missing == ["scale"] and unexpected == ["extra"]
    with pytest.raises(TypeError, match="Block.load_state_dict: expected a mapping.*got list"):
        b.load_state_dict(list(sd.values()))
    with pytest.raises(TypeError, match=r"key 'fc1.bias' \(Linear\) holds a list, not an array"):
        b.load_state_dict(dict(sd, **{"fc1.bias": [0.0, 0.0, 0.0]}))
    before = b.fc1.weight.data.copy()
    with pytest.raises(ValueError, match="'inner.1.weight'"):
        b.load_state_dict(dict(sd, **{"fc1.weight": sd["fc1.weight"] + 1,
                                      "inner.1.weight": np.zeros((3, 3), np.float32)}))
    assert np.array_equal(b.fc1.weight.data, before), "nothing is modified on error"


def test_dropout_determinism_eval_and_mask():
    x = np.ones((64, 32), np.float32)
    d1, d2 = Dropout(0.25, seed=3), Dropout(0.25, seed=3)
    y1, y2 = d1(x), d2(x)
    assert np.array_equal(y1, y2)
    assert set(np.unique(y1)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((y1 == 0).mean() - 0.25) < 0.05
    dx = d1.backward(np.full_like(x, 2.0))
    assert np.array_equal(dx, 2 * y1)
    assert not np.array_equal(d1(x), y1)  # the call counter moves the stream on
    assert not np.array_equal(Dropout(0.25, seed=3, rank=1)(x), y1)
    d1.eval()
    assert d1(x) is x and d1.backward(x) is x
    assert not Dropout(1.0).forward(x).any()
    with pytest.raises(ValueError, match="p must be"):
        Dropout(1.5)


def test_gelu_after_a_fortran_ordered_input():
    """The tanh buffer an F-ordered forward left is not the one a C-ordered forward
    caches through a flat view: backward reads what the forward wrote."""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((6, 5)), rng.standard_normal((6, 5))
    gelu, fresh = GELU(), GELU()
    gelu.forward(np.asfortranarray(x))
    gelu.backward(np.asfortranarray(dy))
    np.testing.assert_array_equal(gelu.forward(x), fresh.forward(x))
    np.testing.assert_array_equal(gelu.backward(dy), fresh.backward(dy))


def test_gelu_blocks_match_closed_form():
    """GELU runs large NumPy arrays in cache-sized blocks; block edges must not show."""
    rng = np.random.default_rng(5)
    # 2**17 + 7 elements: several blocks of any cache-sized length, and a ragged end.
    x = rng.standard_normal((3, (1 << 17) // 3 + 7)) * 3
    dy = rng.standard_normal(x.shape)
    k, c = math.sqrt(2 / math.pi), 0.044715
    tanh = np.tanh(k * (x + c * x * x * x))
    expected_y = 0.5 * x * (1 + tanh)
    expected_dx = dy * (0.5 * (1 + tanh) + 0.5 * x * (1 - tanh * tanh) * k * (1 + 3 * c * x * x))
    gelu = GELU()
    np.testing.assert_allclose(gelu.forward(x), expected_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gelu.backward(dy), expected_dx, rtol=1e-12, atol=1e-12)
