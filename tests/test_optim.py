"""Optimizers against hand-written torch-semantics formulas; bucketed gradient all-reduce."""

from __future__ import annotations

import numpy as np
import pytest

from pympar import backend
from pympar.modules import Linear, Parameter, Sequential
from pympar.optim import SGD, Adam, AdamW, allreduce_gradients

STEPS = 4


def make_params():
    rng = np.random.default_rng(0)
    return [Parameter(rng.standard_normal((3, 4))), Parameter(rng.standard_normal(5))]


def grads_at(step, params):
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(p.shape) for p in params]


def run(optimizer_cls, **kwargs):
    params = make_params()
    opt = optimizer_cls(params, **kwargs)
    for step in range(STEPS):
        for p, g in zip(params, grads_at(step, params)):
            p.grad = g
        opt.step()
    return [p.data for p in params]


def reference(update):
    """Apply ``update(step, p, g, state) -> p`` per parameter with fresh dict state."""
    params = [p.data.copy() for p in make_params()]
    states = [{} for _ in params]
    for step in range(STEPS):
        grads = grads_at(step, make_params())
        params = [update(step + 1, p, g, s) for p, g, s in zip(params, grads, states)]
    return params


def assert_all_close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_sgd_momentum_weight_decay():
    lr, mom, wd = 0.1, 0.9, 0.01

    def update(t, p, g, s):
        g = g + wd * p
        s["buf"] = g if t == 1 else mom * s["buf"] + g
        return p - lr * s["buf"]

    assert_all_close(run(SGD, lr=lr, momentum=mom, weight_decay=wd), reference(update))


def test_sgd_plain():
    assert_all_close(run(SGD, lr=0.05), reference(lambda t, p, g, s: p - 0.05 * g))


def adam_reference(lr, b1, b2, eps, wd, decoupled):
    def update(t, p, g, s):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
        s["v"] = b2 * s.get("v", 0) + (1 - b2) * g * g
        m_hat = s["m"] / (1 - b1**t)
        v_hat = s["v"] / (1 - b2**t)
        return p - lr * m_hat / (np.sqrt(v_hat) + eps)

    return reference(update)


def test_adam_with_l2():
    kw = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    assert_all_close(run(Adam, **kw), adam_reference(0.01, 0.8, 0.99, 1e-6, 0.1, False))


def test_adamw_decoupled():
    got = run(AdamW, lr=0.01)
    assert_all_close(got, adam_reference(0.01, 0.9, 0.999, 1e-8, 0.01, True))
    # Decoupled decay differs from L2 decay.
    assert not np.allclose(got[0], run(Adam, lr=0.01, weight_decay=0.01)[0])


def test_skips_params_without_grad_and_zero_grad():
    model = Linear(3, 2, dtype=np.float64)
    before = model.weight.data.copy()
    opt = Adam(model, lr=0.1)
    opt.step()
    assert np.array_equal(model.weight.data, before)
    model.weight.grad = np.ones_like(before)
    opt.step()
    assert not np.array_equal(model.weight.data, before)
    assert opt.steps == [1, 0]
    opt.zero_grad()
    assert not model.weight.grad.any() and model.bias.grad is None


class FakeGroup:
    """Stands in for a group of ``size`` ranks that all hold the same gradients."""

    def __init__(self, size, honour_out=True):
        self.size = size
        self.honour_out = honour_out
        self.buffers = []

    def all_reduce(self, x, op="sum", out=None):
        assert op == "sum"
        self.buffers.append(x)
        if self.honour_out and out is not None:
            np.multiply(x, self.size, out=out)
            return out
        return x * self.size


def mixed_params():
    """A float64 model plus float32 parameters, with gradients from a real backward."""
    model = Sequential(Linear(3, 8, dtype=np.float64, seed=1), Linear(8, 2, dtype=np.float64, seed=2))
    y = model(np.random.default_rng(0).standard_normal((4, 3)))
    model.backward(np.ones_like(y))
    extra = [Parameter(np.ones((5, 2), np.float32)), Parameter(np.ones(7, np.float32))]
    for i, p in enumerate(extra):
        p.grad = np.arange(p.size, dtype=np.float32).reshape(p.shape) + i
    params = model.parameters()
    # Interleave dtypes: bucketing must group them regardless of order.
    return [params[0], extra[0], params[1], params[2], extra[1], params[3]]


