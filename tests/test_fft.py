"""pympar.fft against numpy.fft of the whole field: forward, round trip, adjoint, bad input.

Every rank builds the same global field from one seed, takes its block
(:func:`pympar.fft.physical_placement`) and compares its block of the result with the same
block of NumPy's transform of the whole field. Slabs split axis 0 over the world; pencils
split axes 0 and 1 over the two axes of a mesh of the world.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere, to_numpy
from pympar import debug, fft
from pympar.debug import CollectiveMismatchError
from pympar.fft import _local
from pympar.mesh import Mesh

EVEN, UNEVEN = (64, 64, 64), (63, 50, 65)
TOL = {np.float64: 1e-12, np.float32: 1e-5}


def _pencil_sizes(world: int) -> dict[str, int]:
    a = max(d for d in range(1, world + 1) if world % d == 0 and d * d >= world)
    return {"a": a, "b": world // a}


@pytest.fixture(scope="module")
def layouts() -> Any:
    """``{"slab": world group, "pencil": (group of mesh axis a, group of axis b)}``."""
    slab = Mesh(WORLD, {"x": WORLD.size}).group("x")
    mesh = Mesh(WORLD, _pencil_sizes(WORLD.size))
    pencil = (mesh.group("a"), mesh.group("b"))
    yield {"slab": slab, "pencil": pencil}
    for group in (slab, *pencil):
        group.free()


def _field(shape: tuple[int, ...], dtype: Any, complex_: bool, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if complex_:
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(np.result_type(dtype, np.complex64) if complex_ else dtype)


def _rel_close(actual: Any, expected: np.ndarray, tol: float, what: str) -> None:
    """Collective: ``max |actual - expected| <= tol * max |expected|`` (complex-safe)."""
    a = to_numpy(actual)
    if a.shape != expected.shape:
        agree(False, f"{what}: shape {a.shape} != expected {expected.shape}")
        return
    scale = float(np.max(np.abs(expected))) if expected.size else 1.0
    err = float(np.max(np.abs(a.astype(np.complex128) - expected))) if a.size else 0.0
    agree(err <= tol * max(scale, 1e-300), f"{what}: max error {err:.3g} > {tol} x {scale:.3g}")


def _inner(a: Any, b: Any) -> float:
    """``Re <a, b>`` summed over ranks."""
    return WORLD.allreduce(float(np.vdot(to_numpy(a), to_numpy(b)).real))


@pytest.fixture(params=["pyfftw", "scipy.fft", "numpy.fft"])
def library(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The local transforms of NumPy arrays: FFTW's, SciPy's or NumPy's (those installed)."""
    if request.param not in _local.LIBRARIES:
        pytest.skip(f"{request.param} is not installed")
    monkeypatch.setattr(_local, "LIBRARY", request.param)
    return request.param


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [EVEN, UNEVEN], ids=["64^3", "63x50x65"])
@pytest.mark.parametrize("layout", ["slab", "pencil"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("real", [True, False], ids=["rfftn", "fftn"])
def test_forward_equals_numpy_and_round_trip(library, layouts, shape, layout, dtype, real):
    groups = layouts[layout]
    full = _field(shape, dtype, not real)
    x = fft.physical_placement(shape, groups).take(full)
    forward, inverse, ref = ((fft.rfftn, fft.irfftn, np.fft.rfftn) if real
                             else (fft.fftn, fft.ifftn, np.fft.fftn))
    y = forward(x, groups, s=shape)
    want = fft.spectral_placement(shape, groups, real=real).take(ref(full.astype(
        np.complex128 if not real else np.float64)))
    agree(y.dtype == np.result_type(dtype, np.complex64), f"dtype {y.dtype}")
    _rel_close(y, want, TOL[dtype], f"{forward} {layout} {shape}")
    back = inverse(y, groups, s=shape)
    agree(back.dtype == x.dtype and back.shape == x.shape, f"{back.dtype} {back.shape}")
    _rel_close(back, x, TOL[dtype], f"{inverse} round trip")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm", [None, "backward", "ortho", "forward"])
@pytest.mark.parametrize("layout", ["slab", "pencil"])
def test_norms_and_learned_extents(library, layouts, norm, layout):
    """Every norm= as NumPy's; without s= the extents are learned in the exchange."""
    groups, shape = layouts[layout], (13, 10, 7)
    full = _field(shape, np.float64, False, seed=1)
    x = fft.physical_placement(shape, groups).take(full)
    y = fft.rfftn(x, groups, norm=norm)
    spec = fft.spectral_placement(shape, groups, real=True)
    _rel_close(y, spec.take(np.fft.rfftn(full, norm=norm)), 1e-12, f"rfftn norm={norm}")
    back = fft.irfftn(y, groups, norm=norm, s=shape)  # 7 is odd: s= says so
    _rel_close(back, x, 1e-12, "irfftn round trip")
    z = fft.ifftn(fft.fftn(x, groups, norm=norm), groups, norm=norm)
    _rel_close(z, x.astype(np.complex128), 1e-12, "ifftn(fftn) round trip")


@pytest.mark.mpi(min_size=1)
def test_transformed_axes_of_a_batch_of_fields(layouts):
    """``axes=`` leaves the batch and channel axes alone (the layout of a spectral layer)."""
    group, shape, axes = layouts["slab"], (3, 11, 9, 4), (1, 2)
    full = _field(shape, np.float64, False, seed=2)
    x = fft.physical_placement(shape, group, axes).take(full)
    y = fft.rfftn(x, group, axes=axes, s=(11, 9))
    want = fft.spectral_placement(shape, group, axes, real=True).take(
        np.fft.rfftn(full, axes=axes))
    _rel_close(y, want, 1e-12, "rfftn axes=(1, 2)")
    _rel_close(fft.irfftn(y, group, axes=axes, s=(11, 9)), x, 1e-12, "round trip")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(12, 10, 9), (9, 7), (10, 8)], ids=str)
