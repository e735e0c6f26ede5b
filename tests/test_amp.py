"""GradScaler (torch semantics, found-inf agreed on every rank) and float32 master weights."""

import numpy as np
import pytest

from layer_helpers import block, rng_array
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere
from pympar import backend, manager
from pympar.amp import GradScaler, master_weights_optimizer
from pympar.modules import GELU, ColumnParallelLinear, Linear, Parameter, RowParallelLinear
from pympar.optim import AdamW, allreduce_gradients
from pympar.zero import ZeroRedundancyOptimizer

FEATURES, HIDDEN, BATCH = 5, 12, 8


def mlp(dtype, tp_layers=True):
    if tp_layers:
        fc1 = ColumnParallelLinear(FEATURES, HIDDEN, gather_output=False, dtype=dtype, seed=1)
        fc2 = RowParallelLinear(HIDDEN, FEATURES, input_is_parallel=True, dtype=dtype, seed=2)
    else:
        fc1, fc2 = Linear(FEATURES, HIDDEN, dtype=dtype, seed=1), Linear(HIDDEN, FEATURES,
                                                                         dtype=dtype, seed=2)
    return fc1, GELU(), fc2


def backward_step(layers, x, target, count, scale=1.0):
    fc1, act, fc2 = layers
    err = fc2(act(fc1(x))) - target
    fc1.backward(act.backward(fc2.backward(err * (2.0 * scale / count))))
    return float((err.astype(np.float64) ** 2).sum())


def data_rows():
    """The data-parallel group, this rank's rows of the batch and the count to divide its
    summed loss gradient by.

    That count is the global element count over the DP size, whatever rows each rank holds:
    averaging the gradients over DP then gives the global mean's gradient, also where BATCH
    does not split evenly (3 ranks).
    """
    dp = manager.get_data_parallel_group()
    rows = block(BATCH, dp.size, dp.rank)
    return dp, rows, BATCH * FEATURES / dp.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sharded", [True, False], ids=["zero", "allreduce"])
def test_injected_inf_on_one_rank_skips_everywhere_and_halves_scale(sharded):
    """Inf in one TP shard's gradient on the last rank: every rank skips, every scale halves."""
    tp = 2 if WORLD.size % 2 == 0 else 1
    manager.initialize_parallel(tensor_parallel_size=tp)
    try:
        dp, rows, count = data_rows()
        runs = {}
        for scaled in (True, False):
            layers = mlp(np.float64)
            params = [p for layer in layers for p in layer.parameters()]
            opt = (ZeroRedundancyOptimizer(params, AdamW, lr=1e-2) if sharded
                   else AdamW(params, lr=1e-2))
            scaler = GradScaler(init_scale=2.0**10, growth_interval=100)
            ran, scales = [], []
            for step in range(3):
                if not scaled and step == 1:
                    continue  # the reference run never sees the poisoned step
                x = rng_array(step, (BATCH, FEATURES), np.float64)
                opt.zero_grad()
                backward_step(layers, x[rows], np.sin(x[rows]), count,
                              scaler.get_scale() if scaled else 1.0)
                if scaled and step == 1 and WORLD.rank == WORLD.size - 1:
                    params[0].grad[0, 0] = np.inf
                if not sharded:
                    allreduce_gradients(params, dp)
                before = [p.data.copy() for p in params]
                if scaled:
                    ran.append(scaler.step(opt))
                    scaler.update()
                    scales.append(scaler.get_scale())
                else:
                    opt.step()
                if scaled and step == 1:
                    for p, b in zip(params, before):
                        assert_equal(p.data, b, what=f"{p.name} changed by the skipped step")
            runs[scaled] = (params, ran, scales)
    finally:
        manager.destroy_parallel()
    params, ran, scales = runs[True]
    agree(ran == [True, False, True], f"steps ran: {ran}")
    agree(scales == [2.0**10, 2.0**9, 2.0**9], f"scales: {scales}")
    # Scaling by powers of two is exact: the scaled run equals the run without that step.
    for p, q in zip(params, runs[False][0]):
        assert_close(p.data, q.data, rtol=1e-13, atol=1e-15, what=p.name)


@pytest.mark.mpi(min_size=1)
def test_scale_growth_and_backoff_follow_torch_rule():
    p = Parameter(np.zeros(3))
    opt = AdamW([p], lr=0.1)
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    pattern = [False, False, False, False, True, False, False, False, False]
    scale, clean, seen = 8.0, 0, []
    for bad in pattern:
        p.grad = np.array([1.0, np.nan if bad else 2.0, 3.0])
        stepped = scaler.step(opt)
        scaler.update()
        # torch: backoff x0.5 and reset on inf/NaN; x2 after growth_interval clean steps.
        clean = 0 if bad else clean + 1
        scale = scale * 0.5 if bad else (scale * 2.0 if clean == 3 else scale)
        clean = clean % 3
        seen.append((stepped, scaler.get_scale(), scale))
    agree(all(s == (not b) for (s, _, _), b in zip(seen, pattern)), f"steps {seen}")
    agree(all(got == want for _, got, want in seen), f"scales {seen}")
    raises_everywhere(RuntimeError, "call step", scaler.update)
    raises_everywhere(ValueError, "backoff_factor", GradScaler, backoff_factor=2.0)
    # Refused on one rank only: every rank raises, none waits in the constructor.
    raises_everywhere(Exception, "growth_interval must be >= 1", GradScaler,
                      growth_interval=0 if WORLD.rank == WORLD.size - 1 else 10)
    off = GradScaler(enabled=False)
    x = np.ones(2)
    agree(off.scale(x) is x and off.get_scale() == 1.0, "disabled scaler scales")
    state = scaler.state_dict()
    other = GradScaler()
    other.load_state_dict(state)
    agree(other.state_dict() == state, f"{other.state_dict()} != {state}")


