"""SpectralConv1d/2d/3d and FNO blocks against a serial NumPy reference and finite differences.

The reference (:func:`reference`) is written from the definition: ``numpy.fft.rfftn`` of the
whole field, each kept mode times its weight matrix, ``irfftn``. It is linear in the field
and in the weights, so its exact gradients are its Jacobians' transposes, built column by
column (:func:`jacobian`). The distributed layer splits ``x1`` over the world; its blocks of
output, input gradient and weight gradients are compared with the same blocks of the
reference's.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar.mesh import Mesh
from pympar.modules import GELU, Linear, Sequential
from pympar.modules.fno import SpectralBlock, split_parameters
from pympar.modules.spectral import SpectralConv1d, SpectralConv2d, SpectralConv3d
from pympar.optim import AdamW, allreduce_gradients
from pympar.partition import Placement, Split

LAYERS = {1: SpectralConv1d, 2: SpectralConv2d, 3: SpectralConv3d}
CASES = {  # id -> (grid, modes)
    "1d": ((16,), (5,)),
    "1d-odd": ((13,), (7,)),
    "2d": ((12, 10), (3, 4)),
    "2d-odd": ((11, 9), (5, 5)),
    "3d": ((6, 4, 5), (2, 2, 3)),
}
BATCH, CIN, COUT = 2, 3, 2


@pytest.fixture(scope="module")
def space() -> Any:
    group = Mesh(WORLD, {"x": WORLD.size}).group("x")
    yield group
    group.free()


def reference(x: np.ndarray, w: np.ndarray, modes: tuple[int, ...]) -> np.ndarray:
    """The spectral convolution of the whole field ``x`` with the full complex weights ``w``."""
    d = len(modes)
    axes = tuple(range(1, d + 1))
    grid = x.shape[1:-1]
    spectrum = np.fft.rfftn(x, axes=axes)
    out = np.zeros(spectrum.shape[:-1] + (w.shape[-1],), complex)
    # the corners: lowest and highest modes on every axis but the last, lowest on the last
    choices = [[(slice(0, m), slice(0, m)), (slice(n - m, n), slice(m, 2 * m))]
               for n, m in zip(grid[:-1], modes[:-1])] + [[(slice(0, modes[-1]),) * 2]]
    for corner in itertools.product(*choices):
        field = (slice(None),) + tuple(c[0] for c in corner)
        weight = tuple(c[1] for c in corner)
        out[field] = np.einsum("b...i,...io->b...o", spectrum[field], w[weight])
    return np.fft.irfftn(out, s=grid, axes=axes)


def jacobian(f: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The matrix of the linear map ``f`` on arrays of ``shape``: one column per unit input."""
    size = int(np.prod(shape))
    columns = []
    for i in range(size):
        e = np.zeros(size)
        e[i] = 1.0
        columns.append(f(e.reshape(shape)).ravel())
    return np.stack(columns, axis=1)


def full_weights(layer_cls: type, modes: tuple[int, ...], seed: int) -> tuple[Any, Any]:
    serial = layer_cls(CIN, COUT, modes, None, np.float64, seed)
    return serial.weight_real.data, serial.weight_imag.data


def _block(full: np.ndarray, group: Any) -> np.ndarray:
    return Placement(full.shape, (Split.over(group, 1),)).take(full)


def _close(actual: Any, expected: np.ndarray, tol: float, what: str) -> None:
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1e-300)
    err = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    ok = actual.shape == expected.shape and err <= tol * scale
    agree(ok, f"{what}: shape {actual.shape} vs {expected.shape}, error {err:.3g} "
          f"(scale {scale:.3g})")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", list(CASES))
