"""Halo exchange against slices of the gathered field, its adjoint, and its errors.

The reference is the whole field padded by ``numpy.pad`` (``wrap`` along periodic axes,
zeros elsewhere, axis after axis, so corners are as a stencil sees them), cut at the blocks
``numpy.array_split`` gives. Layouts: one axis split over every rank, the second axis split
over every rank (strided faces), and two axes split over a grid of ranks.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import XPS, block, get_xp
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere, to_numpy
from pympar import Mesh, stats
from pympar.collectives import label
from pympar.debug import CollectiveMismatchError
from pympar.errors import PeerEndedError
from pympar.decomposition import Decomposition
from pympar.halo import HaloExchange
from pympar import _halo_plan, _halo_tuning

P = WORLD.Get_size()
PX = 2 if P % 2 == 0 else 1
PY = P // PX
LAYOUTS = ["axis0", "axis1", "grid"]
FACES = ["auto", "subarray", "packed"]
#: Exchanges of a plan after which faces="auto" has settled how its faces travel.
TRIAL_CALLS = 2 * (_halo_tuning.ROUNDS + 1)
PERIODIC = [pytest.param((False, False), id="walls"), pytest.param((True, True), id="torus"),
            pytest.param((True, False), id="channel")]


@pytest.fixture(scope="module")
def mesh():
    """A PX x PY grid of the world's ranks and its groups (x, y and both)."""
    m = Mesh(None, {"x": PX, "y": PY}, order="x-y")
    groups = {"x": m.group("x"), "y": m.group("y"), "xy": m.group("x", "y")}
    yield groups
    for g in groups.values():
        g.free()


def raises_around_rank0(halo: HaloExchange, own: type, match: str, func, *args):
    """``func(*args)`` where rank 0's call differs: rank 0 raises ``own``, the neighbours it
    checks with a mismatch matching ``match``; the ranks beyond raise a mismatch spread
    along a later axis, PeerEndedError (a neighbour that raised told them), or return."""
    caught = None
    try:
        func(*args)
    except Exception as err:  # noqa: BLE001 - inspected below
        caught = err
    near = any(group.ranks[r] == 0 for _, group, board in halo._checks
               for r in board.neighbours)
    if WORLD.rank == 0:
        ok = isinstance(caught, own) and match in str(caught)
    elif near:
        ok = isinstance(caught, CollectiveMismatchError) and match in str(caught)
    else:
        ok = caught is None or isinstance(caught, (PeerEndedError, CollectiveMismatchError))
    agree(ok, f"rank {WORLD.rank} ({'near' if near else 'beyond'}): {caught!r}")
    return caught


def split(mesh, layout: str) -> dict:
    """The groups of a layout, by field axis."""
    return {"axis0": {0: mesh["xy"]}, "axis1": {1: mesh["xy"]},
            "grid": {0: mesh["x"], 1: mesh["y"]}}[layout]


def padded_reference(full: np.ndarray, widths, periodic) -> np.ndarray:
    """``full`` padded along its trailing axes: wrapped where periodic, zeros elsewhere."""
    lead = full.ndim - len(widths)
    for a, (w, p) in enumerate(zip(widths, periodic)):
        pad = [(0, 0)] * full.ndim
        pad[lead + a] = w
        full = np.pad(full, pad, mode="wrap" if p else "constant")
    return full


def my_padded_block(reference: np.ndarray, d: Decomposition, widths) -> np.ndarray:
    """This rank's padded block cut from the padded reference (array_split's blocks)."""
    index = []
    for n, parts, coord, (lo, hi) in zip(d.global_shape, d.parts, d.coords, widths):
        b = block(n, parts, coord)
        index.append(slice(b.start, b.stop + lo + hi))
    return reference[(Ellipsis, *index)]


def field(shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("faces", FACES)
@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape, width", [((16, 24), 1),                  # even (2, 4, 8 ranks)
                                          ((19, 17), ((2, 1), (1, 2)))])  # uneven, lopsided
def test_ghosts_are_slices_of_the_gathered_field(mesh, layout, periodic, faces, shape, width,
                                                 xp_name):
    xp = get_xp(xp_name)
    d = Decomposition(shape, split(mesh, layout), periodic)
    halo = HaloExchange(d, width, faces=faces)
    full = field((2, *shape))  # one leading (channel) axis, held whole
    expected = my_padded_block(padded_reference(full, halo.widths, periodic), d, halo.widths)
    x = xp.asarray(d.take(full))
    y = halo.forward(x)
    assert_equal(y, expected, "forward")
    # In place: the same ghosts; where a non-periodic field ends they are left as they were.
    padded = xp.full((2, *halo.padded_shape), -7.0)
    halo.inner(padded)[...] = x
    halo.exchange(padded)
    keep = to_numpy(halo.forward(xp.ones_like(x))) != 0  # inside the field
    outer = to_numpy(padded)[~keep]
    assert_equal(to_numpy(padded)[keep], expected[keep], "exchange")
    agree(bool((outer == -7).all()), "outer ghosts of exchange were written")
    # Reused out= gives the same, calls again.
    out = xp.empty_like(y)
    assert_equal(halo.forward(x, out=out), expected, "forward(out=)")
    halo.free()