@pytest.mark.parametrize("layout", ["slab", "pencil"])
@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
@pytest.mark.parametrize("name", ["rfftn", "irfftn", "fftn", "ifftn"])
def test_adjoint(layouts, shape, layout, norm, name):
    """``<F x, y> == <x, F.backward(y)>`` (real inner product, summed over ranks)."""
    if layout == "pencil" and len(shape) < 3:
        pytest.skip("a pencil needs three axes")
    groups, pair = layouts[layout], getattr(fft, name)
    real = name in ("rfftn", "irfftn")
    physical = fft.physical_placement(shape, groups)
    spectral = fft.spectral_placement(shape, groups, real=real)
    rng = np.random.default_rng(3)
    field = rng.standard_normal(shape) if real else _field(shape, np.float64, True, 4)
    spectrum = (rng.standard_normal(spectral.shape)
                + 1j * rng.standard_normal(spectral.shape))
    a, b = ((physical.take(field), spectral.take(spectrum)) if name in ("rfftn", "fftn")
            else (spectral.take(spectrum), physical.take(field)))
    lhs = _inner(pair(a, groups, norm=norm, s=shape), b)
    rhs = _inner(a, pair.backward(b, groups, norm=norm, s=shape))
    agree(abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0), f"{name}: {lhs} != {rhs}")


@pytest.mark.mpi(min_size=1)
def test_cupy_arrays_use_cupy_fft(xp, layouts):
    group, shape = layouts["slab"], (9, 8, 6)
    full = _field(shape, np.float64, False, seed=5)
    x = xp.asarray(fft.physical_placement(shape, group).take(full))
    y = fft.rfftn(x, group, s=shape)
    agree(type(y) is type(x), f"{type(y).__name__} out of {type(x).__name__}")
    _rel_close(y, fft.spectral_placement(shape, group, real=True).take(np.fft.rfftn(full)),
               1e-12, "rfftn")
    _rel_close(fft.irfftn(y, group, s=shape), to_numpy(x), 1e-12, "round trip")


