"""Stencil layers on a decomposed field against the serial stencil on the whole field.

The serial references pad the whole field with ``numpy.pad`` (``wrap`` or zeros) and apply
the stencil there; their gradients are written out by hand and checked against finite
differences. The distributed layers must equal them on every rank's block: forward, the
input gradient and every parameter gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

from layer_helpers import XPS, get_xp, numeric_grad
from mpi_helpers import WORLD, agree, assert_close, raises_everywhere, to_numpy
from pympar import Mesh
from pympar.debug import CollectiveMismatchError
from pympar.errors import PeerEndedError
from pympar.decomposition import Decomposition
from pympar.halo import HaloExchange
from pympar.modules import HaloConv, Laplacian

P = WORLD.Get_size()
PX = 2 if P % 2 == 0 else 1
PERIODIC = [pytest.param((False, False), id="walls"), pytest.param((True, True), id="torus"),
            pytest.param((False, True), id="channel")]


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(None, {"x": PX, "y": P // PX}, order="x-y")
    groups = {"x": m.group("x"), "y": m.group("y"), "xy": m.group("x", "y")}
    yield groups
    for g in groups.values():
        g.free()


def layout(mesh, name):
    return {"axis0": {0: mesh["xy"]}, "axis1": {1: mesh["xy"]},
            "grid": {0: mesh["x"], 1: mesh["y"]}}[name]


# ------------------------------------------------------------------ serial references


def pad(x, widths, periodic):
    """``x`` padded along its trailing axes (wrap where periodic, zeros elsewhere)."""
    lead = x.ndim - len(widths)
    for a, (w, p) in enumerate(zip(widths, periodic)):
        spec = [(0, 0)] * x.ndim
        spec[lead + a] = (w, w)
        x = np.pad(x, spec, mode="wrap" if p else "constant")
    return x


def fold(g, widths, periodic):
    """The adjoint of :func:`pad`: each padded cell's value added to the cell it copies."""
    lead = g.ndim - len(widths)
    for a, (w, p) in enumerate(zip(widths, periodic)):
        ax = lead + a
        n = g.shape[ax] - 2 * w
        inner = np.take(g, np.arange(w, w + n), axis=ax).copy()
        if p:
            for cells, to in ((np.arange(w), np.arange(n - w, n)),
                              (np.arange(w + n, 2 * w + n), np.arange(w))):
                index = [slice(None)] * g.ndim
                index[ax] = to
                inner[tuple(index)] += np.take(g, cells, axis=ax)
        g = inner
    return g


def laplacian(u, periodic, spacing):
    """Serial central differences on the padded whole field."""
    nd = len(spacing)
    up = pad(u, [1] * nd, periodic)
    y = -2 * sum(1 / h ** 2 for h in spacing) * u
    for a, h in enumerate(spacing):
        for step in (-1, 1):
            index = [slice(1, -1)] * nd
            index[a] = slice(1 + step, up.shape[up.ndim - nd + a] - 1 + step)
            y = y + up[(Ellipsis, *index)] / h ** 2
    return y