@pytest.mark.parametrize("faces", FACES)
@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adjoint_is_exact(mesh, layout, periodic, faces):
    """<H x, y> = <x, H* y> summed over ranks, and H* y equals the serial scatter-add."""
    shape, width = (19, 17), ((2, 1), (1, 2))
    d = Decomposition(shape, split(mesh, layout), periodic)
    halo = HaloExchange(d, width, faces=faces)
    rng = np.random.default_rng(100 + WORLD.rank)
    x = rng.standard_normal((3, *d.local_shape))
    y = rng.standard_normal((3, *halo.padded_shape))
    hx, hty = halo.forward(x), halo.backward(y)
    lhs, rhs = (WORLD.allreduce(float(np.vdot(a, b))) for a, b in ((hx, y), (x, hty)))
    agree(abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), f"<Hx,y>={lhs!r} <x,H*y>={rhs!r}")
    # The serial adjoint: every padded cell's value added to the global cell it copies.
    total = np.zeros((3, *shape))
    index = []
    for a, (n, (lo, hi)) in enumerate(zip(shape, halo.widths)):
        cells = np.arange(d.blocks[a].start - lo, d.blocks[a].stop + hi)
        index.append(cells % n if periodic[a] else cells)
    grid = np.meshgrid(*index, indexing="ij")
    inside = np.ones(grid[0].shape, bool)
    for g, n in zip(grid, shape):
        inside &= (g >= 0) & (g < n)
    for c in range(3):
        np.add.at(total[c], tuple(g[inside] for g in grid), y[c][inside])
    total = WORLD.allreduce(total)
    assert_close(hty, d.take(total), rtol=1e-12, atol=1e-12, what="backward")
    # In place, on a copy: the same gradient.
    work = y.copy()
    assert_close(halo.adjoint(work), hty, rtol=0, atol=0, what="adjoint in place")
    halo.free()


@pytest.mark.parametrize("periodic", PERIODIC)
def test_three_dimensional_field_over_two_axes(mesh, periodic):
    """A 3-D field split along its last two axes: every edge and corner ghost is right."""
    shape = (5, 9, 10)
    d = Decomposition(shape, {1: mesh["x"], 2: mesh["y"]}, (True, *periodic))
    halo = HaloExchange(d, 1)
    full = field(shape, seed=3)
    y = halo.forward(d.take(full))
    assert_equal(y, my_padded_block(padded_reference(full, halo.widths, d.periodic), d,
                                    halo.widths), "forward")
    rng = np.random.default_rng(7 + WORLD.rank)
    x, g = rng.standard_normal(d.local_shape), rng.standard_normal(halo.padded_shape)
    lhs = WORLD.allreduce(float(np.vdot(halo.forward(x), g)))
    rhs = WORLD.allreduce(float(np.vdot(x, halo.backward(g))))
    agree(abs(lhs - rhs) <= 1e-12 * abs(lhs), f"{lhs!r} != {rhs!r}")


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.complex128])
def test_other_dtypes(mesh, dtype):
    d = Decomposition((12, 8), split(mesh, "grid"), True)
    halo = HaloExchange(d, 2)
    full = (np.arange(96).reshape(12, 8) * (1 + 1j if dtype == np.complex128 else 1)).astype(dtype)
    assert_equal(halo.forward(d.take(full)),
                 my_padded_block(padded_reference(full, halo.widths, d.periodic), d,
                                 halo.widths), "forward")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_persistent_requests_follow_the_array(mesh, layout):
    """Alternating padded arrays, a view of one (another object, the same memory) and one
    at a freed array's address: each exchange fills the ghosts of the array it was given."""
    d = Decomposition((16, 24), split(mesh, layout), (True, True))
    halo = HaloExchange(d, 1)
    fields = [field((16, 24), seed=s) for s in (1, 2)]
    expected = [my_padded_block(padded_reference(f, halo.widths, d.periodic), d, halo.widths)
                for f in fields]
    pads = [halo.empty(), halo.empty()]
    for _ in range(2):
        for pad, f, want in zip(pads, fields, expected):
            pad[...] = 0
            halo.inner(pad)[...] = d.take(f)
            assert_equal(halo.exchange(pad), want, "exchange of alternating arrays")
    view = pads[0].view()
    view[...] = 0
    halo.inner(view)[...] = d.take(fields[1])
    halo.exchange(view)
    assert_equal(pads[0], expected[1], "exchange of a view")
    for _ in range(2):  # a new array, perhaps where the last one lived
        pads = view = None
        pad = halo.empty()
        halo.inner(pad)[...] = d.take(fields[0])
        assert_equal(halo.exchange(pad), expected[0], "exchange of a new array")
    halo.free()


