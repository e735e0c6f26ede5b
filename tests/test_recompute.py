"""Recompute: gradients bitwise those of the plain block (dropout on), activations dropped."""

import numpy as np
import pytest

from layer_helpers import rng_array
from mpi_helpers import WORLD, agree, assert_equal, raises_everywhere
from pympar import manager
from pympar.memory import activation_bytes
from pympar.modules import (GELU, ColumnParallelLinear, Dropout, Linear, Module,
                            RowParallelLinear, Sequential)
from pympar.modules.recompute import Recompute

FEATURES, HIDDEN, ROWS = 6, 14, 9


def block(tp_rank, layer):
    """Column -> GELU -> Dropout -> Row, identical weights for the same ``layer``."""
    return Sequential(
        ColumnParallelLinear(FEATURES, HIDDEN, gather_output=False, dtype=np.float64,
                             seed=10 * layer + 1),
        GELU(),
        Dropout(p=0.3, seed=7 + layer, rank=tp_rank),
        RowParallelLinear(HIDDEN, FEATURES, input_is_parallel=True, dtype=np.float64,
                          seed=10 * layer + 2))


def run(model, steps=2):
    """Forward/backward ``steps`` times; return outputs, input grads and the activation bytes."""
    outs, grads, cached = [], [], []
    for step in range(steps):
        x = rng_array(50 + step, (ROWS, FEATURES), np.float64)
        y = model(x)
        cached.append(activation_bytes(model))
        outs.append(y)
        grads.append(model.backward(rng_array(80 + step, y.shape, np.float64)))
    return outs, grads, cached


@pytest.mark.mpi(min_size=1)
def test_recompute_gradients_bitwise_with_dropout_tp2():
    tp = 2 if WORLD.size % 2 == 0 else 1
    manager.initialize_parallel(tensor_parallel_size=tp)
    try:
        r = manager.get_tensor_parallel_rank()
        plain = Sequential(block(r, 0), block(r, 1))
        wrapped = Sequential(Recompute(block(r, 0)), Recompute(block(r, 1)))
        outs, dxs, plain_bytes = run(plain)
        routs, rdxs, kept_bytes = run(wrapped)
    finally:
        manager.destroy_parallel()
    for step in range(2):
        assert_equal(routs[step], outs[step], what=f"output, step {step}")
        assert_equal(rdxs[step], dxs[step], what=f"input gradient, step {step}")
    named = dict(plain.named_parameters())
    wnamed = {k.replace(".module", ""): p for k, p in wrapped.named_parameters()}
    agree(sorted(named) == sorted(wnamed), f"{sorted(named)} vs {sorted(wnamed)}")
    for name, p in named.items():
        assert_equal(wnamed[name].grad, p.grad, what=f"grad of {name}")
    # Recomputed blocks keep their input only: two (ROWS, FEATURES) float64 arrays (they
    # draw nothing from NumPy's global random state, so they keep none of it).
    agree(kept_bytes == [2 * ROWS * FEATURES * 8] * 2, f"kept {kept_bytes}")
    agree(plain_bytes[0] > 2 * kept_bytes[0], f"plain caches {plain_bytes} vs {kept_bytes}")
    # The masks were drawn once per training forward, not twice.
    drops = [m for m in wrapped.modules() if isinstance(m, Dropout)]
    agree([m.calls for m in drops] == [2, 2], f"dropout positions {[m.calls for m in drops]}")


@pytest.mark.mpi(min_size=1)
def test_recompute_serial_matches_and_checks_input():
    lin = Linear(FEATURES, 3, dtype=np.float64, seed=3)
    ref = Linear(FEATURES, 3, dtype=np.float64, seed=3)
    x = rng_array(1, (4, FEATURES), np.float64)
    dy = rng_array(2, (4, 3), np.float64)
    wrapped = Recompute(lin)
    assert_equal(wrapped(x), ref(x), what="output")
    assert_equal(wrapped.backward(dy), ref.backward(dy), what="input gradient")
    assert_equal(lin.weight.grad, ref.weight.grad, what="weight gradient")
    raises_everywhere(RuntimeError, "before forward", wrapped.backward, dy)
    raises_everywhere(TypeError, "expected a Module", Recompute, lambda t: t)


class GlobalNoise(Module):
    """y = x * (1 + 0.1 n), n drawn from NumPy's global random state on every forward."""

    def forward(self, x):
        noise = 1 + 0.1 * np.random.standard_normal(x.shape)
        self.save_for_backward(noise)
        return x * noise

    def backward(self, dy):
        (noise,) = self.saved_tensors()
        return dy * noise


@pytest.mark.mpi(min_size=1)
def test_recompute_replays_numpy_global_random_state():
    x = rng_array(3, (5, FEATURES), np.float64)
    dy = rng_array(4, (5, 3), np.float64)
    results = []
    for wrap in (False, True):
        lin = Linear(FEATURES, 3, dtype=np.float64, seed=5)
        block = Sequential(GlobalNoise(), lin)
        model = Recompute(block) if wrap else block
        np.random.seed(1234)
        y = model(x)
        dx = model.backward(dy)
        after = np.random.standard_normal(3)  # the stream goes on where forward left it
        results.append((y, dx, lin.weight.grad, after))
    for what, plain, replayed in zip(("output", "input gradient", "weight gradient",
                                      "draws after backward"), *results):
        assert_equal(replayed, plain, what=what)