def conv(x, w, b, periodic):
    """Serial "same" cross-correlation ``y[b, o, i] = bias[o] + sum w[o, c, k] x[b, c, i+k-r]``."""
    k = w.shape[2:]
    xp_ = pad(x, [s // 2 for s in k], periodic)
    shape = x.shape[2:]
    y = np.zeros((x.shape[0], w.shape[0], *shape)) + (0 if b is None else
                                                     b.reshape(1, -1, *[1] * len(shape)))
    for index in np.ndindex(*k):
        window = xp_[(Ellipsis, *(slice(i, i + n) for i, n in zip(index, shape)))]
        y += np.einsum("oc,bc...->bo...", w[(slice(None), slice(None), *index)], window)
    return y


def conv_grads(x, w, dy, periodic):
    """Hand-written gradients of :func:`conv`: dx, dw, db."""
    k = w.shape[2:]
    widths = [s // 2 for s in k]
    xp_ = pad(x, widths, periodic)
    shape = x.shape[2:]
    dw = np.zeros_like(w)
    dxp = np.zeros_like(xp_)
    for index in np.ndindex(*k):
        where = (Ellipsis, *(slice(i, i + n) for i, n in zip(index, shape)))
        dw[(slice(None), slice(None), *index)] = np.einsum(
            "bon,bcn->oc", dy.reshape(*dy.shape[:2], -1),
            xp_[where].reshape(*xp_.shape[:2], -1))
        dxp[where] += np.einsum("oc,bo...->bc...", w[(slice(None), slice(None), *index)], dy)
    return fold(dxp, widths, periodic), dw, dy.sum(axis=tuple(i for i in range(dy.ndim) if i != 1))


@pytest.mark.parametrize("periodic", PERIODIC)
def test_serial_references_match_finite_differences(periodic):
    """The hand-written serial gradients are right (checked here, so the layer tests can
    trust them on larger fields)."""
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((3, 2, 3, 3)), \
        rng.standard_normal(3)
    dy = rng.standard_normal((2, 3, 5, 4))
    dx, dw, db = conv_grads(x, w, dy, periodic)
    loss = lambda: float(np.vdot(conv(x, w, b, periodic), dy))  # noqa: E731
    np.testing.assert_allclose(dx, numeric_grad(loss, x), atol=1e-7)
    np.testing.assert_allclose(dw, numeric_grad(loss, w), atol=1e-7)
    np.testing.assert_allclose(db, numeric_grad(loss, b), atol=1e-7)
    u, g = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    lap = lambda: float(np.vdot(laplacian(u, periodic, (1.0, 0.5)), g))  # noqa: E731
    np.testing.assert_allclose(laplacian(g, periodic, (1.0, 0.5)), numeric_grad(lap, u),
                               atol=1e-7)  # the Laplacian is symmetric


# ------------------------------------------------------------------ the layers


@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("name", ["axis0", "axis1", "grid"])
def test_laplacian_equals_the_serial_stencil(mesh, name, periodic, xp_name):
    xp = get_xp(xp_name)
    shape, spacing = (19, 17), (0.5, 2.0)
    d = Decomposition(shape, layout(mesh, name), periodic)
    layer = Laplacian(HaloExchange(d, 1), spacing)
    rng = np.random.default_rng(1)
    u, dy = rng.standard_normal((2, *shape)), rng.standard_normal((2, *shape))
    y = layer.forward(xp.asarray(d.take(u)))
    assert_close(y, d.take(laplacian(u, periodic, spacing)), what="forward")
    dx = layer.backward(xp.asarray(d.take(dy)))
    assert_close(dx, d.take(laplacian(dy, periodic, spacing)), what="backward")


@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("name", ["axis0", "axis1", "grid"])
@pytest.mark.parametrize("kernel, shape", [(3, (16, 12)), ((5, 3), (19, 17))])
def test_conv_equals_the_serial_convolution(mesh, name, periodic, kernel, shape, xp_name):
    xp = get_xp(xp_name)
    d = Decomposition(shape, layout(mesh, name), periodic)
    k = (kernel, kernel) if isinstance(kernel, int) else kernel
    halo = HaloExchange(d, [s // 2 for s in k])
    layer = HaloConv(halo, 2, 3, kernel, dtype=np.float64, seed=4, xp=xp)
    w, b = to_numpy(layer.weight.data), to_numpy(layer.bias.data)
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal((2, 2, *shape)), rng.standard_normal((2, 3, *shape))
    y = layer.forward(xp.asarray(d.take(x)))
    assert_close(y, d.take(conv(x, w, b, periodic)), rtol=1e-10, atol=1e-10, what="forward")
    dx = layer.backward(xp.asarray(d.take(dy)))
    want_dx, want_dw, want_db = conv_grads(x, w, dy, periodic)
    assert_close(dx, d.take(want_dx), rtol=1e-10, atol=1e-10, what="dx")
    assert_close(layer.weight.grad, want_dw, rtol=1e-10, atol=1e-10, what="dweight")
    assert_close(layer.bias.grad, want_db, rtol=1e-10, atol=1e-10, what="dbias")


def test_conv_gradients_match_finite_differences_of_the_distributed_layer(mesh):
    """The distributed loss sum_ranks <y, dy> differentiated numerically, on every rank."""
    shape, periodic = (6, 5), (True, False)
    d = Decomposition(shape, layout(mesh, "grid"), periodic)
    layer = HaloConv(HaloExchange(d, 1), 1, 2, 3, dtype=np.float64, seed=1)
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((1, 1, *shape)), rng.standard_normal((1, 2, *shape))
    mine_x, mine_dy = d.take(x), d.take(dy)
    loss = lambda: WORLD.allreduce(float(np.vdot(layer.forward(mine_x), mine_dy)))  # noqa: E731
    layer.forward(mine_x)
    dx = layer.backward(mine_dy)
    numeric_w = numeric_grad(loss, layer.weight.data)
    numeric_b = numeric_grad(loss, layer.bias.data)
    assert_close(layer.weight.grad, numeric_w, rtol=1e-6, atol=1e-7, what="dweight")
    assert_close(layer.bias.grad, numeric_b, rtol=1e-6, atol=1e-7, what="dbias")
    # The input gradient of the whole field: perturb one global cell at a time.
    numeric_x = numeric_grad(lambda: WORLD.allreduce(float(np.vdot(
        layer.forward(d.take(x)), mine_dy))), x)
    assert_close(dx, d.take(numeric_x), rtol=1e-6, atol=1e-7, what="dx")


def test_two_forwards_in_flight_keep_their_own_padded_input(mesh):
    """A pipeline runs forwards of two micro-batches before their backwards, taking each
    forward's caches out of the layer (pympar.pipeline.caches): the second forward must not
    overwrite the padded input the first one cached."""
    from pympar.pipeline.caches import put_caches, take_caches

    shape, periodic = (8, 6), (True, False)
    d = Decomposition(shape, layout(mesh, "grid"), periodic)
    layer = HaloConv(HaloExchange(d, 1), 2, 3, 3, dtype=np.float64, seed=5)
    w = layer.weight.data.copy()
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((1, 2, *shape)) for _ in range(2)]
    dys = [rng.standard_normal((1, 3, *shape)) for _ in range(2)]
    caches = []
    for x in xs:
        layer.forward(d.take(x))
        caches.append(take_caches(layer))
    dxs = []
    for cache, dy in zip(reversed(caches), reversed(dys)):
        put_caches(layer, cache)
        dxs.append(layer.backward(d.take(dy)))
    want_dw = 0
    for x, dy, dx in zip(reversed(xs), reversed(dys), dxs):
        want_dx, dw, _ = conv_grads(x, w, dy, periodic)
        want_dw = want_dw + dw
        assert_close(dx, d.take(want_dx), rtol=1e-10, atol=1e-10, what="dx")
    assert_close(layer.weight.grad, want_dw, rtol=1e-10, atol=1e-10, what="dweight")


def test_frozen_kernel_and_no_input_gradient(mesh):
    d = Decomposition((8, 8), layout(mesh, "grid"), True)
    layer = HaloConv(HaloExchange(d, 1), 2, 2, 3, dtype=np.float64, input_grad=False)
    layer.weight.requires_grad = False
    x = np.ones((1, 2, *d.local_shape))
    layer.forward(x)
    agree(layer.backward(np.ones((1, 2, *d.local_shape))) is None)
    agree(layer.weight.grad is None and layer.bias.grad is not None, "grads")
    want = 64.0  # every cell of the 8 x 8 field, summed over the spatial groups
    assert_close(layer.bias.grad, np.full(2, want), what="dbias")


# ------------------------------------------------------------------ errors


def test_a_halo_narrower_than_the_kernel(mesh):
    d = Decomposition((8, 8), layout(mesh, "grid"))
    raises_everywhere(ValueError, r"reaches \(2, 1\) cells", HaloConv, HaloExchange(d, 1),
                      1, 1, (5, 3))
    raises_everywhere(ValueError, "kernel_size must be odd", HaloConv, HaloExchange(d, 1),
                      1, 1, 2)
    raises_everywhere(ValueError, "axis 1 is too narrow", Laplacian,
                      HaloExchange(d, ((1, 1), (0, 1))))
    raises_everywhere(TypeError, "must be a pympar HaloExchange", Laplacian, d)


@pytest.mark.skipif(P == 1, reason="needs two ranks")
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_misfit_input_on_one_rank(mesh, direction):
    """Wrong channels on rank 0 only: none waits in the halo. The forward refuses in the
    halo's check, with the neighbours: rank 0 and its neighbours raise, the ranks beyond
    raise PeerEndedError or return. The backward refuses in its check over the spatial
    groups, before the weights' all-reduce: every rank raises."""
    d = Decomposition((8, 8), layout(mesh, "grid"), True)
    layer = HaloConv(HaloExchange(d, 1), 2, 3, 3, dtype=np.float64)
    good = np.ones((1, 2, *d.local_shape))
    channels = 2 if direction == "forward" else 3
    bad = np.ones((1, channels + (WORLD.rank == 0), *d.local_shape))
    if direction == "backward":
        layer.forward(good)
        caught = raises_everywhere(Exception, "HaloConv", layer.backward, bad)
        agree(isinstance(caught, ValueError if WORLD.rank == 0 else CollectiveMismatchError),
              repr(caught))
    else:
        caught = None
        try:
            layer.forward(bad)
        except Exception as err:  # noqa: BLE001 - inspected below
            caught = err
        near = any(group.ranks[r] == 0 for _, group, board in layer.halo._checks
                   for r in board.neighbours)
        agree(isinstance(caught, ValueError) if WORLD.rank == 0 else
              isinstance(caught, CollectiveMismatchError) and "HaloConv" in str(caught)
              if near else caught is None or isinstance(caught, (CollectiveMismatchError,
                                                                  PeerEndedError)),
              repr(caught))
    layer.forward(good)  # still usable
