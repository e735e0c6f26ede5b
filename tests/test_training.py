"""A Column -> GELU -> Row MLP trained with AdamW under TP x DP follows the serial loss curve."""

import numpy as np
import pytest

from layer_helpers import XPS, block, get_xp, rng_array
from mpi_helpers import WORLD, agree, to_numpy
from pympar import manager
from pympar.modules import GELU, ColumnParallelLinear, Linear, MSELoss, RowParallelLinear
from pympar.optim import AdamW, allreduce_gradients

FEATURES, HIDDEN, BATCH, STEPS = 12, 40, 18, 50


def data(step, dtype, xp):
    x = rng_array(100 + step, (BATCH, FEATURES), dtype, xp)
    return x, xp.tanh(x[:, ::-1] * 2.0)


def serial_losses(dtype, xp):
    fc1, act, fc2 = (Linear(FEATURES, HIDDEN, dtype=dtype, seed=1, xp=xp), GELU(),
                     Linear(HIDDEN, FEATURES, dtype=dtype, seed=2, xp=xp))
    params = [*fc1.parameters(), *fc2.parameters()]
    opt, loss_fn, losses = AdamW(params, lr=1e-2), MSELoss(), []
    for step in range(STEPS):
        x, target = data(step, dtype, xp)
        losses.append(loss_fn.forward(fc2(act(fc1(x))), target))
        opt.zero_grad()
        fc1.backward(act.backward(fc2.backward(loss_fn.backward())))
        opt.step()
    return np.array(losses)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 1e-5)], ids=["f64", "f32"])
def test_tp2_dp_mlp_follows_serial_loss_curve(xp_name, dtype, rtol):
    if WORLD.size % 4:
        pytest.skip("TP=2 x DP>=2 needs a multiple of 4 ranks")
    xp = get_xp(xp_name)
    expected = serial_losses(dtype, xp)
    manager.initialize_parallel(tensor_parallel_size=2)
    try:
        dp = manager.get_data_parallel_group()
        rows = block(BATCH, dp.size, dp.rank)
        fc1 = ColumnParallelLinear(FEATURES, HIDDEN, gather_output=False, dtype=dtype, seed=1, xp=xp)
        act = GELU()
        fc2 = RowParallelLinear(HIDDEN, FEATURES, input_is_parallel=True, dtype=dtype, seed=2, xp=xp)
        params = [*fc1.parameters(), *fc2.parameters()]
        opt, losses = AdamW(params, lr=1e-2), []
        count = BATCH * FEATURES
        for step in range(STEPS):
            x, target = data(step, dtype, xp)
            err = fc2(act(fc1(x[rows]))) - target[rows]
            local = np.array([float((err * err).sum())])
            losses.append(float(dp.all_reduce(local)[0]) / count)
            opt.zero_grad()
            fc1.backward(act.backward(fc2.backward(err * (2.0 / count))))
            allreduce_gradients(params, dp, average=False)
            opt.step()
    finally:
        manager.destroy_parallel()
    losses = np.array(losses)
    agree(expected[-1] < 0.5 * expected[0], f"serial loss did not fall: {expected[[0, -1]]}")
    worst = float(np.max(np.abs(losses - expected) / np.abs(expected)))
    agree(worst <= rtol, f"largest relative deviation from the serial curve {worst:.2e} > {rtol}")
    agree(np.isfinite(to_numpy(fc1.weight.data)).all())
