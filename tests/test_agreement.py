"""The agreement check on both of its paths: shared memory (a group on one node) and messages.

A group whose ranks share a node checks through a shared-memory board
(:mod:`pympar._board`); ``pympar._board.SHARED = False`` while a group is created
forces the Iallgather that groups across nodes use. Both must give the same verdicts,
raise the same timeout, and keep a long run of correct calls in step.
"""

from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere
from pympar import _board, collectives, debug, manager, mappings
from pympar.debug import CollectiveMismatchError, CollectiveTimeoutError, debug_mode
from pympar.group import Group
from pympar.errors import where as named
from pympar.mesh import Mesh

PATHS = ("shared", "messages")


@pytest.fixture(scope="module")
def one_node() -> bool:
    """Whether every rank shares a node (collective: every rank runs the same tests)."""
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    together = node.Get_size() == WORLD.Get_size()
    node.Free()
    return together


def make_group(path: str, key: str) -> Group:
    """A world group checking through ``path`` (collective)."""
    saved = _board.SHARED
    _board.SHARED = path == "shared"
    try:
        group = Mesh(WORLD, {"w": WORLD.size}).group("w", key=key)
    finally:
        _board.SHARED = saved
    return group


@pytest.fixture(params=PATHS)
def group(request: pytest.FixtureRequest, one_node: bool) -> Iterator[Group]:
    g = make_group(request.param, request.param)
    yield g
    g.free()
    agree(g.freed, "free releases the group")
    g.free()  # idempotent


@pytest.fixture(autouse=True)
def switches_off() -> Iterator[None]:
    debug.disable()
    debug.set_timeout(None)
    yield
    debug.disable()
    debug.set_timeout(None)


@pytest.mark.mpi(min_size=2)
def test_both_paths_give_the_same_verdicts(group):
    odd = group.rank == 1
    p = group.size
    x = np.arange(6.0).reshape(2, 3)
    raises_everywhere(CollectiveMismatchError, "dtype=int32", group.all_reduce,
                      x.astype(np.int32 if odd else np.float32))
    raises_everywhere(CollectiveMismatchError, "root=1", group.broadcast, x, root=int(odd))
    raises_everywhere(CollectiveMismatchError, "op='max'", group.all_reduce, x,
                      "max" if odd else "sum")
    raises_everywhere(CollectiveMismatchError, "op='min'", group.reduce_scatter,
                      np.ones((p, 3)), 0, None, "min" if odd else "sum")
    with collectives.label("layer.odd" if odd else "layer.even"):
        raises_everywhere(CollectiveMismatchError, "layer.odd", group.all_reduce, x)
    # Two mappings whose collective is the same all-reduce differ by their label.
    call = mappings.reduce_from_all if odd else mappings.copy_to_all.backward
    raises_everywhere(CollectiveMismatchError, "reduce_from_all.forward", call, x, group)
    # An out= that only rank 1 refuses: every rank raises.
    out = np.empty((3, 3) if odd else (2, 3))
    raises_everywhere(CollectiveMismatchError, "does not fit", group.all_reduce, x, "sum", out)
    # A mismatch on the last rank only, against every other rank.
    last = group.rank == p - 1
    raises_everywhere(CollectiveMismatchError, r"shape=\(3, 3\)", group.all_reduce,
                      np.ones((3 if last else 2, 3)))
    # After the mismatches the ranks are still in step: agreeing calls give NumPy's answer.
    with debug_mode(enabled=False, timeout=60.0):
        assert_close(group.all_reduce(x * (group.rank + 1)), x * (p * (p + 1) / 2),
                     what="timed sum after mismatches")
    assert_close(group.all_reduce(x * (group.rank + 1)), x * (p * (p + 1) / 2),
                 what="sum after mismatches")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
