"""Layout mappings: forward and backward against NumPy references, adjointness, round trips.

Spaces: R is a replicated array (one logical value), P a tuple of per-rank
values (partial sums, or per-rank copies), S(a) the tuple of balanced blocks
along axis ``a``. Every mapping is the identity on logical values except the
sums (P -> R or S); the expected piece on each rank follows from the kinds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere, to_numpy
from pympar import collectives, debug, manager, mappings, stats
from pympar.mesh import Mesh
from pympar.modules.parallel_linear import ColumnParallelLinear
from collective_helpers import (Checks, dtypes_for, laid_out, layouts_for, piece,
                                random)
from pympar.mappings import MAPPINGS, Partial, Replicated, Sharded

R, P = ("R",), ("P",)


def kind(layout: Any) -> tuple:
    """A mapping's declared layout as the tests' kind: R, P or ("S", axis)."""
    if isinstance(layout, Sharded):
        return ("S", layout.axis)
    return R if isinstance(layout, Replicated) else P


def _cases() -> dict[str, tuple]:
    """case id -> (mapping name, input kind, output kind, forward options, backward options,
    forward size axis, backward size axis, global shape), from each mapping's declared
    ``source`` and ``destination``: the forward gathers a Sharded source's axis, the
    backward a Sharded destination's (so ``global_size=`` applies there), nothing else."""
    made = {}
    for m in MAPPINGS:
        variants = [("", {}, {}, "SBH")]
        if any(isinstance(x, Sharded) and x.option for x in (m.source, m.destination)):
            variants.append(("-heads", {"seq_axis": 0, "head_axis": 2}, {}, "SBND"))
        if isinstance(m.destination, Partial) and m.destination.unless:
            variants.append(("-replicated-grad", {}, {m.destination.unless: False}, "SBH"))
        for suffix, options, back, shape in variants:
            source = m.source.resolve(options)
            destination = m.destination.resolve({**options, **back})
            made[m.name + suffix] = (
                m.name, kind(source), kind(destination), options, back,
                source.axis if isinstance(source, Sharded) else None,
                destination.axis if isinstance(destination, Sharded) else None, shape)
    return made


CASES = _cases()


def backward_options(case: str) -> dict[str, Any]:
    return CASES[case][4]


def shapes(layout: str, p: int) -> list[tuple[int, ...]]:
    """Even and uneven global shapes ([S, B, H] or [S, B, heads, dim])."""
    if layout == "SBH":
        return [(2 * p, 2, 2 * p), (2 * p + 1, 3, p + 2), (p - 1 or 1, 1, 3)]
    return [(2 * p, 2, 2 * p, 2), (2 * p + 1, 1, p + 1, 3)]