def test_spectral_conv_equals_reference_forward_and_gradients(space, case):
    grid, modes = CASES[case]
    d = len(grid)
    layer_cls = LAYERS[d]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((BATCH, *grid, CIN))
    dy = rng.standard_normal((BATCH, *grid, COUT))
    wr, wi = full_weights(layer_cls, modes, seed=3)

    layer = layer_cls(CIN, COUT, modes, space, np.float64, seed=3)
    placement = layer.weight_real.placement
    agree(np.array_equal(layer.weight_real.data, placement.take(wr)) and
          np.array_equal(layer.weight_imag.data, placement.take(wi)),
          "the shards are the serial layer's weights cut by their placement")

    y = layer.forward(_block(x, space))
    dx = layer.backward(_block(dy, space))

    want = None
    if WORLD.rank == 0:  # the reference once, on one rank (the Jacobians take a while)
        # exact reference gradients: the transposed Jacobians of the (linear) reference
        jx = jacobian(lambda v: reference(v, wr + 1j * wi, modes), x.shape)
        jr = jacobian(lambda v: reference(x, v + 0j, modes), wr.shape)  # linear in weights
        ji = jacobian(lambda v: reference(x, 1j * v, modes), wi.shape)
        want = (reference(x, wr + 1j * wi, modes), (jx.T @ dy.ravel()).reshape(x.shape),
                (jr.T @ dy.ravel()).reshape(wr.shape), (ji.T @ dy.ravel()).reshape(wi.shape))
    y_ref, dx_ref, dwr_ref, dwi_ref = WORLD.bcast(want)
    _close(y, _block(y_ref, space), 1e-10, f"{case} forward")
    _close(dx, _block(dx_ref, space), 1e-10, f"{case} dx")
    _close(layer.weight_real.grad, placement.take(dwr_ref), 1e-10, f"{case} d weight_real")
    _close(layer.weight_imag.grad, placement.take(dwi_ref), 1e-10, f"{case} d weight_imag")

    # finite differences of the distributed layer's <y, dy> along random directions
    def objective(field: np.ndarray) -> float:
        out = layer.forward(_block(field, space))
        layer.saved_tensors()  # release the cache
        return WORLD.allreduce(float(np.vdot(out, _block(dy, space))))

    v = rng.standard_normal(x.shape)
    eps = 1e-3  # the map is linear: the central difference is exact up to rounding
    fd = (objective(x + eps * v) - objective(x - eps * v)) / (2 * eps)
    exact = WORLD.allreduce(float(np.vdot(dx, _block(v, space))))
    agree(abs(fd - exact) <= 1e-9 * max(abs(exact), 1.0), f"{case} dx: fd {fd} vs {exact}")
    for p in (layer.weight_real, layer.weight_imag):
        w = rng.standard_normal(p.placement.shape)
        base = p.data.copy()
        values = []
        for sign in (1, -1):
            p.data[...] = base + sign * eps * p.placement.take(w)
            values.append(objective(x))
        p.data[...] = base
        fd = (values[0] - values[1]) / (2 * eps)
        exact = WORLD.allreduce(float(np.vdot(p.grad, p.placement.take(w))))
        agree(abs(fd - exact) <= 1e-9 * max(abs(exact), 1.0), f"{case} {p.name}: fd {fd} vs "
              f"{exact}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", ["1d", "2d-odd", "3d"])
def test_spectral_conv_float32(space, case):
    grid, modes = CASES[case]
    layer_cls = LAYERS[len(grid)]
    x = np.random.default_rng(8).standard_normal((BATCH, *grid, CIN))
    wr, wi = full_weights(layer_cls, modes, seed=4)
    layer = layer_cls(CIN, COUT, modes, space, np.float32, seed=4)
    y = layer.forward(_block(x, space).astype(np.float32))
    agree(y.dtype == np.float32, f"dtype {y.dtype}")
    _close(y, _block(reference(x, wr + 1j * wi, modes), space), 1e-5, f"{case} float32")


def _fno(width: int, modes: tuple[int, ...], group: Any, seed: int = 0) -> Sequential:
    """Lifting, two spectral blocks (the last without activation), projection."""
    return Sequential(
        Linear(3, width, dtype=np.float64, seed=seed, input_grad=False),
        SpectralBlock(width, modes, group, dtype=np.float64, seed=seed + 10),
        SpectralBlock(width, modes, group, activation=False, dtype=np.float64, seed=seed + 20),
        Linear(width, 8, dtype=np.float64, seed=seed + 30),
        GELU(),
        Linear(8, 1, dtype=np.float64, seed=seed + 40),
    )


def _loss_and_backward(model: Sequential, x: np.ndarray, target: np.ndarray, count: int,
                       group: Any) -> float:
    err = model.forward(x) - target
    local = np.array([np.dot(err.ravel(), err.ravel())])
    loss = float((group.all_reduce(local) if group is not None else local)[0]) / count
    model.backward(err * (2.0 / count))
    return loss


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dims", [1, 2])
def test_fno_gradients_equal_serial_and_finite_differences(space, dims):
    grid, modes = ((16,), (4,)) if dims == 1 else ((10, 8), (3, 3))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((BATCH, *grid, 3))
    target = rng.standard_normal((BATCH, *grid, 1))
    count = target.size

    serial = _fno(6, modes, None)
    loss = _loss_and_backward(serial, x, target, count, None)
    model = _fno(6, modes, space)
    dist_loss = _loss_and_backward(model, _block(x, space), _block(target, space), count, space)
    agree(abs(dist_loss - loss) <= 1e-10 * loss, f"loss {dist_loss} vs serial {loss}")
    replicated, split = split_parameters(model)
    allreduce_gradients(replicated, space, average=False)  # partial sums over the points
    for (name, p), q in zip(model.named_parameters(), serial.parameters()):
        _close(p.grad, p.placement.take(q.grad), 1e-10, f"gradient of {name}")

    # finite differences of the serial loss along a random direction of every parameter
    grads = {name: p.grad.copy() for name, p in serial.named_parameters()}
    for name, p in serial.named_parameters():
        v = rng.standard_normal(p.shape)
        base = p.data.copy()
        eps = 1e-5
        values = []
        for sign in (1, -1):
            p.data[...] = base + sign * eps * v
            err = serial.forward(x) - target
            values.append(float(np.dot(err.ravel(), err.ravel())) / count)
        p.data[...] = base
        fd = (values[0] - values[1]) / (2 * eps)
        exact = float(np.vdot(grads[name], v))
        agree(abs(fd - exact) <= 1e-6 * max(abs(exact), 1e-3), f"{name}: fd {fd} vs {exact}")