@pytest.mark.parametrize("honour_out", [True, False])
def test_allreduce_gradients_buckets(honour_out):
    params = mixed_params()
    expected = [p.grad.copy() for p in params]
    group = FakeGroup(3, honour_out)
    allreduce_gradients(params, group)
    # One bucket per dtype; averaging the sum of 3 identical copies gives the gradient back.
    assert sorted(b.dtype.name for b in group.buffers) == ["float32", "float64"]
    for p, g in zip(params, expected):
        assert p.grad.dtype == p.dtype
        np.testing.assert_allclose(p.grad, g, rtol=1e-6)
    first = [id(b) for b in group.buffers]
    allreduce_gradients(params, group, average=False)
    assert [id(b) for b in group.buffers[2:]] == first  # buckets are reused
    for p, g in zip(params, expected):
        np.testing.assert_allclose(p.grad, 3 * g, rtol=1e-6)


def test_allreduce_small_buckets_and_missing_grads():
    params = [Parameter(np.full((4, 4), float(i))) for i in range(4)]
    for p in params[:3]:
        p.grad = p.data.copy()
    group = FakeGroup(2)
    allreduce_gradients(params, group, bucket_bytes=200, average=False)
    # 128-byte gradients with a 200-byte cap: one parameter per bucket.
    assert len(group.buffers) == 4
    for i, p in enumerate(params[:3]):
        np.testing.assert_array_equal(p.grad, 2 * p.data)
    assert params[3].grad is not None and not params[3].grad.any()


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_allreduce_averages_half_precision_before_rounding(dtype):
    """Half-precision gradients whose sum over the group passes the dtype's range (float16:
    65504) but whose mean fits: the mean, not inf; the gradient keeps its dtype."""
    dtype = np.dtype(backend.bfloat16 if dtype == "bfloat16" else dtype)
    if dtype == np.float16:
        values = [30000.0, 1.0, -30000.0]
    else:  # bfloat16 reaches 3.4e38, as float32 does: what matters is the one rounding
        values = [1.0 + 2.0**-8, 3.0, -5.0]
    p = Parameter(np.zeros(3, dtype))
    p.grad = np.array(values, dtype)
    group = FakeGroup(4)
    allreduce_gradients([p], group)
    assert group.buffers[0].dtype == np.float32 and p.grad.dtype == dtype
    np.testing.assert_array_equal(p.grad.astype(np.float64),
                                  np.array(values, dtype).astype(np.float64))


def test_allreduce_trivial_groups():
    p = Parameter(np.ones(3))
    p.grad = np.ones(3)
    allreduce_gradients([p], None)
    group = FakeGroup(1)
    allreduce_gradients([p], group)
    assert group.buffers == [] and np.array_equal(p.grad, np.ones(3))


# -- state_dict / load_state_dict, frozen parameters -------------------------------------


