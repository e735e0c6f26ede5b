"""ZeroRedundancyOptimizer: follows the unsharded optimizer, holds 1/d of its state, reloads."""

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import XPS, block, get_xp, rng_array, self_group
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere, to_numpy
from pympar import backend, manager
from pympar.group import Group
from pympar.memory import optimizer_bytes, workspace_bytes
from pympar.modules import (GELU, ColumnParallelLinear, Linear, Parameter, RowParallelLinear,
                            Sequential)
from pympar.optim import AdamW, allreduce_gradients
from pympar.partition import Split
from pympar.zero import ZeroRedundancyOptimizer, share_rows

# HIDDEN / TP and FEATURES split unevenly over DP; FEATURES < 8 leaves some ranks an empty share.
FEATURES, HIDDEN, BATCH, STEPS = 5, 42, 16, 50


def data(step, xp=np):
    x = rng_array(100 + step, (BATCH, FEATURES), np.float64, xp)
    return x, xp.tanh(x[:, ::-1] * 2.0)


class MLP:
    """Column -> GELU -> Row (or, ``serial``, Linear -> GELU -> Linear: the same names)."""

    def __init__(self, dtype=np.float64, xp=np, serial=False, seeds=(1, 2)):
        if serial:
            fc1 = Linear(FEATURES, HIDDEN, dtype=dtype, seed=seeds[0], xp=xp)
            fc2 = Linear(HIDDEN, FEATURES, dtype=dtype, seed=seeds[1], xp=xp)
        else:
            fc1 = ColumnParallelLinear(FEATURES, HIDDEN, gather_output=False, dtype=dtype,
                                       seed=seeds[0], xp=xp)
            fc2 = RowParallelLinear(HIDDEN, FEATURES, input_is_parallel=True, dtype=dtype,
                                    seed=seeds[1], xp=xp)
        self.net = Sequential(fc1, GELU(), fc2)
        self.params = self.net.parameters()

    def step(self, x, target, count):
        """Forward and backward of the summed squared error / count; returns the local sum."""
        err = self.net(x) - target
        self.net.backward(err * (2.0 / count))
        return float((err * err).sum())


def serial_losses(xp, steps=STEPS):
    """The same training, serial: Linear -> GELU -> Linear with the full batch and AdamW."""
    return train(False, self_group(), steps, model=MLP(xp=xp, serial=True), xp=xp)[2]


def layout(tp):
    if WORLD.size % tp:
        pytest.skip(f"TP={tp} needs a multiple of {tp} ranks")
    manager.initialize_parallel(tensor_parallel_size=tp)
    return manager.get_data_parallel_group()


def train(sharded, dp, steps=STEPS, model=None, opt=None, xp=np, start=0):
    """``steps`` steps on batches ``start, start + 1, ...``; the losses are full-batch sums."""
    model = model or MLP(xp=xp)
    if opt is None:
        opt = (ZeroRedundancyOptimizer(model.params, AdamW, lr=1e-2, bucket_bytes=1024) if sharded
               else AdamW(model.params, lr=1e-2))
    rows = block(BATCH, dp.size, dp.rank)
    losses = []
    for step in range(start, start + steps):
        x, target = data(step, xp)
        opt.zero_grad()
        # Each rank's sum over the full batch's count / dp.size: averaging the gradients
        # over DP then gives the full-batch mean's, for uneven splits (5 ranks) too.
        local = model.step(x[rows], target[rows], BATCH * FEATURES / dp.size)
        losses.append(float(dp.all_reduce(np.array([local]))[0]))
        if not sharded:
            allreduce_gradients(model.params, dp)
        opt.step()
    return model, opt, np.array(losses)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2xdp"])
def test_zero_follows_unsharded_adamw(tp, xp_name):
    xp = get_xp(xp_name)
    dp = layout(tp)
    try:
        plain, _, expected = train(False, dp, xp=xp)
        zero_model, opt, losses = train(True, dp, xp=xp)
        # Small buckets: the MLP's four parameters travel in more than one bucket.
        agree(len(opt._buckets) > 1, f"one bucket only: {len(opt._buckets)}")
    finally:
        manager.destroy_parallel()
    agree(expected[-1] < 0.5 * expected[0], f"loss did not fall: {expected[[0, -1]]}")
    assert_close(losses, expected, rtol=1e-12, atol=0, what="loss curve")
    assert_close(losses, serial_losses(xp), rtol=1e-10, atol=0, what="loss curve vs serial")
    for p, q in zip(zero_model.params, plain.params):
        assert_close(p.data, q.data, rtol=1e-12, atol=1e-14, what=f"{p.name} after {STEPS} steps")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2xdp"])