def test_arrays_used_in_turn_keep_their_programs(mesh):
    """Double buffering: two padded arrays exchanged in turn each keep their program, made
    once; an array that goes releases its own (the program holds its memory by address
    only), a new array gets a new one, and more arrays than a plan keeps take turns; every
    exchange fills the ghosts of the array it was given."""
    import gc

    from pympar import _halo_plan

    d = Decomposition((16, 24), split(mesh, "grid"), True)
    halo = HaloExchange(d, 1)
    fields = [field((16, 24), seed=s) for s in range(6)]
    expected = [my_padded_block(padded_reference(f, halo.widths, d.periodic), d, halo.widths)
                for f in fields]

    def exchanged(pad, k):
        pad[...] = 0
        halo.inner(pad)[...] = d.take(fields[k])
        assert_equal(halo.exchange(pad), expected[k], f"exchange of field {k}")
        return halo._last[3]

    pads = [halo.empty(), halo.empty()]
    made = []
    for step in range(4):
        plan = exchanged(pads[step % 2], step % 2)
        made.append(plan.programs[id(pads[step % 2])])
    agree(made[0] is made[2] and made[1] is made[3] and len(plan.programs) == 2,
          f"programs {made}")
    gone = made[0]
    del pads[0], made  # its program goes with it (the halo's last call was the other's)
    gc.collect()
    agree(len(plan.programs) == 1 and not gone.ops and not gone.persistent,
          f"{len(plan.programs)} programs after an array went")
    pads += [halo.empty() for _ in range(_halo_plan._PROGRAMS + 1)]
    for turn in range(2):
        for k, pad in enumerate(pads):
            exchanged(pad, k)
    agree(len(plan.programs) == _halo_plan._PROGRAMS, f"{len(plan.programs)} programs")
    halo.free()


def test_unsplit_periodic_axis_wraps_locally(mesh):
    """Along an axis nobody shares, a periodic halo is the block's own opposite face."""
    d = Decomposition((6, 8), {0: mesh["xy"]}, (False, True))
    halo = HaloExchange(d, (0, 3))
    full = field((6, 8), seed=5)
    agree(halo.exchanged == (1,), f"exchanged {halo.exchanged}")
    assert_equal(halo.forward(d.take(full)),
                 my_padded_block(padded_reference(full, halo.widths, d.periodic), d,
                                 halo.widths), "forward")


@pytest.mark.parametrize("faces", FACES)
@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_numpy_exchange_runs_its_program(mesh, layout, periodic, faces):
    """Split axes, walls, and axes a rank holds alone (the wrap: copies of planned views):
    from the second call on, an exchange of the same array is its program alone, and fills
    the ghosts as numpy.pad does, leaving those where a non-periodic field ends as they
    were."""
    d = Decomposition((16, 24), split(mesh, layout), periodic)
    halo = HaloExchange(d, 1, faces=faces)
    full = field((3, 16, 24), seed=11)
    want = my_padded_block(padded_reference(full, halo.widths, periodic), d, halo.widths)
    inside = halo.forward(np.ones((3, *d.local_shape))) != 0
    pad = halo.empty((3,))
    for call in range(TRIAL_CALLS + 2):
        pad[...] = -7.0
        halo.inner(pad)[...] = d.take(full)
        halo.exchange(pad)
        assert_equal(pad[inside], want[inside], f"exchange, call {call}")
        agree(bool((pad[~inside] == -7).all()), f"call {call}: outer ghosts were written")
        plan, ready = halo._last[3], halo._ready
        timed = plan.tuning is not None or plan.tuned is not None  # (per rank: agree once)
        agree((timed and call < TRIAL_CALLS)  # on trial: no program kept yet
              or (plan.tuning is None and ready is not None and ready[0] is pad
                  and ready[-1] is ready[5].ops), f"call {call}: the exchange left its program")
    halo.free()