def test_a_rank_that_calls_fewer_collectives_times_out(path):
    group = make_group(path, "late-" + path)
    y = np.full(3, 2.0)
    for _ in range(3):  # calls every rank makes
        y = group.all_reduce(y) / group.size
    error, waited = None, 0.0
    if group.rank == 0:  # one call more than the others
        start = time.monotonic()
        with debug_mode(enabled=False, timeout=0.3):
            try:
                group.all_reduce(np.ones(3))
            except CollectiveTimeoutError as err:
                error = err
        waited = time.monotonic() - start
    WORLD.Barrier()
    board = group._state.board
    # Across nodes a leader that timed out waiting for its node's ranks left nothing pending
    # in MPI and no verdict for its node: the others cannot complete that check (the group
    # is no longer usable, as the error says), so they do not join it.
    join = WORLD.bcast(error is None or error.request is not None or board.shared
                       if group.rank == 0 else None)
    if group.rank == 0:
        last = group.size - 1
        if board.shared:  # names the ranks whose words are missing
            said = "rank 1 (global 1) did not arrive" if last == 1 else \
                f"ranks 1-{last} (global 1-{last}) did not arrive"
        elif len(board.members) > 1:  # its node's missing ranks, waited for first
            said = f"{named(group, *board.members[1:])} did not arrive"
        elif board.requests:  # the leaders it did not hear from
            said = " did not arrive"
        else:  # more leaders than exchange directly: the Iallgather cannot tell which
            said = "cannot tell which"
        ok = (error is not None and 0.25 < waited < 60 and "within 0.3 s" in str(error)
              and f"all_reduce(shape=(3,), dtype=float64, op='sum') on group '{group.name}'"
              in str(error) and "rank 0 (global 0)" in str(error) and said in str(error)
              and (error.request is None or not board.shared))
        ok = ok and (error.request is not None) == (not board.shared and len(board.members) == 1)
        # The others join late: the pending check (leaders' exchange), then the data call,
        # which is blocking with or without the watchdog.
        if error is not None and join:
            if isinstance(error.request, list):  # a leader's words to the other leaders
                MPI.Request.Waitall(error.request)
            elif error.request is not None:
                error.request.Wait()
            group.comm.Allreduce(MPI.IN_PLACE, np.ones(3))
        agree(ok, f"no or wrong timeout after {waited:.2f} s: {error!r}")
    elif join:
        # Its check finds rank 0's word (written before it timed out), then the data call.
        with debug_mode(enabled=False, timeout=60.0):
            group.all_reduce(np.ones(3))
        agree(True)
    else:
        agree(True)
    assert_equal(y, np.full(3, 2.0), "calls before the timeout")
    group.free()


def _reference(i: int, p: int, r: int) -> tuple[list[np.ndarray], str]:
    """Every rank's input of call ``i`` (seeded) and the operation it runs."""
    rng = np.random.default_rng(1000 + i)
    rows = 1 + i % 3
    return [rng.standard_normal((rows * p + i % 2, 3)) for _ in range(p)], (
        "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")[i % 5]