def sample(kind: tuple, shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator,
           p: int, r: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(this rank's piece, the logical value, whether the logical value is a sum)."""
    if kind == P:
        values = [random(rng, shape, dtype) for _ in range(p)]
        total = np.sum([v.astype(np.float64) for v in values], axis=0).astype(dtype)
        return values[r], total, True
    full = random(rng, shape, dtype)
    return (full if kind == R else piece(full, p, kind[1], r)), full, False


def expected_piece(kind: tuple, value: np.ndarray, p: int, r: int) -> np.ndarray:
    """What a rank holds of logical ``value`` in layout ``kind``."""
    return piece(value, p, kind[1], r) if kind[0] == "S" else value


def size_option(axis: int | None, shape: tuple[int, ...], give: bool) -> dict[str, int]:
    return {"global_size": shape[axis]} if give and axis is not None else {}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_numpy(xp, group, case):
    name, kin, kout, options, _, fwd_axis, bwd_axis, layout_name = CASES[case]
    mapping = getattr(mappings, name)
    p, r = group.size, group.rank
    rng = np.random.default_rng(7)
    check = Checks()
    for dtype in dtypes_for(xp):
        for shape in shapes(layout_name, p):
            for give_size in (False, True):
                mine, value, summed = sample(kin, shape, dtype, rng, p, r)
                dmine, dvalue, dsummed = sample(kout, shape, dtype, rng, p, r)
                for layout in layouts_for(xp):
                    what = f"{case} {dtype} {shape} {layout} global_size={give_size}"
                    y = mapping(laid_out(mine, layout, xp), group, **options,
                                **size_option(fwd_axis, shape, give_size))
                    expect = expected_piece(kout, value, p, r)
                    (check.close if summed else check.equal)(y, expect, what + " forward")
                    check.true(type(y) is type(xp.asarray(mine)), what + " forward module")
                    dx = mapping.backward(laid_out(dmine, layout, xp), group, **options,
                                          **backward_options(case),
                                          **size_option(bwd_axis, shape, give_size))
                    dexpect = expected_piece(kin, dvalue, p, r)
                    (check.close if dsummed else check.equal)(dx, dexpect, what + " backward")
    check.done()


def inner(kind: tuple, a: Any, b: Any, group: Any) -> float:
    """Global inner product: replicated counted once, per-rank pieces summed over ranks."""
    local = float(np.vdot(to_numpy(a).astype(np.float64).ravel(),
                          to_numpy(b).astype(np.float64).ravel()))
    return local if kind == R else group.comm.allreduce(local)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", list(CASES))
def test_backward_is_the_adjoint(xp, group, case):
    name, kin, kout, options, _, fwd_axis, bwd_axis, layout_name = CASES[case]
    mapping = getattr(mappings, name)
    p, r = group.size, group.rank
    rng = np.random.default_rng(8)
    worst = 0.0
    for shape in shapes(layout_name, p):
        for _ in range(2):
            x, _, _ = sample(kin, shape, np.dtype(np.float64), rng, p, r)
            y, _, _ = sample(kout, shape, np.dtype(np.float64), rng, p, r)
            mx = mapping(xp.asarray(x), group, **options)
            mty = mapping.backward(xp.asarray(y), group, **options, **backward_options(case))
            lhs, rhs = inner(kout, mx, y, group), inner(kin, x, mty, group)
            worst = max(worst, abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300))
    agree(worst <= 1e-12, f"{case}: <m(x), y> and <x, m.backward(y)> differ by {worst:.3g} relative")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("all_to_all")])
def test_all_to_all_round_trip_is_bitwise(xp, group, case):
    name, kin, kout, options, _, fwd_axis, bwd_axis, layout_name = CASES[case]
    mapping = getattr(mappings, name)
    p, r = group.size, group.rank
    rng = np.random.default_rng(9)
    check = Checks()
    for dtype in dtypes_for(xp):
        for shape in shapes(layout_name, p):
            x, _, _ = sample(kin, shape, dtype, rng, p, r)
            for layout in layouts_for(xp):
                back = mapping.backward(mapping(laid_out(x, layout, xp), group, **options),
                                        group, **options)
                check.equal(back, x, f"{case} {dtype} {shape} {layout}")
    check.done()


@pytest.fixture(scope="module")
def solo() -> Any:
    """A group of one rank on every rank."""
    group = Mesh(WORLD, {"one": 1, "rest": WORLD.size}).group("one")
    yield group
    group.free()


@pytest.mark.mpi(min_size=1)
def test_size_one_group_returns_the_input_object(solo):
    x = np.ones((3, 4))
    ok = []
    for case, (name, *_rest) in CASES.items():
        mapping = getattr(mappings, name)
        ok.append(mapping(x, solo) is x and mapping.backward(x, solo) is x)
        out = np.empty_like(x)
        ok.append(mapping(x, solo, out=out) is out and np.array_equal(out, x))
    agree(all(ok), "a mapping on a group of one rank copied its input")