@pytest.mark.skipif(P == 1, reason="needs a neighbour")
@pytest.mark.parametrize("faces", FACES)
@pytest.mark.parametrize("last", [2, 256])
def test_which_faces_go_packed(mesh, faces, last):
    """A 3-D field split along its first axis: its faces are runs of ``last`` cells (16 B,
    2 KiB). 'packed' packs them, 'subarray' sends them as datatypes, 'auto' packs runs
    shorter than this MPI's threshold and times both ways for runs from its tuning length
    on (all faces one way per call, in turn, then the faster), but for faces small enough
    to go as datatypes to a neighbour on another node (two emulated nodes); the ghosts are
    right in every call, the trial's included."""
    shape = (2 * P, 5, last)
    d = Decomposition(shape, {0: mesh["xy"]}, True)
    halo = HaloExchange(d, 1, faces=faces)
    full = field(shape, seed=14)
    want = my_padded_block(padded_reference(full, halo.widths, d.periodic), d, halo.widths)
    run, face = 8 * last, 8 * 5 * last
    off_node = set(halo._checks[0][2].remote)
    lower, upper = d.neighbours(0)
    fixed = {name: peer in off_node and face <= _halo_plan.off_node_datatype_up_to(faces)
             for name, peer in (("send_up", upper), ("recv_hi", upper),
                                ("send_down", lower), ("recv_lo", lower))}
    timed = faces == "auto" and run >= _halo_tuning.tune_from(faces)
    ways = []
    for call in range(TRIAL_CALLS + 1):
        assert_equal(halo.forward(d.take(full)), want, f"forward, call {call}")
        plan = halo._last[3]
        ways.append({name: plan.packs[0, name] for name in fixed})
    expected = {name: False if fixed[name] else
                {"packed": True, "subarray": False,
                 "auto": run < _halo_plan.pack_below(faces)}[faces] for name in fixed}
    # (one agree() per check on every rank: whether a rank's faces are timed depends on
    # where its neighbours are, and agree() is collective)
    if timed and not all(fixed.values()):
        settled = plan.tuning is None and plan.tuned in (True, False)
        expected = {name: False if fixed[name] else plan.tuned for name in fixed}
        # (the last trial call leaves the way it settled on)
        trial = [{name: False if fixed[name] else bool(call % 2) for name in fixed}
                 for call in range(TRIAL_CALLS - 1)] + [expected] * 2
        ok, said = settled and ways == trial, f"settled: {plan.tuned}, the trial's ways {ways}"
    else:
        ok = plan.tuning is None and all(w == expected for w in ways)
        said = f"no trial, packed {ways}"
    agree(ok and ways[-1] == expected, f"{faces}, runs of {run} B, neighbours on other nodes "
          f"{sorted(off_node)}: {said}, expected {expected} after it")
    halo.free()


@pytest.mark.skipif(P == 1, reason="needs a neighbour")
def test_ranks_that_settle_on_different_ways_exchange_right(mesh):
    """Each rank settles alone how its faces travel: with the even ranks' faces packed and
    the odd ranks' as datatypes (and the other way round), every ghost is right."""
    shape = (2 * P, 6, 200)  # runs of 1,600 B: timed both ways
    d = Decomposition(shape, {0: mesh["xy"]}, True)
    full = field(shape, seed=15)
    for even in (True, False):
        halo = HaloExchange(d, 1)
        want = my_padded_block(padded_reference(full, halo.widths, d.periodic), d,
                               halo.widths)
        pad = halo.empty()
        halo.inner(pad)[...] = d.take(full)
        halo.exchange(pad)
        plan = halo._last[3]
        packed = (WORLD.rank % 2 == 0) is even
        plan.tuning = None
        for key in plan.packs:
            plan.packs[key] = packed
        plan.free_requests()
        halo._ready = None  # (it held the program just freed)
        for call in range(3):
            pad[...] = -1.0
            halo.inner(pad)[...] = d.take(full)
            halo.exchange(pad)
            assert_equal(pad, want, f"even ranks packed: {even}, call {call}")
        halo.free()


def test_the_wrap_of_an_axis_held_alone_makes_no_temporary(mesh):
    """A 3-D field split along its first axis (on one rank: not at all), periodic: the two
    axes a rank holds alone wrap by copies of planned views, with no temporary array where
    NumPy's own copy of one face of an array onto another makes one."""
    import tracemalloc

    shape = (2 * P, 40, 512)
    d = Decomposition(shape, {0: mesh["xy"]}, True)
    halo = HaloExchange(d, 1)
    full = field(shape, seed=12)
    want = my_padded_block(padded_reference(full, halo.widths, d.periodic), d, halo.widths)
    pad = halo.empty()
    halo.inner(pad)[...] = d.take(full)
    for _ in range(TRIAL_CALLS + 1):  # faces="auto" settles its way (_halo_tuning)
        halo.exchange(pad)

    def grown(call) -> int:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        call()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak - before

    face = pad[:, 0, 1:-1]  # the wrap along axis 1, a row of every plane
    numpy_copy = grown(lambda: face.__setitem__(Ellipsis, pad[:, 40, 1:-1]))
    exchange = grown(lambda: halo.exchange(pad))
    agree(numpy_copy >= face.nbytes and exchange < face.nbytes // 4,
          f"bytes allocated: NumPy's copy of the face {numpy_copy}, the exchange {exchange} "
          f"(a face: {face.nbytes})")
    assert_equal(pad, want, "exchange")
    halo.free()


@pytest.mark.parametrize("shape, width", [((5, 9, 16), 2),
                                          ((3, 9, 8), ((1, 2), (2, 1), (1, 1)))])