def train_steps(opt, params, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, grads_at(step, params)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("cls, kwargs", [(SGD, {"lr": 0.1, "momentum": 0.9}),
                                         (SGD, {"lr": 0.1}),
                                         (Adam, {"lr": 0.01, "weight_decay": 0.1}),
                                         (AdamW, {"lr": 0.01, "betas": (0.8, 0.9)})])
def test_state_dict_resume_is_bitwise(cls, kwargs):
    params = make_params()
    opt = cls(params, **kwargs)
    train_steps(opt, params, 4)
    straight = [p.data.copy() for p in params]

    params = make_params()
    opt = cls(params, **kwargs)
    train_steps(opt, params, 2)
    saved = {k: v for k, v in opt.state_dict().items()}
    saved["state"] = {i: {k: (v.copy() if hasattr(v, "copy") else v) for k, v in e.items()}
                      for i, e in saved["state"].items()}
    data = [p.data.copy() for p in params]
    fresh = [Parameter(d) for d in data]
    opt2 = cls(fresh, lr=123.0, **{k: v for k, v in kwargs.items() if k != "lr"})
    opt2.load_state_dict(saved)
    assert opt2.lr == kwargs["lr"] and opt2.steps == [2, 2]
    train_steps(opt2, fresh, 2, first=2)
    for a, b in zip(fresh, straight):
        assert a.data.tobytes() == b.tobytes()


def test_state_dict_shapes_and_keys():
    params = make_params()
    opt = Adam(params)
    sd = opt.state_dict()
    assert sd["type"] == "Adam" and set(sd["hyperparameters"]) == {"lr", "betas", "eps",
                                                                   "weight_decay"}
    assert sd["state"][0]["exp_avg"].shape == (3, 4) and sd["state"][1]["step"] == 0


def test_load_state_dict_refuses_bad_input_and_changes_nothing():
    params = make_params()
    opt = Adam(params, lr=0.5)
    train_steps(opt, params, 1)
    before = [m.copy() for m in opt.exp_avg]
    with pytest.raises(TypeError, match="expected the dict returned by state_dict\\(\\), got list"):
        opt.load_state_dict([1, 2])
    sd = opt.state_dict()
    bad = dict(sd, state={0: dict(sd["state"][0]), 1: dict(sd["state"][1], exp_avg=np.zeros(4))})
    bad["hyperparameters"] = dict(sd["hyperparameters"], lr=0.0)
    with pytest.raises(ValueError, match=r"state\[1\] .*\['exp_avg'\] has shape \(4,\)"):
        opt.load_state_dict(bad)
    bad = dict(sd, state={0: dict(sd["state"][0], exp_avg=[0.0] * 12), 1: sd["state"][1]})
    with pytest.raises(TypeError, match=r"state\[0\] .*\['exp_avg'\] must be an array, got list"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="state of a 'SGD' optimizer"):
        opt.load_state_dict(dict(sd, type="SGD"))
    with pytest.raises(ValueError, match="betas must be two numbers"):
        opt.load_state_dict(dict(sd, hyperparameters=dict(sd["hyperparameters"], betas=[1.5, 0])))
    with pytest.raises(ValueError, match="one per parameter position"):
        opt.load_state_dict(dict(sd, state={0: sd["state"][0]}))
    assert opt.lr == 0.5 and opt.steps == [1, 1]
    assert all(np.array_equal(a, b) for a, b in zip(opt.exp_avg, before))


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_frozen_parameters_are_skipped(cls):
    params = make_params()
    params[0].requires_grad = False
    frozen = params[0].data.copy()
    opt = cls(params, lr=0.1, weight_decay=0.1)
    params[0].grad = np.ones_like(frozen)
    train_steps(opt, params[1:], 1)
    params[0].grad = np.ones_like(frozen)
    opt.step()
    assert np.array_equal(params[0].data, frozen) and opt.steps[0] == 0


@pytest.mark.mpi(min_size=2)
def test_allreduce_gradients_skips_frozen():
    from mpi4py import MPI

    from pympar import manager

    state = manager.initialize_parallel(1, 1)
    try:
        params = make_params()
        params[0].requires_grad = False
        rank = MPI.COMM_WORLD.rank
        params[0].grad = np.full(params[0].shape, float(rank))
        params[1].grad = np.full(params[1].shape, float(rank))
        allreduce_gradients(params, state.data)
        n = state.data.size
        ok = (np.all(params[0].grad == rank)
              and np.allclose(params[1].grad, (n - 1) / 2.0))
        from mpi_helpers import agree
        agree(ok, f"grads {params[0].grad.ravel()[:1]} {params[1].grad.ravel()[:1]}")
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=2)
def test_allreduce_gradients_in_another_order_raises():
    import time

    from mpi4py import MPI

    from mpi_helpers import agree, assert_close, raises_everywhere
    from pympar.debug import CollectiveMismatchError
    from pympar.group import Group

    world = Group(MPI.COMM_WORLD, "world", range(MPI.COMM_WORLD.size), owns_comm=False)
    rank, size = world.rank, world.size

    def params(r, shapes):  # rank r's gradients, from a seed of its own
        rng = np.random.default_rng(r)
        out = [Parameter(np.zeros(s), name=n) for n, s in zip("ab", shapes)]
        for p in out:
            p.grad = rng.standard_normal(p.shape)
        return out

    for shapes in [(3,), (5,)], [(4,), (4,)]:  # same total size; then the same shapes too
        a, b = params(rank, shapes)
        allreduce_gradients([a, b], world)  # the correct case: the mean over ranks
        everyone = [params(r, shapes) for r in range(size)]
        assert_close(a.grad, np.mean([p[0].grad for p in everyone], 0), what=f"{shapes} a")
        assert_close(b.grad, np.mean([p[1].grad for p in everyone], 0), what=f"{shapes} b")
        a, b = params(rank, shapes)
        start = time.monotonic()
        raises_everywhere(CollectiveMismatchError, r"allreduce_gradients\[2 params, layout",
                          allreduce_gradients, [b, a] if rank == 0 else [a, b], world)
        agree(time.monotonic() - start < 10, "the mismatch took more than 10 s to raise")
