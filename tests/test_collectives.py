"""Group collectives on real MPI ranks against NumPy references built on every rank.

Every rank generates the same global data from a fixed seed and slices its own
piece with ``numpy.array_split``; results are compared bitwise for data
movement and to a dtype tolerance for sums. Each test collects its failures
locally and agrees once at the end, so one bad rank fails every rank.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from collective_helpers import (DTYPES, Checks, dtypes_for, laid_out, layouts_for, piece,
                                random, split_sizes)
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere, to_numpy
from pympar import backend, collectives, debug
from pympar.debug import CollectiveMismatchError
from pympar.mesh import Mesh

# --------------------------------------------------------------------------- all_reduce


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_all_reduce(xp, group, op):
    p, r = group.size, group.rank
    rng = np.random.default_rng(11)
    check = Checks()
    reduce = {"sum": np.sum, "max": np.max, "min": np.min}[op]
    for dtype in dtypes_for(xp):
        for shape in [(5, 3), (4, 1, 6), ()]:
            inputs = [random(rng, shape, dtype) for _ in range(p)]
            exact = reduce(np.stack([a.astype(np.float64) for a in inputs]), axis=0)
            expected = np.asarray(exact).astype(dtype)
            for layout in layouts_for(xp):
                x = laid_out(inputs[r], layout, xp)
                before = to_numpy(x).copy()
                what = f"{op} {dtype} {shape} {layout}"
                check.close(group.all_reduce(x, op=op), expected, what)
                check.equal(x, before, what + " leaves x alone")
                out = xp.empty(shape, dtype)
                y = group.all_reduce(x, op, out=out)
                check.true(y is out, what + " returns out")
                check.close(out, expected, what + " out=")
                inplace = laid_out(inputs[r], layout, xp)
                y = group.all_reduce(inplace, op, out=inplace)
                check.true(y is inplace, what + " in place returns x")
                check.close(inplace, expected, what + " in place")
    check.done()


@pytest.mark.mpi(min_size=1)
def test_all_reduce_into_noncontiguous_out_and_module_types(xp, group):
    p, r = group.size, group.rank
    rng = np.random.default_rng(12)
    inputs = [random(rng, (4, 5), np.float64) for _ in range(p)]
    expected = np.sum(inputs, axis=0)
    check = Checks()
    out = laid_out(np.zeros((4, 5)), "strided", xp)
    y = group.all_reduce(xp.asarray(inputs[r]), out=out)
    check.true(y is out, "returns the strided out")
    check.close(out, expected, "strided out")
    result = group.all_reduce(xp.asarray(inputs[r]))
    check.true(type(result) is type(xp.asarray(inputs[r])), "same array module")
    check.true(result.flags.c_contiguous, "C-contiguous result")
    check.done()


# --------------------------------------------------------------------------- all_gather


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_balanced(xp, group, axis):
    p, r = group.size, group.rank
    rng = np.random.default_rng(21)
    check = Checks()
    for dtype in dtypes_for(xp):
        for shape in [(2 * p, 3, 2 * p), (2 * p + 1, 2, 2 * p + 3), (p - 1 or 1, 1, 3)]:
            full = random(rng, shape, dtype)
            mine = piece(full, p, axis, r)
            n = shape[axis]
            for layout in layouts_for(xp):
                x = laid_out(mine, layout, xp)
                what = f"{dtype} {shape} axis {axis} {layout}"
                check.equal(group.all_gather(x, axis), full, what)
                out = xp.empty(shape, dtype)
                y = group.all_gather(x, axis, out=out, sizes=split_sizes(n, p))
                check.true(y is out, what + " returns out")
                check.equal(out, full, what + " sizes= out=")
    check.done()


@pytest.mark.mpi(min_size=1)
def test_all_gather_arbitrary_sizes_and_strided_out(xp, group):
    p, r = group.size, group.rank
    rng = np.random.default_rng(22)
    check = Checks()
    sizes = [(q * 2 + 1) % 4 for q in range(p)]  # not the balanced rule, zeros included
    for axis in (0, 1, 2):
        blocks = []
        for q in range(p):
            shape = [3, 2, 4]
            shape[axis] = sizes[q]
            blocks.append(random(rng, tuple(shape), np.float32))
        full = np.concatenate(blocks, axis=axis)
        x = laid_out(blocks[r], "F", xp)
        check.equal(group.all_gather(x, axis), full, f"agreed sizes axis {axis}")
        check.equal(group.all_gather(x, axis, sizes=sizes), full, f"given sizes axis {axis}")
        out = laid_out(np.zeros(full.shape, np.float32), "strided", xp)
        check.true(group.all_gather(x, axis, out=out) is out, "returns strided out")
        check.equal(out, full, f"strided out axis {axis}")
    check.done()


# --------------------------------------------------------------------------- reduce_scatter


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_reduce_scatter(xp, group, axis):
    p, r = group.size, group.rank
    rng = np.random.default_rng(31)
    check = Checks()
    for dtype in dtypes_for(xp):
        for shape in [(2 * p, 3, 2 * p), (2 * p + 1, 2, p + 2), (1, 1, 1)]:
            inputs = [random(rng, shape, dtype) for _ in range(p)]
            total = np.sum([a.astype(np.float64) for a in inputs], axis=0).astype(dtype)
            expected = piece(total, p, axis, r)
            for layout in layouts_for(xp):
                x = laid_out(inputs[r], layout, xp)
                what = f"{dtype} {shape} axis {axis} {layout}"
                check.close(group.reduce_scatter(x, axis), expected, what)
                out = laid_out(np.zeros(expected.shape, dtype), layout, xp)
                check.true(group.reduce_scatter(x, axis, out=out) is out, what + " returns out")
                check.close(out, expected, what + " out=")
            check.close(group.reduce_scatter(xp.asarray(inputs[r]), axis, op="max"),
                        piece(np.max(inputs, axis=0), p, axis, r), f"{dtype} {shape} max")
    check.done()


# --------------------------------------------------------------------------- all_to_all


@pytest.mark.mpi(min_size=1)
def test_hidden_axis_blocks_through_large_scratch(group):
    """Scratch buffers of 8 MiB and more carry the right data."""
    p, r = group.size, group.rank
    rng = np.random.default_rng(7)
    full = [random(rng, (256, 8192), np.dtype(np.float32)) for _ in range(p)]  # 8 MiB each
    expected = np.array_split(np.sum(full, axis=0, dtype=np.float64), p, axis=-1)[r]
    got = group.reduce_scatter(full[r], axis=-1)
    assert_close(got, expected, rtol=1e-5, atol=1e-5, what="reduce_scatter axis -1")
    blocks = [np.ascontiguousarray(a[:, :4096]) for a in full]
    assert_equal(group.all_gather(blocks[r], axis=-1, sizes=(4096,) * p),
                 np.concatenate(blocks, axis=-1), "all_gather axis -1")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("split_axis,concat_axis", [(1, 0), (0, 1), (2, 0), (0, 2), (-1, 1)])
def test_all_to_all_and_round_trip(xp, group, split_axis, concat_axis):
    p, r = group.size, group.rank
    rng = np.random.default_rng(41)
    check = Checks()
    for dtype in dtypes_for(xp):
        for shape in [(2 * p, 2 * p, 2 * p), (2 * p + 1, p + 2, 2 * p + 3), (p - 1 or 1, 3, 1)]:
            full = random(rng, shape, dtype)
            # Rank r holds block r along concat_axis; afterwards block r along split_axis.
            mine = piece(full, p, concat_axis, r)
            expected = piece(full, p, split_axis, r)
            n = shape[concat_axis]
            for layout in layouts_for(xp):
                x = laid_out(mine, layout, xp)
                what = f"{dtype} {shape} split {split_axis} concat {concat_axis} {layout}"
                y = group.all_to_all(x, split_axis, concat_axis)
                check.equal(y, expected, what)
                out = xp.empty(expected.shape, dtype)
                check.true(group.all_to_all(x, split_axis, concat_axis, out=out,
                                            sizes=split_sizes(n, p)) is out, what + " out")
                check.equal(out, expected, what + " sizes= out=")
                back = group.all_to_all(y, concat_axis, split_axis,
                                        sizes=split_sizes(shape[split_axis], p))
                check.equal(back, mine, what + " round trip")
    check.done()


# --------------------------------------------------------------------------- broadcast


@pytest.mark.mpi(min_size=1)
def test_broadcast(xp, group):
    p, r = group.size, group.rank
    rng = np.random.default_rng(51)
    check = Checks()
    for dtype in dtypes_for(xp):
        for root in sorted({0, p - 1}):
            inputs = [random(rng, (3, 4), dtype) for _ in range(p)]
            for layout in layouts_for(xp):
                x = laid_out(inputs[r], layout, xp)
                what = f"{dtype} root {root} {layout}"
                check.equal(group.broadcast(x, root=root), inputs[root], what)
                check.equal(x, inputs[r], what + " leaves x alone")
                y = group.broadcast(x, root, out=x)
                check.true(y is x, what + " in place returns x")
                check.equal(x, inputs[root], what + " in place")
    check.done()


# --------------------------------------------------------------------------- errors, limits


@pytest.mark.mpi(min_size=1)
def test_argument_errors_raise_on_every_rank(group):
    x = np.zeros((4, 3))
    raises_everywhere(ValueError, "op must be one of", group.all_reduce, x, op="prod")
    raises_everywhere(ValueError, "op must be one of", group.reduce_scatter, x, op=None)
    raises_everywhere(ValueError, "out is a ndarray of shape", group.all_reduce, x,
                      out=np.zeros((3, 4)))
    raises_everywhere(TypeError, "out is a list", group.all_reduce, x, out=[0.0])
    raises_everywhere(ValueError, "axis 3 is out of range", group.all_gather, x, 3)
    raises_everywhere(TypeError, "axis must be an int, not str", group.reduce_scatter, x, "0")
    raises_everywhere(ValueError, "sizes", group.all_gather, x, 0,
                      sizes=[4] * (group.size + 1))
    raises_everywhere(ValueError, "must differ", group.all_to_all, x, 1, -1)
    raises_everywhere(ValueError, "root", group.broadcast, x, root=group.size)
    raises_everywhere(TypeError, "root must be an int", group.broadcast, x, root=0.5)
    raises_everywhere(ValueError, "at least one dimension", group.all_gather, np.float64(1.0))
    raises_everywhere(TypeError, "x must be a numpy.ndarray or cupy.ndarray, not list",
                      group.all_reduce, [1.0, 2.0])
    if group.size > 1:
        # Without sizes= the ranks agree on extents, and on the other dims on the way.
        ragged = np.zeros((2, 3 + (group.rank == 1)))
        raises_everywhere(CollectiveMismatchError, r"rank 1 \(global \d+\): all_gather", group.all_gather,
                          ragged, 0)
        raises_everywhere(CollectiveMismatchError, "all_to_all", group.all_to_all,
                          ragged.T.copy(), 0, 1)


@pytest.mark.mpi(min_size=2)
def test_an_out_refused_on_one_rank_raises_on_every_rank(group):
    """A call whose out= one rank refuses: every rank raises, none waits in MPI."""
    if group.size < 2:
        pytest.skip("needs a group of at least 2 ranks")
    p, r = group.size, group.rank
    n = 3
    x = np.ones((p, n))
    wrong = r == p - 1
    mine = len(np.array_split(np.empty(n), p)[r])
    calls = {"all_reduce": (lambda out: group.all_reduce(x, out=out), (p, n)),
             "reduce_scatter": (lambda out: group.reduce_scatter(x, 1, out=out), (p, mine)),
             "all_gather": (lambda out: group.all_gather(x, 0, out=out, sizes=(p,) * p),
                            (p * p, n)),
             "all_to_all": (lambda out: group.all_to_all(x, 1, 0, out=out, sizes=(p,) * p),
                            (p * p, mine)),
             "broadcast": (lambda out: group.broadcast(x, out=out), (p, n))}
    for name, (call, shape) in calls.items():
        out = np.empty((shape[0] + wrong,) + shape[1:])
        raises_everywhere(CollectiveMismatchError, f"{name}.*does not fit", call, out)
    # The same mistake on every rank is every rank's own error; the group stays usable.
    raises_everywhere(ValueError, "out is a ndarray", group.all_reduce, x, out=np.empty(3))
    agree(np.array_equal(group.all_reduce(x), np.full_like(x, p)), "sum after the errors")


@pytest.mark.mpi(min_size=1)
def test_dtypes_mpi_cannot_reduce_or_move_are_refused(group):
    c = np.ones(4, np.complex128)
    raises_everywhere(TypeError, "op='max' is not defined for complex", group.all_reduce, c, "max")
    raises_everywhere(TypeError, "op='min' is not defined for complex", group.reduce_scatter,
                      np.ones((group.size, 2), np.complex64), 0, None, "min")
    pair = np.zeros(4, [("a", np.float64), ("b", np.int32)])
    raises_everywhere(TypeError, "not dtype", group.all_gather, pair)
    raises_everywhere(TypeError, "not dtype object", group.broadcast, np.array([None, 1]))
    # Complex sums are fine.
    total = group.all_reduce(np.full(3, 1 + 2j))
    agree(np.array_equal(total, np.full(3, group.size * (1 + 2j))), str(total))


@pytest.mark.mpi(min_size=1)
def test_bool_reductions_follow_numpy_and_byte_order_is_normalized(group):
    p, r = group.size, group.rank
    rng = np.random.default_rng(61)
    flags = rng.random((p, 3, 5)) < 0.3
    values = rng.standard_normal((p, 6, 2))
    check = Checks()
    for op, ufunc in (("sum", np.logical_or), ("max", np.maximum), ("min", np.minimum)):
        check.equal(group.all_reduce(flags[r], op), ufunc.reduce(flags, axis=0), f"bool {op}")
    for order in (">", "<"):
        x = values[r].astype(np.dtype(np.float64).newbyteorder(order))
        check.close(group.all_reduce(x), values.sum(axis=0), f"all_reduce {order}f8")
        check.equal(group.all_gather(x, 1), np.concatenate(list(values), axis=1),
                    f"all_gather {order}f8")
    check.done()


@pytest.mark.mpi(min_size=1)
def test_a_freed_group_says_so():
    group = Mesh(WORLD, {"w": WORLD.size}).group("w", key="freed")
    group.all_reduce(np.ones(2))
    group.free()
    for call in (lambda: group.all_reduce(np.ones(2)), lambda: group.all_gather(np.ones(2)),
                 lambda: group.broadcast(np.ones(2)),
                 lambda: group.all_to_all(np.ones((2, 2)), 0, 1)):
        raises_everywhere(RuntimeError, "group 'freed-.*' has been freed", call)


@pytest.mark.mpi(min_size=2)
def test_a_dtype_no_collective_moves_on_one_rank_raises_everywhere(group):
    """Without sizes=, a gather learns the extents after its check: a rank whose array MPI
    cannot move refuses in that check, and every rank raises at once."""
    x = np.array(["a"]) if group.rank == group.size - 1 else np.ones(1)
    start = time.monotonic()
    with debug.debug_mode(debug.is_enabled(), timeout=60):
        for call in (group.all_gather, lambda a: group.all_to_all(a.reshape(1, 1), 0, 1)):
            raises_everywhere(Exception, "move bool, integer, float and complex", call, x)
    agree(time.monotonic() - start < 30, "a rank waited for the watchdog")


@pytest.mark.mpi(min_size=1)
def test_counts_beyond_mpi3_int_move_in_units_or_chunks(group, monkeypatch):
    # Pretend the library is MPI-3 and int counts stop at 30 elements: every collective
    # must still give NumPy's result (derived-datatype units or several calls).
    assert collectives.large_counts_supported((4, 0))
    assert not collectives.large_counts_supported((3, 1))
    monkeypatch.setattr(collectives, "INT_MAX", 30)
    monkeypatch.setattr(collectives, "large_counts_supported", lambda version=None: False)
    group.release_buffers()
    p, r = group.size, group.rank
    rng = np.random.default_rng(71)
    check = Checks()
    full = random(rng, (4 * p + 1, 10), np.float64)  # uneven rows: units of 10 elements
    inputs = [random(rng, (4 * p, 10), np.float64) for _ in range(p)]
    check.equal(group.all_gather(piece(full, p, 0, r), 0), full, "all_gather uneven")
    even = full[:4 * p]
    check.equal(group.all_gather(piece(even, p, 0, r), 0), even, "all_gather even")
    check.close(group.all_reduce(inputs[r]), np.sum(inputs, axis=0), "all_reduce")
    check.close(group.reduce_scatter(inputs[r], 0), piece(np.sum(inputs, axis=0), p, 0, r),
                "reduce_scatter")
    check.equal(group.broadcast(inputs[r], p - 1), inputs[p - 1], "broadcast")
    big = np.concatenate(inputs, axis=1)  # (4p, 10p): rank r holds column block r
    check.equal(group.all_to_all(inputs[r], 0, 1), piece(big, p, 0, r), "all_to_all")
    # reduce_scatter in pieces checks out as the plan of smaller counts does
    block = piece(np.sum(inputs, axis=0), p, 0, r)
    out = np.empty_like(block)
    check.close(group.reduce_scatter(inputs[r], 0, out=out), block, "reduce_scatter into out")
    group.release_buffers()
    check.done()
    if p > 1:
        last = r == p - 1
        for wrong in (np.empty(block.shape, np.int8 if last else np.float64),
                      np.empty((block.shape[0] + last, 10))):
            raises_everywhere(Exception, "out is a ndarray", group.reduce_scatter, inputs[r], 0,
                              out=wrong)


@pytest.mark.mpi(min_size=1)
def test_mpi_datatypes_are_predefined():
    # MPICH refuses built-in reductions on duplicated datatypes, which is what
    # mpi4py.util.dtlib returns even for plain numeric dtypes.
    for dtype in DTYPES + [np.dtype(t) for t in (np.int8, np.int32, np.int64, np.uint16,
                                                 np.complex64, np.complex128, np.bool_)]:
        datatype = backend.mpi_datatype(dtype)
        assert datatype.is_predefined, dtype
        assert datatype.Get_size() == backend.wire_dtype(dtype).itemsize, dtype
    # Types without a predefined datatype still get dtlib's (the collectives refuse them),
    # committed: a halo moves them.
    pair = np.dtype([("a", np.float64), ("b", np.int32)])
    datatype = backend.mpi_datatype(pair)
    assert datatype.Get_size() == pair.itemsize
    sent, received = np.array([(1.5, 2), (3.5, 4)], pair), np.zeros(2, pair)
    MPI.COMM_SELF.Sendrecv([sent, datatype], 0, 0, [received, datatype], 0, 0)
    assert received.tolist() == sent.tolist()
    with pytest.raises(TypeError, match="cannot send arrays of dtype object"):
        backend.mpi_datatype(np.dtype(object))