def _one_call(group: Group, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Call ``i`` of a long mixed run: (pympar's result, NumPy's)."""
    p, r = group.size, group.rank
    inputs, op = _reference(i, p, r)
    mine = inputs[r]
    if op == "all_reduce":
        return group.all_reduce(mine), np.sum(inputs, axis=0)
    if op == "broadcast":
        return group.broadcast(mine, root=i % p), inputs[i % p]
    if op == "all_gather":
        sizes = tuple(x.shape[0] for x in inputs)
        return group.all_gather(mine, 0, sizes=sizes), np.concatenate(inputs)
    if op == "reduce_scatter":
        return group.reduce_scatter(mine), np.array_split(np.sum(inputs, axis=0), p)[r]
    blocks = [np.array_split(x, p, axis=0)[r] for x in inputs]
    return group.all_to_all(mine, 0, 1, sizes=(3,) * p), np.concatenate(blocks, axis=1)


@pytest.mark.mpi(min_size=1)
def test_a_long_mixed_run_stays_in_step(group):
    """1000 checked calls of five kinds; then the 32-bit check counter wraps around."""
    worst = 0.0
    for i in range(1000):
        got, want = _one_call(group, i)
        if got.shape != want.shape:
            worst = np.inf
            break
        worst = max(worst, float(np.max(np.abs(got - want), initial=0.0)))
    agree(worst < 1e-12, f"max error {worst:.3g} over 1000 calls")
    if group._state.board is not None and group._state.board.shared:
        # Alike on every rank: the next checks wrap around to count 1.
        group._state.board.count = _board._LAST - 3
    for i in range(6):
        got, want = _one_call(group, i)
        assert_close(got, want, what=f"call {i} around the counter's wrap")
    if group.size > 1:  # a group of one checks nothing
        x = np.ones(4, np.float32)
        raises_everywhere(CollectiveMismatchError, "float64", group.all_reduce,
                          x.astype(np.float64) if group.rank == 0 else x)


@pytest.mark.mpi(min_size=1)
def test_states_created_and_destroyed_twice(clean_state, one_node):
    tp = 2 if WORLD.size % 2 == 0 else 1
    for round_ in range(2):
        state = manager.initialize_parallel(tensor_parallel_size=tp)
        groups = [state.tensor, state.data]
        for g in groups:
            x = np.arange(6.0) * (g.rank + 1) + round_
            want = np.arange(6.0) * (g.size * (g.size + 1) / 2) + round_ * g.size
            assert_close(g.all_reduce(x), want, what=f"round {round_} {g.name}")
        manager.destroy_parallel()
        agree(all(g.freed for g in groups), "destroy frees the groups")


@pytest.mark.mpi(min_size=2)
def test_a_board_leaves_no_file_behind(tmp_path_factory, monkeypatch, one_node):
    """The board's file is unlinked once every rank has mapped it; the mapping still works."""
    if not one_node:
        pytest.skip("the ranks are on several nodes: no board")
    where = WORLD.bcast(str(tmp_path_factory.mktemp("shm")) if WORLD.rank == 0 else None)
    monkeypatch.setattr(_board, "SHARED_DIR", where)
    g = make_group("shared", "leftovers")
    try:
        WORLD.Barrier()  # rank 0 unlinks right after the others have mapped the file
        left = os.listdir(where)
        x = np.full(3, float(g.rank + 1))
        y = g.all_reduce(x)
        agree(g._state.board.shared and not left and np.array_equal(y, np.full(3, g.size * (
            g.size + 1) / 2)), f"board {g._state.board}, files left {left}, sum {y}")
    finally:
        g.free()


@pytest.mark.mpi(min_size=2)
def test_a_waiting_rank_keeps_mpi_progressing(group):
    """Rank 2i posted a receive before the check; rank 2i+1 sends before joining it.

    The send (4 MiB: rendezvous, beyond any eager limit) completes only when the receiving
    rank drives MPI's progress engine, so the check's wait must keep doing so, as a
    waiting MPI call does. A deadline instead of a blocking send keeps a failure a failure.
    """
    p2p = WORLD.Dup()
    r = WORLD.rank
    partner = r + 1 if r % 2 == 0 else r - 1
    data = np.full(1 << 19, float(r))
    sent = True
    if partner < WORLD.size and r % 2 == 0:
        request = p2p.Irecv(data, source=partner)
        total = group.all_reduce(np.ones(3))
        request.Wait()
        ok = bool(np.all(data == partner))
    elif partner < WORLD.size:
        time.sleep(0.05)  # the receiver is waiting in the check by now
        request = p2p.Isend(data, dest=partner)
        deadline = time.monotonic() + 20.0
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(1e-4)
        sent = request.Test()
        total = group.all_reduce(np.ones(3))
        request.Wait()
        ok = True
    else:
        total, ok = group.all_reduce(np.ones(3)), True
    p2p.Free()
    agree(sent and ok, f"the send did not complete while the receiver waited: {sent}, {ok}")
    assert_equal(total, np.full(3, float(group.size)), "sum")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("binding", ["none", "a core each", "all on one core"])
def test_ranks_that_outnumber_their_cores_yield_from_the_first_poll(binding, monkeypatch):
    """A waiting rank spins before it yields only where the host's ranks have a core each:
    where they share cores, the rank it waits for may need its core (``errors.SPINS``
    drops to 1 when a group is created there; sticky, so reset here)."""
    from pympar import errors

    before = os.sched_getaffinity(0)
    masks = WORLD.allgather(sorted(before))
    if binding != "none" and any(m != masks[0] for m in masks):
        pytest.skip("the launcher bound the ranks already")
    cores = masks[0]
    pinned = {"none": before, "a core each": {cores[WORLD.rank % len(cores)]},
              "all on one core": {cores[0]}}[binding]
    names = WORLD.allgather(MPI.Get_processor_name())
    on_host = names.count(MPI.Get_processor_name())
    used = set().union(*(m for m, n in zip(WORLD.allgather(sorted(pinned)), names)
                         if n == MPI.Get_processor_name()))
    monkeypatch.setattr(errors, "SPINS", 200)
    os.sched_setaffinity(0, pinned)
    try:
        g = Mesh(WORLD, {"w": WORLD.size}).group("w", key=f"cores {binding}")
    finally:
        os.sched_setaffinity(0, before)
    try:
        expected = 1 if on_host > len(used) else 200
        agree(errors.SPINS == expected, f"{on_host} ranks on {len(used)} cores: SPINS "
              f"{errors.SPINS}, expected {expected}")
        assert_equal(g.all_reduce(np.ones(2)), np.full(2, float(g.size)), "sum")
    finally:
        g.free()


@pytest.mark.mpi(min_size=2)
def test_no_shared_directory_falls_back_on_every_rank(monkeypatch):
    """Without the directory (or with a name too long to send) every rank takes the
    message path, and the check still works."""
    for where in ("/nonexistent-pympar-dir", "/tmp/" + "x" * 300):
        monkeypatch.setattr(_board, "SHARED_DIR", where)
        g = make_group("shared", "fallback")
        try:
            y = g.all_reduce(np.full(2, float(g.rank + 1)))
            agree(not g._state.board.shared and np.array_equal(y, np.full(2, g.size * (g.size + 1) / 2)),
                  f"{where[:30]}: board {g._state.board}, sum {y}")
            raises_everywhere(CollectiveMismatchError, "int32", g.all_reduce,
                              np.ones(2, np.int32 if g.rank == 1 else np.float32))
        finally:
            g.free()


@pytest.mark.mpi(min_size=2)
def test_every_collective_meets_the_others_in_one_check(group):
    """Calls that would wait in two different exchanges meet in the one check and raise."""
    odd = group.rank == 1
    p = group.size
    x = np.ones((2, 3), np.float32)
    # float16 sums in float32, so the data would move alike: the dtypes still differ.
    raises_everywhere(CollectiveMismatchError, "float16", group.all_reduce,
                      x.astype(np.float16 if odd else np.float32))
    # A gather of unknown extents (its sizes travel with the check) against an all-reduce,
    # and against the same gather with sizes= given.
    call = (lambda: group.all_gather(x)) if odd else (lambda: group.all_reduce(x))
    raises_everywhere(CollectiveMismatchError, "disagree", call)
    sizes = None if odd else (2,) * p
    raises_everywhere(CollectiveMismatchError, "disagree", group.all_gather, x, 0, None, sizes)
    assert_equal(group.all_gather(x), np.ones((2 * p, 3), np.float32), "in step afterwards")


@pytest.mark.mpi(min_size=2)
def test_bad_arguments_on_one_rank_raise_on_every_rank(group):
    """What one rank refuses before any message still makes every rank raise."""
    odd = group.rank == 1
    p = group.size
    x = np.arange(6.0).reshape(2, 3)
    bad = {
        "a list": (lambda: group.all_reduce(x.tolist() if odd else x), "numpy.ndarray"),
        "None": (lambda: group.all_gather(None if odd else x), "numpy.ndarray"),
        "an op": (lambda: group.all_reduce(x, "prod" if odd else "sum"), "op must be"),
        "complex max": (lambda: group.all_reduce(x.astype(np.complex128) if odd else x,
                                                 "max"), "complex"),
        "a root": (lambda: group.broadcast(x, root=p if odd else 0), "root"),
        "an axis": (lambda: group.all_gather(x, 5 if odd else 0), "out of range"),
        "a 0-d array": (lambda: group.all_gather(np.float64(1.0) if odd else x),
                        "at least one dimension"),
        "an axis to split": (lambda: group.reduce_scatter(x, 7 if odd else 0), "out of range"),
        "equal axes": (lambda: group.all_to_all(x, 0, 0 if odd else 1), "must differ"),
        "an object dtype": (lambda: group.all_gather(x.astype(object) if odd else x,
                                                    sizes=(2,) * p), "not dtype object"),
    }
    for what, (call, reason) in bad.items():
        error = raises_everywhere(CollectiveMismatchError, "refused by this rank", call)
        agree(reason in str(error), f"{what}: the reason is not named: {error}")
    # Every rank refusing alike: each raises its own error, nobody waits.
    raises_everywhere(TypeError, "numpy.ndarray", group.all_reduce, [1.0, 2.0])
    raises_everywhere(ValueError, "op must be", group.all_reduce, x, "prod")
    assert_close(group.all_reduce(x), x * p, what="in step afterwards")


@pytest.mark.mpi(min_size=2)
def test_an_out_that_misfits_on_one_rank_raises_everywhere(group):
    """Gathers of unknown extents learn of another rank's out with the extents."""
    odd = group.rank == 1
    p = group.size
    x = np.ones((2, 4))
    # The gathered extent is wrong on one rank: only known once every extent is in.
    out = np.empty((2 * p + odd, 4))
    misfit = r"the out of rank 1 \(global \d+\) has"
    raises_everywhere(CollectiveMismatchError, misfit, group.all_gather, x, 0, out)
    out = np.empty((2 * p, 4 + odd))  # another axis: refused before any message
    raises_everywhere(CollectiveMismatchError, "does not fit", group.all_gather, x, 0, out)
    y = np.ones((2 * p, 3))
    out = np.empty((2, 3 * p + odd))
    raises_everywhere(CollectiveMismatchError, misfit, group.all_to_all, y, 0, 1, out)
    # An out overlapping the input: pympar's error, not MPI's, on every rank.
    big = np.ones(12)
    aliased = big[2:8] if odd else np.empty(6)
    raises_everywhere(CollectiveMismatchError, "overlaps the input", group.all_reduce,
                      big[:6], "sum", aliased)
    whole = np.ones((2 * p, 4))
    raises_everywhere(ValueError, "overlaps the input", group.all_gather, whole[:2], 0, whole)
    assert_equal(group.all_gather(x, 0, np.empty((2 * p, 4))), np.ones((2 * p, 4)),
                 "in step afterwards")