@pytest.mark.mpi(min_size=1)
def test_an_overflow_in_any_step_since_the_last_update_backs_off():
    first, second = Parameter(np.zeros(2)), Parameter(np.zeros(2))
    opts = AdamW([first], lr=0.1), AdamW([second], lr=0.1)
    scaler = GradScaler(init_scale=1024.0, growth_interval=1)
    first.grad, second.grad = np.array([np.inf, 1.0]), np.array([1.0, 2.0])
    stepped = [scaler.step(opt) for opt in opts]  # the first overflows, the second does not
    scaler.update()
    # torch backs off to 512 (the scale grew to 2048 when only the last step counted).
    agree(stepped == [False, True] and scaler.get_scale() == 512.0,
          f"steps {stepped}, scale {scaler.get_scale()}")
    agree(np.all(first.data == 0) and np.all(second.data != 0), "the wrong optimizer stepped")
    first.grad = np.array([1.0, 1.0])
    [scaler.step(opt) for opt in opts]
    scaler.update()  # a clean round: the earlier overflow is forgotten after its update
    agree(scaler.get_scale() == 1024.0, f"scale {scaler.get_scale()} after a clean round")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sharded", [True, False], ids=["zero", "masters"])
def test_fp16_recovers_from_overflow(sharded):
    """float16 model: the first scaled gradients overflow; the scaler backs off, then trains
    like a float64 run of the steps it took."""
    tp = 2 if WORLD.size % 2 == 0 else 1
    manager.initialize_parallel(tensor_parallel_size=tp)
    try:
        dp, rows, count = data_rows()
        layers = mlp(np.float16)
        params = [p for layer in layers for p in layer.parameters()]
        opt = (ZeroRedundancyOptimizer(params, AdamW, lr=0.1) if sharded
               else master_weights_optimizer(params, AdamW, lr=0.1))
        scaler = GradScaler(growth_interval=100)
        ran, losses = [], []
        for step in range(12):
            x = rng_array(step % 2, (BATCH, FEATURES), np.float64)
            target = 30.0 * np.sin(x)  # large errors: 2**16 x their gradient overflows float16
            opt.zero_grad()
            with np.errstate(over="ignore", invalid="ignore"):  # the overflow under test
                local = backward_step(layers, x[rows].astype(np.float16),
                                      target[rows].astype(np.float16), count,
                                      scaler.get_scale())
            losses.append(float(dp.all_reduce(np.array([local]))[0]) / (BATCH * FEATURES))
            if not sharded:
                with np.errstate(over="ignore"):  # float32 sums past float16's range
                    allreduce_gradients(params, dp)
            ran.append(scaler.step(opt))
            scaler.update()
        final = scaler.get_scale()
    finally:
        manager.destroy_parallel()
    skipped = ran.index(True)
    agree(skipped >= 1 and final == 2.0**16 * 0.5 ** ran.count(False), f"{ran}, scale {final}")
    agree(ran.count(True) >= 6, f"too few steps taken: {ran}")
    # Reference: float64 serial run from the float16-rounded weights, same steps taken.
    ref = mlp(np.float64, tp_layers=False)
    full = [ref[0].weight, ref[0].bias, ref[2].weight, ref[2].bias]
    for p in full:
        p.data[...] = p.data.astype(np.float16)
    ref_opt, expected = AdamW(full, lr=0.1), []
    for step in range(12):
        x = rng_array(step % 2, (BATCH, FEATURES), np.float64)
        ref_opt.zero_grad()
        expected.append(backward_step(ref, x, 30.0 * np.sin(x), BATCH * FEATURES)
                        / (BATCH * FEATURES))
        if ran[step]:
            ref_opt.step()
    expected = np.array(expected)
    agree(expected[-1] < 0.9 * expected[skipped], f"reference did not train: {expected}")
    assert_close(losses, expected, rtol=2e-3, atol=0, what="float16 loss curve vs float64")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.float32, np.float64])
def test_scale_multiplies_in_float32_and_rounds_once(dtype):
    """torch's rule: x * scale in float32, one rounding to x's dtype. The default 2**16 is
    inf in float16, so a float16 product made every gradient inf and skipped every first step."""
    if dtype == "bfloat16":
        dtype = backend.bfloat16
        if dtype is None:
            pytest.skip("ml_dtypes (bfloat16) is not installed")
    dy = (rng_array(3, (4, 5), np.float64) * 1e-3).astype(dtype)
    scaled = GradScaler().scale(dy)
    work = np.float64 if dtype == np.float64 else np.float32
    expected = (dy.astype(work) * 2.0**16).astype(dtype)
    agree(scaled.dtype == np.dtype(dtype), f"scaled dtype {scaled.dtype}")
    agree(bool(np.isfinite(scaled.astype(np.float64)).all()), "scaled gradient is not finite")
    assert_equal(scaled, expected, what="scaled gradient")
    p = Parameter(np.zeros(3, dtype=np.float32))
    p.grad = GradScaler().scale(np.full(3, 1e-3, dtype=np.float16)).astype(np.float32)
    scaler = GradScaler()
    agree(scaler.step(AdamW([p], lr=0.1)), "the first float16 step was skipped")