@pytest.mark.parametrize("faces", FACES)
def test_wide_wraps_with_leading_axes(mesh, shape, width, faces):
    """Ghosts two cells wide along every axis of a field with a leading axis, split along
    its last axis only: each wrap of an axis a rank holds alone interleaves with its
    opposite face (copied in pieces), and the exchange and its adjoint stay exact."""
    if shape[2] // P < (2 if width == 2 else 1):
        pytest.skip("blocks narrower than the halo")
    d = Decomposition(shape, {2: mesh["xy"]}, True)
    halo = HaloExchange(d, width, faces=faces)
    full = field((2, *shape), seed=13)
    want = my_padded_block(padded_reference(full, halo.widths, d.periodic), d, halo.widths)
    for _ in range(2):
        assert_equal(halo.forward(d.take(full)), want, "forward")
    rng = np.random.default_rng(21 + WORLD.rank)
    x, g = rng.standard_normal((2, *d.local_shape)), rng.standard_normal((2, *halo.padded_shape))
    lhs = WORLD.allreduce(float(np.vdot(halo.forward(x), g)))
    rhs = WORLD.allreduce(float(np.vdot(x, halo.backward(g))))
    agree(abs(lhs - rhs) <= 1e-12 * abs(lhs), f"{lhs!r} != {rhs!r}")
    halo.free()


@pytest.mark.parametrize("periodic", [True, False])
def test_statistics_count_the_faces(mesh, periodic):
    """Bytes sent per axis group: 2 faces of 24 float64 each (fewer at a wall); the local
    wrap along the unsplit axis sends nothing."""
    d = Decomposition((16, 24), {0: mesh["xy"]}, periodic)
    halo = HaloExchange(d, 1)
    with stats.record() as recorder:
        halo.forward(np.zeros(d.local_shape))
        halo.backward(np.zeros(halo.padded_shape))
    faces = 2 if periodic else (WORLD.rank > 0) + (WORLD.rank < P - 1)
    want = {} if P == 1 else {
        (mesh["xy"].name, "halo.exchange"): [1, faces * 24 * 8, faces * 24 * 8],
        (mesh["xy"].name, "halo.adjoint"): [1, faces * 24 * 8, faces * 24 * 8]}
    seen = {key: row[:3] for key, row in recorder.rows.items()}
    agree(seen == want, f"stats {seen} != {want}")


# ------------------------------------------------------------------ errors, on every rank


@pytest.mark.skipif(P == 1, reason="needs a neighbour")
def test_halo_wider_than_a_neighbours_block(mesh):
    d = Decomposition((P + 1, 4), {0: mesh["xy"]})  # blocks of 2 and 1 cells
    raises_everywhere(ValueError, r"halo of 2 cells along axis 0 is wider than block \d+'s 1 "
                      r"cells", HaloExchange, d, 2)