def test_zero_state_bytes_follow_formula(tp):
    dp = layout(tp)
    try:
        model = MLP(np.float32)
        opt = ZeroRedundancyOptimizer(model.params, AdamW, lr=1e-3, bucket_bytes=2048)
        d, r = dp.size, dp.rank
        rows = share_rows([p.shape for p in model.params], d)
        exact = sum(8 * n[r] * (p.size // p.shape[0]) for n, p in zip(rows, model.params))
        formula = 8 * sum(p.size for p in model.params) / d
        # Shares balanced over the whole state: every rank within one (widest) row of 1/d.
        overhead = 8 * max(p.size // p.shape[0] for p in model.params)
        got = optimizer_bytes(opt)
        agree(got == exact, f"optimizer bytes {got} != 8 x share = {exact}")
        agree(abs(got - formula) <= overhead,
              f"optimizer bytes {got} vs 8/d formula {formula:.1f}: off by more than {overhead}")
        unsharded = optimizer_bytes(AdamW(model.params))
        agree(unsharded == 8 * sum(p.size for p in model.params), f"AdamW holds {unsharded}")
        # Workspace: the bucket buffers (bounded by bucket_bytes) and one share of scratch.
        agree(workspace_bytes(opt) <= 4 * 2048 + 4 * max(p.size for p in model.params),
              f"workspace {workspace_bytes(opt)}")
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_zero_mixed_precision_update_matches_fp32_masters():
    """bfloat16 parameters: the update runs on float32 masters with grads reduced in float32."""
    if backend.bfloat16 is None:
        pytest.skip("ml_dtypes (bfloat16) is not installed")
    bf16, d, r = backend.bfloat16, WORLD.size, WORLD.rank
    shapes = [(7, 3), (5,), (2, 2, 3)]
    init = [rng_array(i, s, np.float32) for i, s in enumerate(shapes)]
    params = [Parameter(a.astype(bf16)) for a in init]
    world = Group(MPI.COMM_WORLD, "world", range(d), owns_comm=False)
    opt = ZeroRedundancyOptimizer(params, AdamW, group=world, lr=1e-2)
    masters = [Parameter(a.astype(bf16).astype(np.float32)) for a in init]
    ref = AdamW(masters, lr=1e-2)
    for step in range(3):
        for i, (p, m) in enumerate(zip(params, masters)):
            grads = [rng_array(1000 * step + 10 * i + k, p.shape, np.float32).astype(bf16)
                     for k in range(d)]
            p.grad = grads[r].copy()
            m.grad = sum(g.astype(np.float32) for g in grads) / np.float32(d)
        opt.step(grad_scale=1.0)
        ref.step()
    sizes = share_rows(shapes, d)
    for i, (p, m, share) in enumerate(zip(params, masters, opt.shares)):
        rows = slice(sum(sizes[i][:r]), sum(sizes[i][:r + 1]))
        assert_close(share.data, m.data[rows], rtol=1e-6, atol=1e-7, what=f"master {i}")
        agree(share.data.dtype == np.float32, f"master dtype {share.data.dtype}")
        agree(share.placement == p.placement.then(Split(0, d, r, sizes=sizes[i])),
              "share placement")
        # Parameters are the masters rounded once; float32 sums in another order may round
        # to the neighbouring bfloat16, never further.
        diff = np.abs(to_numpy(p.data).astype(np.float32) - m.data.astype(bf16).astype(np.float32))
        agree(np.all(diff <= 2.0**-7 * np.abs(m.data) + 1e-30), f"param {i} off by {diff.max()}")
    assert_equal(optimizer_bytes(opt), sum(12 * n[r] * (p.size // p.shape[0])
                                           for n, p in zip(sizes, params)),
                 what="Adam moments + masters: 12 bytes per share element")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2xdp"])
def test_zero_state_dict_is_the_unsharded_state_and_reloads(tp):
    dp = layout(tp)
    try:
        plain, plain_opt, _ = train(False, dp, steps=4)
        model, opt, _ = train(True, dp, steps=4)
        state, reference = opt.state_dict(), plain_opt.state_dict()
        agree(state["type"] == "AdamW" and state["hyperparameters"] == reference["hyperparameters"]
              and [e["step"] for e in state["state"].values()] == plain_opt.steps,
              f"{state['type']}, {state['hyperparameters']}")
        for i, entry in state["state"].items():
            agree(set(entry) == {"step", "exp_avg", "exp_avg_sq"}, f"keys {set(entry)}")
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(entry[key], reference["state"][i][key], rtol=1e-12, atol=1e-15,
                             what=f"{key}[{i}]")
        # Interchangeable with the plain optimizer's state, both ways.
        AdamW([Parameter(p.data.copy()) for p in model.params]).load_state_dict(state)
        # A fresh optimizer with other buckets loads it and continues like the original, to
        # rounding: other bucket sizes may make MPI pick another reduce-scatter algorithm, with
        # another summation order (Open MPI does; MPICH gives the same bits here).
        saved = [p.data.copy() for p in model.params]
        _, _, continued = train(True, dp, steps=3, model=model, opt=opt, start=4)
        after = [p.data.copy() for p in model.params]
        for p, s in zip(model.params, saved):
            p.data[...] = s
        fresh = ZeroRedundancyOptimizer(model.params, AdamW, lr=5.0, bucket_bytes=10**6)
        fresh.load_state_dict(state)
        agree(fresh.lr == 1e-2, f"lr {fresh.lr}")
        _, _, reloaded = train(True, dp, steps=3, model=model, opt=fresh, start=4)
        assert_close(reloaded, continued, rtol=1e-12, atol=1e-15, what="losses after reload")
        for p, a in zip(model.params, after):
            assert_close(p.data, a, rtol=1e-12, atol=1e-15, what=f"{p.name} after reload")
        # The plain optimizer's state loads the same way.
        for p, s in zip(model.params, saved):
            p.data[...] = s
        from_plain = ZeroRedundancyOptimizer(model.params, AdamW, lr=5.0)
        from_plain.load_state_dict(reference)
        _, _, reloaded = train(True, dp, steps=3, model=model, opt=from_plain, start=4)
        assert_close(reloaded, continued, rtol=1e-12, atol=0, what="losses after plain reload")
        bad = dict(state, state={0: state["state"][0]})
        raises_everywhere(ValueError, "one per parameter position 0..3", fresh.load_state_dict,
                          bad)
        bad = dict(state, state={**state["state"], 1: dict(state["state"][1], exp_avg=np.zeros(3))})
        raises_everywhere(ValueError, "'exp_avg'.*shape \\(3,\\), expected the parameter's",
                          fresh.load_state_dict, bad)
        raises_everywhere(ValueError, "state of a 'SGD' optimizer", fresh.load_state_dict,
                          dict(state, type="SGD"))
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_zero_skips_frozen_and_rejects_bad_input():
    group = self_group()
    frozen = Parameter(np.ones((3, 2)), requires_grad=False)
    live = Parameter(np.ones((4,)))
    opt = ZeroRedundancyOptimizer([frozen, live], AdamW, group=group, lr=0.1)
    live.grad, frozen.grad = np.ones(4), np.ones((3, 2))
    opt.step()
    agree(opt.params == [live] and np.all(frozen.data == 1) and np.all(live.data < 1),
          "frozen parameter stepped or live one not")
    raises_everywhere(ValueError, "0-d", ZeroRedundancyOptimizer, [Parameter(np.ones(()))],
                      group=group)
    raises_everywhere(ValueError, "bucket_bytes", ZeroRedundancyOptimizer, [live], group=group,
                      bucket_bytes=0)
    raises_everywhere(RuntimeError, "initialize_parallel", ZeroRedundancyOptimizer, [live])


@pytest.mark.mpi(min_size=2)
def test_a_refusal_on_one_rank_raises_on_every_rank(clean_state):
    """A 0-d parameter or a bad bucket_bytes on one rank only: every rank raises, naming
    it, none waits in the exchange of shapes."""
    dp = layout(1)
    last = dp.rank == dp.size - 1
    live = Parameter(np.ones((4,)))
    raises_everywhere(ValueError, "is 0-d", ZeroRedundancyOptimizer,
                      [Parameter(np.ones(() if last else (1,)))], group=dp)
    raises_everywhere(ValueError, "bucket_bytes must be >= 1", ZeroRedundancyOptimizer,
                      [live], group=dp, bucket_bytes=0 if last else 1024)


@pytest.mark.mpi(min_size=1)
def test_zero_skips_a_parameter_frozen_after_construction_as_adamw_does(clean_state):
    dp = layout(1)
    runs = {}
    for sharded in (False, True):
        model = MLP()
        first = model.params[0]
        opt = (ZeroRedundancyOptimizer(model.params, AdamW, lr=1e-2, bucket_bytes=1024)
               if sharded else AdamW(model.params, lr=1e-2))
        train(sharded, dp, steps=2, model=model, opt=opt)
        first.requires_grad = False  # frozen after the optimizer was built
        frozen_at = to_numpy(first.data).copy()
        train(sharded, dp, steps=3, model=model, opt=opt, start=2)
        runs[sharded] = (frozen_at, [to_numpy(p.data) for p in model.params])
    (plain_frozen, plain), (zero_frozen, zero) = runs[False], runs[True]
    assert_equal(zero[0], zero_frozen, what="ZeRO moved the frozen parameter")
    assert_equal(plain[0], plain_frozen, what="AdamW moved the frozen parameter")
    for k in range(1, len(plain)):
        assert_close(zero[k], plain[k], rtol=1e-12, atol=1e-13, what=f"parameter {k}")


@pytest.mark.mpi(min_size=2)
def test_zero_frozen_on_one_rank_only_raises_everywhere(clean_state):
    dp = layout(1)
    model = MLP()
    opt = ZeroRedundancyOptimizer(model.params, AdamW, lr=1e-2, bucket_bytes=1024)
    model.params[0].requires_grad = WORLD.rank != 0
    raises_everywhere(Exception, "frozen", train, True, dp, steps=1, model=model, opt=opt)


@pytest.mark.mpi(min_size=2)
def test_default_group_is_data_x_context_when_context_parallel():
    if WORLD.size % 2:
        pytest.skip("CP=2 needs an even number of ranks")
    manager.initialize_parallel(context_parallel_size=2)
    try:
        opt = ZeroRedundancyOptimizer([Parameter(np.ones(5))], AdamW)
        agree(opt.group is manager.get_data_context_parallel_group(), f"group {opt.group}")
    finally:
        manager.destroy_parallel()
    manager.initialize_parallel()
    try:
        opt = ZeroRedundancyOptimizer([Parameter(np.ones(5))], AdamW)
        agree(opt.group is manager.get_data_parallel_group(), f"group {opt.group}")
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=2)
def test_zero_ranks_with_different_parameters_raise_everywhere():
    world = Group(MPI.COMM_WORLD, "world", range(WORLD.size), owns_comm=False)
    params = [Parameter(np.ones(4 + (WORLD.rank == WORLD.size - 1)))]
    raises_everywhere(ValueError, "different parameters", ZeroRedundancyOptimizer, params,
                      group=world)


@pytest.mark.mpi(min_size=2)
def test_zero_parameters_in_another_order_raise_everywhere():
    # Equal shapes pass the constructor's shape check; the names then tell the buckets apart.
    import time

    from pympar.debug import CollectiveMismatchError
    from pympar.optim import SGD

    world = Group(MPI.COMM_WORLD, "world", range(WORLD.size), owns_comm=False)

    def params(r):  # rank r's parameters and gradients (the data is the same on every rank)
        rng = np.random.default_rng(r)
        out = [Parameter(rng_array(7, (5, 2), np.float64), name=n) for n in "ab"]
        for p in out:
            p.grad = rng.standard_normal(p.shape)
        return out

    everyone = [params(r) for r in range(WORLD.size)]
    a, b = params(WORLD.rank)
    ZeroRedundancyOptimizer([a, b], SGD, group=world, lr=0.5).step()  # the correct case
    for i, p in enumerate((a, b)):
        expected = everyone[0][i].data - 0.5 * np.mean([q[i].grad for q in everyone], 0)
        assert_close(p.data, expected, what=f"parameter {i}")
    a, b = params(WORLD.rank)
    opt = ZeroRedundancyOptimizer([b, a] if WORLD.rank == 0 else [a, b], SGD, group=world, lr=0.5)
    start = time.monotonic()
    raises_everywhere(CollectiveMismatchError, r"ZeroRedundancyOptimizer\[2 params", opt.step)
    agree(time.monotonic() - start < 10, "the mismatch took more than 10 s to raise")
