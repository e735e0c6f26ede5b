"""Every layer's backward checks its output gradient ``dy`` as its forward checks ``x``.

A ``dy`` of the wrong shape (a skipped layer's backward upstream, say) raises a ValueError
naming the layer and the shape it expected; a parallel layer raises on every rank of its
group, also when only one rank's ``dy`` is wrong (no rank is left waiting in a collective).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import Mesh, debug, manager
from pympar.debug import CollectiveMismatchError
from pympar.decomposition import Decomposition
from pympar.errors import PeerEndedError
from pympar.halo import HaloExchange
from pympar.modules import (GELU, ColumnParallelLinear, ContextAttention, Dropout, HaloConv,
                            Laplacian, LayerNorm, LayerNorm3D, Linear, Linear3D, MSELoss,
                            ParallelAttention, ReLU, RowParallelLinear, SoftmaxCrossEntropy,
                            SpectralBlock, SpectralConv1d, SpectralConv2d)

RNG = np.random.default_rng(11)
P = WORLD.size


def _rows(n: int) -> slice:
    cut = np.array_split(np.arange(n), P)[WORLD.rank]
    return slice(int(cut[0]), int(cut[-1]) + 1) if cut.size else slice(0, 0)


@pytest.fixture(scope="module")
def space():
    group = Mesh(WORLD, {"x": P}).group("x")
    yield group
    group.free()


@pytest.fixture
def tp_world(clean_state):
    """Tensor parallelism over the world, under a timeout: a rank left waiting raises."""
    manager.initialize_parallel(P)
    debug.set_timeout(8)
    yield
    debug.set_timeout(None)


@pytest.fixture
def cp_world(clean_state):
    manager.initialize_parallel(context_parallel_size=P)
    debug.set_timeout(8)
    yield
    debug.set_timeout(None)


def _local_cases() -> dict[str, Callable[[], tuple[Any, Any]]]:
    x = RNG.standard_normal((3, 2, 8))
    return {
        "Linear": lambda: (Linear(8, 4, dtype=np.float64, seed=1), x),
        "LayerNorm": lambda: (LayerNorm(8, dtype=np.float64), x),
        "GELU": lambda: (GELU(), x),
        "ReLU": lambda: (ReLU(), x),
        "Dropout": lambda: (Dropout(0.5, seed=3), x),
        "Dropout (eval)": lambda: (Dropout(0.5, seed=3).eval(), x),
    }


def _tp_cases() -> dict[str, Callable[[], tuple[Any, Any]]]:
    x = RNG.standard_normal((3, 2, 8))
    heads = 2 * P
    return {
        "ColumnParallelLinear": lambda: (ColumnParallelLinear(8, 6, dtype=np.float64), x),
        "ColumnParallelLinear (local output)": lambda: (
            ColumnParallelLinear(8, 2 * P + 1, gather_output=False, dtype=np.float64), x),
        "RowParallelLinear": lambda: (RowParallelLinear(8, 4, dtype=np.float64), x),
        "ParallelAttention": lambda: (
            ParallelAttention(2 * heads, heads, dtype=np.float64),
            RNG.standard_normal((3, 2, 2 * heads))),
    }


def _bad(y: Any) -> np.ndarray:
    """An output gradient one column wider than the output."""
    return np.zeros((*y.shape[:-1], y.shape[-1] + 1), y.dtype)


def _expected(layer: Any, y: Any) -> str:
    return (f"{re.escape(type(layer).__name__)}.*expected output gradient (block )?of shape "
            f"{re.escape(str(tuple(y.shape)))}")


def _refused_everywhere(layer: Any, y: Any, within: float = 10.0) -> None:
    """Every rank passes a misfit dy: each raises its layer's ValueError."""
    start = time.monotonic()
    raises_everywhere(ValueError, _expected(layer, y), layer.backward, _bad(y))
    agree(time.monotonic() - start < within, "the refusal took too long")


def _refused_by_one(layer: Any, y: Any) -> None:
    """Only rank 0's dy is misfit: every rank raises, naming what rank 0 expected (rank 0
    may raise its own ValueError, as a stencil layer's refusing rank does); for the
    Laplacian, whose backward is a halo exchange's adjoint, checked with the neighbours
    only, the ranks beyond rank 0's neighbours raise PeerEndedError or return."""
    dy = _bad(y) if WORLD.rank == 0 else np.zeros(y.shape, y.dtype)
    start = time.monotonic()
    try:
        layer.backward(dy)
        caught: BaseException | None = None
    except BaseException as err:  # noqa: BLE001 - inspected below
        caught = err
    text = str(caught)
    halo = getattr(layer, "halo", None)
    beyond = isinstance(layer, Laplacian) and WORLD.rank != 0 and not any(
        group.ranks[r] == 0 for _, group, board in halo._checks for r in board.neighbours)
    if WORLD.rank == 0 and isinstance(caught, ValueError):
        ok = re.search(_expected(layer, y), text) is not None
    elif beyond:  # its backward is the halo's adjoint, checked with the neighbours only
        ok = caught is None or isinstance(caught, (PeerEndedError, CollectiveMismatchError))
    else:
        ok = (isinstance(caught, CollectiveMismatchError) and P > 1
              and re.search(r"refused by this rank: .*expected output gradient (block )?of shape \(",
                            text) is not None)
    agree(ok and "\n" not in text, f"got {caught!r}")
    agree(time.monotonic() - start < 10, "the refusal took more than 10 s to reach every rank")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(_local_cases()))