@pytest.mark.mpi(min_size=1)
def test_twenty_training_steps_follow_the_one_rank_run(space):
    """DP x spatial (dp=2 when the world is even and > 2) against the serial run, to 1e-8."""
    world = WORLD.size
    dp = 2 if world % 2 == 0 and world > 2 else 1
    mesh = Mesh(WORLD, {"x": world // dp, "dp": dp})
    spatial, data, both = mesh.group("x"), mesh.group("dp"), mesh.group("x", "dp")
    grid, modes, batch = (12, 10), (3, 3), 4
    rng = np.random.default_rng(10)
    xs = rng.standard_normal((20, batch, *grid, 3))
    ts = rng.standard_normal((20, batch, *grid, 1))
    count = batch * int(np.prod(grid))

    serial = _fno(6, modes, None)
    model = _fno(6, modes, spatial)
    opt_serial, opt = AdamW(serial.parameters(), lr=1e-2), AdamW(model.parameters(), lr=1e-2)
    replicated, split = split_parameters(model)
    rows = Placement((batch,), (Split.over(data, 0),)).axis_ranges[0][0]
    worst = 0.0
    try:
        for step in range(20):
            serial.zero_grad()
            model.zero_grad()
            want = _loss_and_backward(serial, xs[step], ts[step], count, None)
            x = Placement(xs[step].shape, (Split.over(spatial, 1),)).take(xs[step])[rows]
            t = Placement(ts[step].shape, (Split.over(spatial, 1),)).take(ts[step])[rows]
            got = _loss_and_backward(model, x, t, count, both)
            allreduce_gradients(replicated, both, average=False)
            allreduce_gradients(split, data, average=False)
            opt_serial.step()
            opt.step()
            worst = max(worst, abs(got - want) / want)
        agree(worst <= 1e-8, f"losses differ by {worst:.3g} relative")
        for (name, p), q in zip(model.named_parameters(), serial.parameters()):
            _close(p.data, p.placement.take(q.data), 1e-8, f"{name} after 20 steps")
    finally:
        for g in (spatial, data, both):
            g.free()


@pytest.mark.mpi(min_size=1)
def test_more_modes_than_the_grid_is_refused_on_every_rank(space):
    x2 = np.zeros((1, 2, 6, 3), np.float32)  # x2 (real axis), 6 points: 4 modes
    raises_everywhere(Exception, "at most 4", SpectralConv2d(3, 2, (1, 5), space).forward, x2)
    # x1 (split) has 2 * world points: at most world modes, known only after the exchange
    too_many = WORLD.size + 1
    raises_everywhere(ValueError, f"at most {WORLD.size}",
                      SpectralConv2d(3, 2, (too_many, 2), space).forward, x2)
    x1 = np.zeros((1, 2, 3), np.float32)  # 1-D: at most world + 1 modes of the real DFT
    raises_everywhere(ValueError, f"at most {WORLD.size + 1}",
                      SpectralConv1d(3, 2, WORLD.size + 2, space).forward, x1)
    raises_everywhere(ValueError, "expected input of shape",
                      SpectralConv2d(4, 2, 2, space).forward, x2)
    if WORLD.size > 1:  # one rank's field has another x2: it alone refuses, all raise
        bad = np.zeros((1, 2, 6 + 2 * (WORLD.rank == 0), 3), np.float32)
        raises_everywhere(Exception, "", SpectralConv2d(3, 2, 2, space).forward, bad)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_rank_may_hold_no_batch_rows(space, dims):
    """Data parallelism can leave a rank without samples (a small validation batch)."""
    grid, modes = {1: ((8,), 3), 2: ((8, 6), 2), 3: ((8, 6, 4), 2)}[dims]
    layer = LAYERS[dims](CIN, COUT, modes, space, np.float64)
    rows = len(range(*_rows(grid[0], space)))
    y = layer.forward(np.zeros((0, rows, *grid[1:], CIN)))
    dx = layer.backward(np.zeros(y.shape))
    agree(y.shape == (0, rows, *grid[1:], COUT) and dx.shape == (0, rows, *grid[1:], CIN),
          f"{y.shape} {dx.shape}")


def _rows(n: int, group: Any) -> tuple[int, int]:
    block = Placement((n,), (Split(0, group.size, group.rank),)).axis_ranges[0][0]
    return block.start, block.stop