@pytest.mark.mpi(min_size=1)
def test_default_group_is_the_current_tp_or_cp_group():
    manager.destroy_parallel()
    x = np.arange(24.0).reshape(4, 2, 3)
    raises_everywhere(RuntimeError, "gather_from_sequence needs a tensor-parallel group.*initialize_parallel", mappings.gather_from_sequence, x)
    world = WORLD.size
    layouts = [(world, 1), (1, world)] + ([(2, world // 2)] if world % 2 == 0 and world > 2 else [])
    check = Checks()
    try:
        for tp, cp in layouts:
            state = manager.initialize_parallel(tp, cp)
            for name in ("gather_from_sequence", "scatter_to_hidden", "copy_to_all",
                         "reduce_scatter_to_sequence"):
                m = getattr(mappings, name)
                check.equal(m(x), to_numpy(m(x, state.tensor)), f"{name} tp={tp}")
                check.equal(m.backward(x), to_numpy(m.backward(x, state.tensor)),
                            f"{name}.backward tp={tp}")
            a2a = mappings.all_to_all_from_sequence_to_hidden
            check.equal(a2a(x), to_numpy(a2a(x, state.context)), f"a2a cp={cp}")
            manager.destroy_parallel()
    finally:
        manager.destroy_parallel()
    check.done()


@pytest.mark.mpi(min_size=1)
def test_unknown_option_is_a_type_error(group):
    x = np.zeros((4, 4))
    if group.size > 1:
        raises_everywhere(TypeError, "takes no global_size", mappings.copy_to_all, x, group,
                          global_size=4)
        raises_everywhere(TypeError, "takes no global_size",
                          mappings.gather_from_sequence.backward, x, group, global_size=4)
        raises_everywhere(TypeError, "keyword", mappings.gather_from_sequence.backward,
                          x, group, sizes=4)
        raises_everywhere(TypeError, "keyword", mappings.all_to_all_from_sequence_to_hidden,
                          x, group, axis=0)


@pytest.mark.mpi(min_size=1)
def test_old_size_keyword_still_works_with_a_deprecation_warning(group):
    p, r = group.size, group.rank
    full = np.arange(float(3 * p + 1) * 2).reshape(3 * p + 1, 2)
    mine = piece(full, p, 0, r)
    with pytest.warns(DeprecationWarning, match="global_size"):
        old = mappings.gather_from_sequence(mine, group, size=full.shape[0])
    new = mappings.gather_from_sequence(mine, group, global_size=full.shape[0])
    agree(np.array_equal(old, full) and np.array_equal(new, full), "size= and global_size= differ")


@pytest.mark.mpi(min_size=1)
def test_label_names_collectives_in_stats(group):
    x = np.ones((2, 3))
    with stats.record() as rec, collectives.label("MyLayer.backward"):
        group.all_reduce(x)
        mappings.reduce_from_all(x, group)
    names = {op for (_, op) in rec.rows}
    expected = {"MyLayer.backward:all_reduce", "reduce_from_all.forward"} if group.size > 1 else set()
    agree(names >= expected, f"recorded {names}")


# --------------------------------------------------------------------------- not arrays


class ArrayLike:
    """An object NumPy could convert (``__array__``, ``shape``, ``dtype``), as a torch tensor."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def __array__(self, dtype=None, copy=None):
        return self.a


@pytest.mark.mpi(min_size=1)
def test_non_arrays_are_type_errors_in_both_directions(group):
    # On every group size: a step that communicates nothing (copy_to_all's forward,
    # scatter_to_hidden's) or a group of one rank would return a list as it is.
    x = np.ones((4, 4))
    for name in ("copy_to_all", "reduce_from_all", "scatter_to_hidden", "gather_from_sequence"):
        mapping = getattr(mappings, name)
        for direction, call in (("forward", mapping), ("backward", mapping.backward)):
            for wrong in (x.tolist(), ArrayLike(x), None):
                raises_everywhere(TypeError, rf"{name}.{direction}: x must be a numpy.ndarray "
                                  rf"or cupy.ndarray, not {type(wrong).__name__}", call, wrong,
                                  group)


@pytest.mark.mpi(min_size=1)
def test_a_group_name_is_a_type_error(group):
    raises_everywhere(TypeError, "gather_from_sequence: group must be a pympar Group or None, "
                      "not str 'tp'", mappings.gather_from_sequence, np.ones((2, 2)), "tp")
    raises_everywhere(TypeError, "copy_to_all: group must be a pympar Group or None, not str",
                      mappings.copy_to_all.backward, np.ones((2, 2)), group.name)


@pytest.mark.mpi(min_size=1)
def test_a_layer_refuses_a_non_array_input(group):
    # Layers share one input check (modules.core.check_array); ArrayLike has shape and
    # dtype but is no array.
    layer = ColumnParallelLinear(4, 2 * group.size, gather_output=True, group=group,
                                 dtype=np.float64)
    for wrong in (np.ones((3, 4)).tolist(), ArrayLike(np.ones((3, 4)))):
        raises_everywhere(TypeError, rf"ColumnParallelLinear\(.*\): expected a numpy.ndarray or "
                          rf"cupy.ndarray as input, got {type(wrong).__name__}", layer.forward,
                          wrong)


@pytest.mark.mpi(min_size=2)
def test_keywords_one_rank_gets_wrong_raise_on_every_rank(group):
    """A keyword refused on one rank before any message: the others raise too, not wait."""
    odd = group.rank == 1
    x = np.ones((2 * group.size, 3))
    raises_everywhere(debug.CollectiveMismatchError if group.size > 1 else TypeError,
                      "gathers nothing: it takes no global_size=", mappings.copy_to_all.backward,
                      x, group, global_size=7 if odd else None)
    call = (lambda: mappings.reduce_from_all(x, group, seq_axis=0)) if odd else \
        (lambda: mappings.reduce_from_all(x, group))
    raises_everywhere(debug.CollectiveMismatchError,
                      "reduce_from_all.forward takes no keyword seq_axis", call)
    # The same mistake on every rank: each raises the plain error.
    raises_everywhere(TypeError, "reduce_scatter_to_sequence.forward gathers nothing",
                      mappings.reduce_scatter_to_sequence, x, group, global_size=2)
    agree(np.array_equal(mappings.reduce_from_all(x, group), x * group.size), "in step after")


@pytest.mark.mpi(min_size=2)
def test_steps_that_send_nothing_check_out():
    """copy_to_all and the block a scatter keeps write into an out of their result's shape
    and dtype only: never broadcast into a larger one or cast into an integer one."""
    group = Mesh(WORLD, {"x": WORLD.size}).group("x")
    x = np.full((2, 4), 0.5)
    cols = collectives.block_slice(4, group.size, group.rank)
    block = (2, cols.stop - cols.start)
    for call, wrong in ((mappings.copy_to_all, np.zeros((3, 2, 4))),
                        (mappings.copy_to_all, np.zeros((2, 4), np.int64)),
                        (mappings.scatter_to_hidden, np.zeros((3,) + block)),
                        (mappings.scatter_to_hidden, np.zeros(block, np.int64))):
        raises_everywhere(ValueError, "out is a ndarray of shape", call, x, group, out=wrong)
    agree(np.array_equal(mappings.scatter_to_hidden(x, group, out=np.empty(block)),
                         x[:, cols]), "the kept block")
    group.free()


@pytest.mark.mpi(min_size=1)
def test_a_group_of_one_checks_what_a_larger_group_would(solo):
    """On one rank the mapping returns its input, but the call is still checked."""
    x = np.ones((3, 4))
    raises_everywhere(ValueError, "global_size=99 is not the extent of axis 0",
                      mappings.gather_from_sequence, x, solo, global_size=99)
    agree(mappings.gather_from_sequence(x, solo, global_size=3) is x, "the input itself")
    raises_everywhere(ValueError, "global_size=5 is not the extent of axis -1",
                      mappings.scatter_to_hidden.backward, x, solo, global_size=5)
    raises_everywhere(TypeError, "copy_to_all.forward takes no keyword seq_axis",
                      mappings.copy_to_all, x, solo, seq_axis=0)
    raises_everywhere(ValueError, "out is a ndarray of shape \\(5,\\)", mappings.reduce_from_all,
                      x, solo, out=np.empty(5))