@pytest.mark.mpi(min_size=2)
def test_a_block_that_disagrees_with_the_split_is_refused_on_every_rank(layouts):
    group, shape = layouts["slab"], (12, 6, 5)
    block = fft.physical_placement(shape, group).take(np.zeros(shape))
    if WORLD.rank == WORLD.size - 1:  # one rank holds one row too many
        block = np.zeros((block.shape[0] + 1, 6, 5))
    raises_everywhere(Exception, "axis 0 of this rank's block has extent", fft.rfftn, block,
                      group, s=shape)
    # every rank passes the whole field: the split disagrees with the group
    raises_everywhere(Exception, "should be", fft.rfftn, np.zeros(shape), group, s=shape)
    raises_everywhere(ValueError, "one more axis than groups", fft.rfftn,
                      np.zeros((4, 4)), layouts["pencil"])
    raises_everywhere(ValueError, "norm must be one of", fft.fftn, block, group, norm="unit")
    raises_everywhere(TypeError, "real floating-point", fft.rfftn, block + 0j, group)


@pytest.fixture(scope="module")
def two_split_pencil() -> Any:
    """Two groups of two ranks or more each (the ``pencil`` layout of 4 ranks is 4 x 1)."""
    if WORLD.size < 4 or WORLD.size % 2:
        pytest.skip("needs an even number of ranks, at least 4")
    mesh = Mesh(WORLD, {"a": WORLD.size // 2, "b": 2})
    groups = (mesh.group("a"), mesh.group("b"))
    yield groups
    for group in groups:
        group.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", ["rfftn", "irfftn", "fftn", "ifftn"])
def test_a_block_refused_on_one_rank_ends_every_exchange_at_once(two_split_pencil, direction,
                                                                  name):
    """One rank's block of the wrong extent: the ranks of every exchange of the call raise
    at once, whichever way the call goes through the groups, none waiting for the watchdog."""
    groups, shape = two_split_pencil, (6, 5, 4)
    real = name in ("rfftn", "irfftn")
    field_side = (name in ("rfftn", "fftn")) == (direction == "forward")
    placement = (fft.physical_placement(shape, groups) if field_side
                 else fft.spectral_placement(shape, groups, real=real))
    x = placement.take(np.ones(placement.shape, np.float64 if field_side and real
                               else np.complex128))
    if WORLD.rank == WORLD.size - 1:
        x = np.ones((x.shape[0] + 1,) + x.shape[1:], x.dtype)
    call = getattr(fft, name) if direction == "forward" else getattr(fft, name).backward
    old = debug.get_timeout()
    debug.set_timeout(60.0)
    try:
        start = time.monotonic()
        raises_everywhere(Exception, "", call, x, groups, s=shape)
        agree(time.monotonic() - start < 20.0, "a rank waited for the watchdog")
    finally:
        debug.set_timeout(old)


@pytest.mark.mpi(min_size=1)
def test_an_out_of_another_shape_is_refused_without_s(layouts):
    """Without s= the block's shape is known once the exchanges are made: an out of
    another shape is refused then, never filled by broadcasting."""
    group, shape = layouts["slab"], (2 * WORLD.size, 1, 3)
    y = fft.spectral_placement(shape, group).take(np.fft.fftn(_field(shape, np.float64, True)))
    wrong = np.zeros((y.shape[0], 4, 3), np.complex128)
    raises_everywhere(ValueError, "out has shape", fft.ifftn, y, group, out=wrong)
    x = fft.physical_placement(shape, group).take(_field(shape, np.float64, False))
    half = fft.spectral_placement(shape, group, real=True).local_shape
    raises_everywhere(ValueError, "out has shape", fft.irfftn,
                      fft.rfftn(x, group, s=shape), group,
                      out=np.zeros((x.shape[0], 2, 3)))
    if WORLD.size == 1:  # no exchange: the local transform's out is checked
        raises_everywhere(ValueError, "out has shape", fft.rfftn, x, group,
                          out=np.zeros((half[0], 1, 3), np.complex128))


@pytest.mark.mpi(min_size=2)
def test_shapes_that_differ_between_ranks_are_refused_on_every_rank(layouts):
    """Without s= the exchange's agreement check catches whole axes that differ."""
    group = layouts["slab"]
    block = np.zeros((2, 6 + (WORLD.rank == 0), 5))
    raises_everywhere(Exception, "", fft.rfftn, block, group)
    # 8 and 9 real points give 5 modes alike: the label carries the whole extents
    block = np.zeros((2, 6, 8 + (WORLD.rank == 0)))
    raises_everywhere(Exception, "whole extents", fft.rfftn, block, group)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", ["slab", "pencil"])
def test_out_is_written_and_reused(library, layouts, layout):
    """``out=`` receives the result (reused across calls); a wrong one is refused everywhere."""
    groups, shape = layouts[layout], (12, 10, 9)
    full = _field(shape, np.float64, False, seed=6)
    x = fft.physical_placement(shape, groups).take(full)
    spec = fft.spectral_placement(shape, groups, real=True)
    out = np.empty(spec.local_shape, np.complex128)
    back = np.empty_like(x)
    for call in range(2):
        y = fft.rfftn(x * (call + 1), groups, s=shape, out=out)
        agree(y is out, "rfftn returned another array than out")
        _rel_close(y, spec.take(np.fft.rfftn(full * (call + 1))), 1e-12, f"rfftn call {call}")
        z = fft.irfftn(y, groups, s=shape, out=back)
        agree(z is back, "irfftn returned another array than out")
        _rel_close(z, x * (call + 1), 1e-12, f"round trip call {call}")
    c = fft.ifftn(fft.fftn(x, groups, s=shape), groups, s=shape,
                  out=np.empty(x.shape, np.complex128))
    _rel_close(c, x.astype(np.complex128), 1e-12, "ifftn(fftn) into out")
    wrong = np.empty((out.shape[0] + (WORLD.rank == 0),) + out.shape[1:], np.complex128)
    raises_everywhere(Exception, "", fft.rfftn, x, groups, s=shape, out=wrong)
    raises_everywhere(Exception, "", fft.rfftn, x, groups, s=shape,
                      out=np.empty(spec.local_shape, np.complex64))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["slab", "pencil"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", ["rfftn", "irfftn", "fftn", "ifftn"])
def test_a_norm_that_differs_on_one_rank_raises_on_every_rank(layouts, layout, direction, name):
    """norm= only scales the local transforms: the exchanges' label carries it (issue #38).

    None and "backward" are one norm, so they agree; any other pair raises everywhere.
    """
    groups, shape = layouts[layout], (6, 5, 4)
    pair, real = getattr(fft, name), name in ("rfftn", "irfftn")
    field_side = (name in ("rfftn", "fftn")) == (direction == "forward")
    placement = (fft.physical_placement(shape, groups) if field_side
                 else fft.spectral_placement(shape, groups, real=real))
    rng = np.random.default_rng(7)
    full = rng.standard_normal(placement.shape)
    if not (field_side and real):
        full = full + 1j * rng.standard_normal(placement.shape)
    x = placement.take(full)
    call = pair if direction == "forward" else pair.backward
    last = WORLD.rank == WORLD.size - 1
    old = debug.get_timeout()
    debug.set_timeout(30.0)
    try:
        for mine, theirs in (("ortho", None), ("forward", "backward"), ("backward", "ortho")):
            raises_everywhere(CollectiveMismatchError, f"norm={mine}", call, x, groups,
                              norm=mine if last else theirs, s=shape)
        alike = call(x, groups, norm=None if last else "backward", s=shape)
        want = call(x, groups, norm="backward", s=shape)
        agree(np.array_equal(alike, want), "norm=None and norm='backward' differ")
    finally:
        debug.set_timeout(old)