def test_a_local_layer_refuses_a_misfit_output_gradient(name):
    layer, x = _local_cases()[name]()
    y = layer.forward(x)
    with pytest.raises(ValueError, match=_expected(layer, y)):
        layer.backward(_bad(y))
    with pytest.raises(TypeError, match="output gradient"):
        layer.forward(x)
        layer.backward(list(np.zeros(y.shape)))
    # A wrong dtype is refused too, and the right gradient still passes afterwards.
    layer.forward(x)
    with pytest.raises(ValueError, match="dtype float64"):
        layer.backward(np.zeros(y.shape, np.float32))
    layer.forward(x)
    assert layer.backward(np.ones(y.shape)).shape == x.shape


@pytest.mark.mpi(min_size=1)
def test_losses_refuse_a_gradient_that_is_not_a_scalar():
    logits, target = RNG.standard_normal((4, 3)), np.array([0, 2, 1, 1])
    for loss, args in ((SoftmaxCrossEntropy(), (logits, target)),
                       (MSELoss(), (logits, np.zeros((4, 3))))):
        loss.forward(*args)
        with pytest.raises(TypeError, match=f"{type(loss).__name__}.*a real scalar"):
            loss.backward(np.ones((4, 3)))
        loss.forward(*args)
        assert loss.backward(2.0).shape == (4, 3)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(_tp_cases()))
def test_a_tensor_parallel_layer_refuses_a_misfit_output_gradient_on_every_rank(tp_world, name):
    layer, x = _tp_cases()[name]()
    y = layer.forward(x)
    _refused_everywhere(layer, y)
    layer.forward(x)
    _refused_by_one(layer, y)
    layer.forward(x)  # the group is still usable: the right gradient passes
    dx = layer.backward(np.ones(y.shape))
    agree(dx.shape == x.shape, f"dx {dx.shape}")


@pytest.mark.mpi(min_size=1)
def test_context_attention_refuses_a_misfit_output_gradient_on_every_rank(cp_world):
    layer = ContextAttention(8, 2, scheme="ring", dtype=np.float64, seed=4)
    x = RNG.standard_normal((9, 2, 8))[_rows(9)]
    y = layer.forward(x)
    raises_everywhere(ValueError, r"ContextAttention.*output gradient", layer.backward, _bad(y))
    layer.forward(x)
    dy = _bad(y) if WORLD.rank == 0 else np.zeros(y.shape)
    error = ValueError if P == 1 else CollectiveMismatchError
    raises_everywhere(error, "output gradient", layer.backward, dy)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("make", [
    lambda g: SpectralConv1d(3, 2, 1, g, dtype=np.float64),
    lambda g: SpectralConv2d(3, 2, (1, 2), g, dtype=np.float64),
    lambda g: SpectralBlock(3, 1, g, dims=1, dtype=np.float64),
], ids=["SpectralConv1d", "SpectralConv2d", "SpectralBlock"])
def test_spectral_layers_refuse_a_misfit_output_gradient_on_every_rank(space, make):
    debug.set_timeout(8)
    try:
        layer = make(space)
        ndim = len(getattr(layer, "modes", ())) or len(layer.spectral.modes)
        grid = (2 * P + 1, 6)[:ndim]
        x = RNG.standard_normal((2, *grid, 3))[:, _rows(grid[0])]
        y = layer.forward(x)
        # SpectralBlock's first backward layer is its GELU: it is the one that names the shape.
        raises_everywhere(ValueError, rf"expected output gradient of shape "
                          rf"{re.escape(str(tuple(y.shape)))}", layer.backward, _bad(y))
        if isinstance(layer, SpectralBlock):
            return  # its GELU checks dy before any communication
        layer.forward(x)
        _refused_by_one(layer, y)
    finally:
        debug.set_timeout(None)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["Laplacian", "HaloConv"])
def test_stencil_layers_refuse_a_misfit_output_gradient_on_every_rank(space, kind):
    debug.set_timeout(8)
    try:
        d = Decomposition((2 * P + 1, 5), {0: space}, (True, False))
        halo = HaloExchange(d, 1)
        if kind == "Laplacian":
            layer, x = Laplacian(halo), d.take(RNG.standard_normal((2, 2 * P + 1, 5)))
        else:
            layer = HaloConv(halo, 2, 3, 3, dtype=np.float64, seed=1)
            x = d.take(RNG.standard_normal((2, 2, 2 * P + 1, 5)))
        y = layer.forward(x)
        _refused_everywhere(layer, y)
        layer.forward(x)
        _refused_by_one(layer, y)
    finally:
        debug.set_timeout(None)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("kind", ["Linear3D", "LayerNorm3D"])
def test_3d_layers_refuse_a_misfit_output_gradient_on_every_rank(cube, kind):
    debug.set_timeout(8)
    try:
        layer = Linear3D(8, 4, dtype=np.float64) if kind == "Linear3D" else \
            LayerNorm3D(8, dtype=np.float64)
        x = layer.layout.split_input(RNG.standard_normal((4, 8)))
        y = layer.forward(x)
        _refused_everywhere(layer, y)
        layer.forward(x)
        _refused_by_one(layer, y)
    finally:
        debug.set_timeout(None)