def test_halo_wider_than_the_field_on_one_periodic_rank():
    d = Decomposition((3, 4), {}, True)
    raises_everywhere(ValueError, "wider than block 0's 3 cells", HaloExchange, d, 4)


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_groups_that_are_no_grid(mesh):
    """One group for two axes: the neighbours disagree on the other coordinate."""
    raises_everywhere(ValueError, "do not form a grid", Decomposition, (8, 8),
                      {0: mesh["xy"], 1: mesh["xy"]})


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_ranks_that_describe_different_fields(mesh):
    shape = (8, 8) if WORLD.rank else (8, 9)
    raises_everywhere(CollectiveMismatchError, "Decomposition", Decomposition, shape,
                      split(mesh, "grid"))


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_ranks_that_ask_different_widths(mesh):
    d = Decomposition((8, 8), split(mesh, "grid"))
    raises_everywhere(CollectiveMismatchError, "HaloExchange", HaloExchange, d,
                      1 if WORLD.rank else 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_array_that_does_not_fit_on_one_rank(mesh, layout):
    """Rank 0 passes a misshapen array: it raises its reason, its neighbours a mismatch
    that names it, and nobody waits for a face."""
    d = Decomposition((16, 24), split(mesh, layout), True)
    halo = HaloExchange(d, 1)
    shape = halo.padded_shape if WORLD.rank else (halo.padded_shape[0] + 1,
                                                  halo.padded_shape[1])
    raises_around_rank0(halo, ValueError, "the padded array has shape", halo.exchange,
                        np.zeros(shape))
    if P > 1:  # a wrong dtype on one rank only
        dtype = np.float64 if WORLD.rank else np.float32
        raises_around_rank0(halo, CollectiveMismatchError, "float32", halo.exchange,
                            np.zeros(halo.padded_shape, dtype))
    # The halo still works afterwards.
    full = field((16, 24), seed=9)
    assert_equal(halo.forward(d.take(full)),
                 my_padded_block(padded_reference(full, halo.widths, d.periodic), d,
                                 halo.widths), "forward after the errors")


def test_refusals_everyone_shares(mesh):
    d = Decomposition((16, 24), split(mesh, "grid"), True)
    halo = HaloExchange(d, 1)
    raises_everywhere(ValueError, "not C-contiguous", halo.exchange,
                      np.zeros(halo.padded_shape[::-1]).T)
    raises_everywhere(TypeError, "numpy.ndarray or cupy.ndarray", halo.exchange, [[0.0]])
    raises_everywhere(ValueError, r"the block has shape \(3,\)", halo.forward, np.zeros(3))
    raises_everywhere(TypeError, "must be a pympar Decomposition", HaloExchange, None)
    raises_everywhere(ValueError, "width has 3 entries", HaloExchange, d, (1, 1, 1))
    raises_everywhere(ValueError, "axis 2 is out of range", Decomposition, (4, 4),
                      {2: mesh["x"]})
    raises_everywhere(ValueError, "periodic has 3 entries", Decomposition, (4, 4), {},
                      (True, True, False))
    agree(MPI.COMM_WORLD.Get_size() == P)


def test_the_documentation_picture_shows_what_the_exchange_delivers(mesh):
    """Each rank's block filled with its block number: the ghosts hold the owners that
    scripts/draw_halo.py labels them with (walls: 0 here, -1 there)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "draw_halo.py"
    spec = importlib.util.spec_from_file_location("draw_halo", path)
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    for periodic in [(False, True), (True, False)]:
        d = Decomposition((10, 8), split(mesh, "grid"), periodic)
        halo = HaloExchange(d, 1)
        mine = np.full(d.local_shape, draw.block_id(d.coords, d.parts) + 1.0)
        want = draw.padded_owners((10, 8), d.parts, d.coords, 1, periodic) + 1
        assert_equal(halo.forward(mine), want.astype(np.float64), f"owners {periodic}")


def test_every_call_checks_with_its_neighbours_only(mesh, monkeypatch):
    """Small or large, every exchange is checked: one neighbour check per exchanged split
    axis, no check of a whole group."""
    from pympar import _board, _neighbours

    made, whole = [], []
    monkeypatch.setattr(_neighbours.NeighbourBoard, "agree", lambda self, *a,
                        real=_neighbours.NeighbourBoard.agree: made.append(a) or real(self, *a))
    for board in (_board.Board, _board.NodeBoard):
        monkeypatch.setattr(board, "agree", lambda self, *a, real=board.agree:
                            whole.append(a) or real(self, *a))
    d = Decomposition((16, 24), split(mesh, "grid"), True)
    full = field((16, 24), seed=2)
    want = my_padded_block(padded_reference(full, ((1, 1), (1, 1)), d.periodic), d,
                           ((1, 1), (1, 1)))
    halo = HaloExchange(d, 1)
    for call in range(2):  # the planned call as the first
        made.clear()
        whole.clear()
        assert_equal(halo.forward(d.take(full)), want, f"forward, call {call}")
        expected = sum(g.size > 1 for g in d.split_groups())
        agree(len(made) == expected and not whole,
              f"call {call}: {len(made)} neighbour checks, expected {expected}; "
              f"{len(whole)} checks of whole groups")


@pytest.mark.parametrize("ranks", [4, 8])
def test_a_late_rank_holds_up_only_its_neighbours(ranks):
    """A 1-D decomposition over 4 or 8 ranks whose last rank comes 300 ms late: rank 0, two
    or more ranks away, finishes its exchange within 50 ms, as with two raw Sendrecv."""
    if P < ranks:
        pytest.skip(f"needs {ranks} ranks")
    comm = WORLD.Split(0 if WORLD.rank < ranks else MPI.UNDEFINED, WORLD.rank)
    if comm == MPI.COMM_NULL:
        return
    group = Mesh(comm, {"x": ranks}, order="x").group("x")
    halo = HaloExchange(Decomposition((4 * ranks, 6), {0: group}), 1)
    pad = halo.empty()
    lower, upper = halo.decomposition.neighbours(0)
    face = np.zeros(6)

    def raw() -> None:
        comm.Sendrecv(face, upper, 7, face.copy(), lower, 7)
        comm.Sendrecv(face, lower, 8, face.copy(), upper, 8)

    taken = {}
    for name, call in (("raw", raw), ("halo", lambda: halo.exchange(pad))):
        call()  # planned, warm
        comm.Barrier()
        if comm.rank == ranks - 1:
            time.sleep(0.3)
        start = time.perf_counter()
        call()
        taken[name] = time.perf_counter() - start
    comm.Barrier()
    agree(comm.rank != 0 or taken["halo"] < taken["raw"] + 0.05,
          f"rank 0 waited {taken['halo'] * 1e3:.1f} ms in the exchange, "
          f"{taken['raw'] * 1e3:.1f} ms with raw Sendrecv", comm)
    halo.free()
    group.free()
    comm.Free()


@pytest.mark.parametrize("ranks", [4, 8])
def test_a_check_reads_the_same_words_on_any_number_of_ranks(ranks):
    """A 1-D decomposition over 4 or 8 ranks: one exchange reads two neighbours' words on
    each rank (periodic), whatever the rank count, and the group's board is not touched."""
    if P < ranks:
        pytest.skip(f"needs {ranks} ranks")
    color = 0 if WORLD.rank < ranks else MPI.UNDEFINED
    comm = WORLD.Split(color, WORLD.rank)
    if comm == MPI.COMM_NULL:
        return
    group = Mesh(comm, {"x": ranks}, order="x").group("x")
    halo = HaloExchange(Decomposition((4 * ranks, 6), {0: group}, True), 1)
    pad = halo.empty()
    board = halo._checks[0][2]
    before, count = board.words_read, group._state.board.count
    for _ in range(3):
        halo.exchange(pad)
    read = comm.allgather(board.words_read - before)
    agree(read == [6] * ranks and group._state.board.count == count,
          f"words read per rank in 3 exchanges {read}, group checks "
          f"{group._state.board.count - count}", comm)
    halo.free()
    group.free()
    comm.Free()


@pytest.mark.skipif(P == 1, reason="needs two ranks")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_known_arrays_that_differ_between_ranks(mesh, layout):
    """Two shapes every rank has exchanged before, one on rank 0 and the other elsewhere:
    rank 0 and its neighbours raise, the ranks beyond raise or return, nobody waits, and
    the next exchange is right."""
    d = Decomposition((16, 24), split(mesh, layout), True)
    halo = HaloExchange(d, 1)
    full = field((2, 16, 24), seed=4)
    want = my_padded_block(padded_reference(full, halo.widths, d.periodic), d, halo.widths)
    pads = {n: halo.empty((n,)) for n in (1, 2)}
    for n, pad in pads.items():
        halo.inner(pad)[...] = d.take(full[:n])
        assert_equal(halo.exchange(pad), want[:n], f"exchange of {n} channels")
    for _ in range(2):
        raises_around_rank0(halo, CollectiveMismatchError, "HaloExchange.exchange",
                            halo.exchange, pads[1] if WORLD.rank == 0 else pads[2])
    for n, pad in pads.items():
        pad[...] = 0
        halo.inner(pad)[...] = d.take(full[:n])
        assert_equal(halo.exchange(pad), want[:n], f"exchange of {n} channels after")
    halo.free()


@pytest.mark.skipif(P < 3, reason="needs a rank beyond the neighbours of the one that differs")
@pytest.mark.parametrize("direction", ["exchange", "adjoint"])
@pytest.mark.parametrize("faces", ["subarray", "packed"])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_rank_owed_a_face_by_a_neighbour_that_raised_raises_and_the_others_are_right(
        mesh, axis, faces, direction):
    """A line of ranks (walls), the last one's dtype differs: it and its neighbour raise the
    mismatch; the rank before them is owed a face by that neighbour and gets its poison
    instead (an empty message), so it raises PeerEndedError, whatever the MPI; every rank
    before that one got all its faces and returns them right."""
    shape = (4 * P, 6) if axis == 0 else (6, 4 * P)
    d = Decomposition(shape, {axis: mesh["xy"]})
    halo = HaloExchange(d, 1, faces=faces)
    pad = halo.empty((2,))
    pad[...] = field(pad.shape, seed=11 + mesh["xy"].rank)
    want = np.array(getattr(halo, direction)(pad.copy()))  # a run where no rank fails
    rank = mesh["xy"].rank
    caught = None
    try:
        out = getattr(halo, direction)(pad if rank < P - 1 else pad.astype(np.float32))
    except Exception as err:  # noqa: BLE001 - inspected below
        caught = err
    expected = (CollectiveMismatchError if rank >= P - 2 else
                PeerEndedError if rank == P - 3 else type(None))
    agree(type(caught) is expected, f"rank {rank}: {caught!r}, expected {expected.__name__}")
    agree(caught is not None or bool(np.array_equal(out, want)),
          f"rank {rank}: a rank that returned holds what a run without failures gives")
    halo.free()


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_the_previous_array_again_is_checked_as_it_is_now(mesh):
    """The repeated array takes the shortest path only while its shape, its direction and
    the label around the call are those of the call before: a leading axis reshaped in
    place exchanges right, and a label that differs on rank 0 raises there and on its
    neighbours."""
    d = Decomposition((16, 24), split(mesh, "grid"), True)
    halo = HaloExchange(d, 1)
    full = field((4, 16, 24), seed=6)
    want = my_padded_block(padded_reference(full, halo.widths, d.periodic), d, halo.widths)
    pad = halo.empty((4,))
    for _ in range(2):
        pad[...] = 0
        halo.inner(pad)[...] = d.take(full)
        assert_equal(halo.exchange(pad), want, "exchange of 4 channels")
    pad.shape = (2, 2, *halo.padded_shape)
    pad[...] = 0
    halo.inner(pad)[...] = d.take(full).reshape(pad[..., 1:-1, 1:-1].shape)
    assert_equal(halo.exchange(pad), want.reshape(pad.shape), "exchange of 2 x 2 channels")
    with label("steps"):
        halo.exchange(pad)
    for _ in range(2):
        with label("steps" if WORLD.rank == 0 else "others"):
            raises_around_rank0(halo, CollectiveMismatchError, "HaloExchange.exchange",
                                halo.exchange, pad)
    halo.free()


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_the_previous_array_on_a_freed_group_raises():
    """The repeated array's shortest path still finds a freed group: every rank raises
    instead of waiting in a check no other rank makes."""
    group = Mesh(WORLD, {"x": P}, order="x").group("x")
    halo = HaloExchange(Decomposition((4 * P, 6), {0: group}, True), 1)
    pad = halo.empty()
    for _ in range(2):
        halo.exchange(pad)
    group.free()
    raises_everywhere(RuntimeError, "has been freed", halo.exchange, pad)
    halo.free()


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_a_bad_width_or_shape_on_one_rank_only(mesh):
    """Refused by rank 0 alone: the others, already in the agreement, raise too."""
    d = Decomposition((8, 8), split(mesh, "grid"))
    caught = raises_everywhere(Exception, "width has 3 entries", HaloExchange, d,
                               (1, 1, 1) if WORLD.rank == 0 else 1)
    agree(isinstance(caught, ValueError if WORLD.rank == 0 else CollectiveMismatchError),
          repr(caught))
    raises_everywhere(Exception, "needs every extent >= 1", Decomposition,
                      (8, 0) if WORLD.rank == 0 else (8, 8), split(mesh, "grid"))
    # Refused before any agreement (the arguments make no field): the others raise too.
    first, grid = WORLD.rank == 0, split(mesh, "grid")
    raises_everywhere(Exception, "needs int extents", Decomposition,
                      (8.0 if first else 8, 8), grid)
    raises_everywhere(Exception, "axis 5 is out of range", Decomposition, (8, 8),
                      {5 if first else 0: grid[0], 1: grid[1]})
    raises_everywhere(Exception, "is given twice", Decomposition, (8, 8),
                      {**grid, -1: grid[1]} if first else grid)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_a_call_writes_must_be_writable_and_fit_on_every_rank(mesh, layout):
    """Rank 0 alone passes a read-only array to a call that writes it, or an out of
    another shape or dtype to backward, or another byte order: it raises its reason, its
    neighbours the mismatch naming it (the bytes would move as they are)."""
    d = Decomposition((16, 24), split(mesh, layout), True)
    halo = HaloExchange(d, 1)
    first = WORLD.rank == 0

    def padded(read_only: bool = False, order: str = "=") -> np.ndarray:
        a = np.zeros(halo.padded_shape, np.dtype(np.float64).newbyteorder(order))
        a.flags.writeable = not (read_only and first)
        return a

    raises_around_rank0(halo, ValueError, "is read-only", halo.exchange, padded(True))
    raises_around_rank0(halo, ValueError, "is read-only", halo.adjoint, padded(True))
    raises_around_rank0(halo, ValueError, "is read-only", halo.forward,
                        np.zeros(d.local_shape), padded(True))
    for out in (np.zeros(d.local_shape, np.int32), np.zeros((1, *d.local_shape)),
                np.zeros((d.local_shape[0] + 1, d.local_shape[1]))):
        raises_around_rank0(halo, ValueError, "out", halo.backward, padded(),
                            out if first else np.zeros(d.local_shape))
    if P > 1:
        raises_around_rank0(halo, CollectiveMismatchError, ">f8", halo.forward,
                            np.zeros(d.local_shape, ">f8" if first else "<f8"))
    # Big-endian on every rank moves right.
    full = field((16, 24), seed=4)
    assert_equal(halo.forward(d.take(full).astype(">f8")).astype(np.float64),
                 my_padded_block(padded_reference(full, halo.widths, d.periodic), d,
                                 halo.widths), "a big-endian field")


@pytest.mark.skipif(P == 1, reason="needs two ranks")
def test_a_field_split_another_way_than_the_group(mesh):
    """Blocks cut for twice the ranks: every rank refuses, naming its expected block."""
    d = Decomposition((16, 24), {0: mesh["xy"]})
    halo = HaloExchange(d, 1)
    wrong = np.array_split(np.zeros((16, 24)), 2 * P)[WORLD.rank]
    raises_everywhere(ValueError, r"expected \(\*leading, \*\(\d+, 24\)\), this rank's block of "
                      r"\(16, 24\) split \(\d+, 1\) ways", halo.forward, wrong)
