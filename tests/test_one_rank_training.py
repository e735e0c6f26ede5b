"""Gradient all-reduce, ZeRO and the loss scaler: settings that differ on one rank raise on
every rank instead of training the ranks apart."""

import time

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, assert_close, raises_everywhere
from pympar import manager
from pympar.amp import GradScaler
from pympar.debug import CollectiveMismatchError
from pympar.modules import Linear
from pympar.modules.parameter import Parameter
from pympar.optim import SGD, AdamW, allreduce_gradients
from pympar.zero import ZeroRedundancyOptimizer

P, R = WORLD.size, WORLD.rank


@pytest.fixture
def dp_world(clean_state):
    manager.initialize_parallel(1)  # every rank data-parallel
    yield manager.get_data_parallel_group()


def _quickly(pattern, func, *args):
    start = time.monotonic()
    raises_everywhere(CollectiveMismatchError, pattern, func, *args)
    agree(time.monotonic() - start < 10, "the mismatch took more than 10 s to raise")


@pytest.mark.mpi(min_size=1)
def test_allreduce_gradients_average_on_one_rank(dp_world):
    grads = [np.arange(5.0) * (k + 1) for k in range(P)]  # rank k's gradient
    total = np.sum(grads, axis=0)
    for average in (True, False):  # the correct cases against the serial sum
        p = Parameter(np.zeros(5))
        p.grad = grads[R].copy()
        allreduce_gradients([p], dp_world, average=average)
        assert_close(p.grad, total / P if average else total, what=f"average={average}")
    if P > 1:
        p = Parameter(np.zeros(5))
        p.grad = grads[R].copy()
        _quickly(r"allreduce_gradients\[.*(sum|average)", allreduce_gradients, [p], dp_world,
                 4 * 2**20, R != 0)


def _adamw_reference(x, lr, steps=2):
    ref = Linear(6, 4, dtype=np.float64, seed=1)
    opt = AdamW(ref.parameters(), lr=lr)
    for _ in range(steps):
        ref.zero_grad()
        ref.backward(np.ones_like(ref.forward(x)))
        opt.step()
    return ref


@pytest.mark.mpi(min_size=1)
def test_zero_hyperparameters_on_one_rank(dp_world):
    x = np.random.default_rng(3).standard_normal((3, 6))
    model = Linear(6, 4, dtype=np.float64, seed=1)
    opt = ZeroRedundancyOptimizer(model.parameters(), AdamW, lr=0.1)
    for _ in range(2):  # the correct case: every rank has the same gradients
        model.zero_grad()
        model.backward(np.ones_like(model.forward(x)))
        opt.step()
    ref = _adamw_reference(x, 0.1)
    assert_close(model.weight.data, ref.weight.data, what="weight")
    assert_close(model.bias.data, ref.bias.data, what="bias")
    if P > 1:
        model.backward(np.ones_like(model.forward(x)))
        opt.lr = 0.5 if R == 0 else 0.1  # a schedule run on one rank only
        _quickly(r"ZeroRedundancyOptimizer\.step.*lr=0\.(5|1)", opt.step)
        opt.lr = 0.1
        opt.optimizer.eps = 1e-6 if R == P - 1 else 1e-8
        _quickly(r"eps=", opt.step)


@pytest.mark.mpi(min_size=1)
def test_grad_scaler_settings_on_one_rank(dp_world):
    def run(scaler):
        p = Parameter(np.array([1.0, 2.0, 3.0]))
        opt = SGD([p], lr=0.5)
        p.grad = scaler.scale(np.array([0.5, -1.0, 2.0]))
        ran = scaler.step(opt)
        return ran, p

    for enabled in (True, False):  # the correct cases: the unscaled SGD step
        ran, p = run(GradScaler(init_scale=8.0, enabled=enabled))
        agree(ran, f"enabled={enabled}: the step did not run")
        assert_close(p.data, np.array([1.0, 2.0, 3.0]) - 0.5 * np.array([0.5, -1.0, 2.0]),
                     what=f"enabled={enabled}")
    if P > 1:
        scaler = GradScaler(init_scale=8.0, enabled=R != 0)
        _quickly(r"GradScaler\(enabled=(True|False)", run, scaler)
        scaler = GradScaler(init_scale=8.0 if R == 0 else 16.0)
        _quickly(r"different scales \(from 8\.0 to 16\.0\)", run, scaler)
