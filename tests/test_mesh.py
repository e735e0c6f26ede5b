"""Rank arithmetic of ``Mesh``: worked examples, an independent brute force, 10^6 ranks;
on real ranks, the agreement that makes ranks which call ``Mesh`` differently fail alike."""

import itertools
import math

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar.debug import CollectiveMismatchError, debug_mode
from pympar.mesh import Mesh, group_ranks, parse_order

SIZES = {"tp": 2, "cp": 2, "dp": 2}


def brute_force(sizes, order, axes):
    """Independent computation: coordinates by repeated divmod, groups by grouping."""
    mesh_axes = [a for a in order.split("-")] + [a for a in sizes if a not in order.split("-")]
    world = math.prod(sizes.values())
    groups = {}
    for rank in range(world):
        coords, rest = {}, rank
        for a in mesh_axes:
            rest, coords[a] = divmod(rest, sizes[a])
        other = tuple(coords[a] for a in reversed(mesh_axes) if a not in axes)
        position = tuple(coords[a] for a in reversed(mesh_axes) if a in axes)
        groups.setdefault(other, []).append((position, rank))
    return [[r for _, r in sorted(members)] for _, members in sorted(groups.items())]


def test_design_worked_example():
    assert group_ranks(SIZES, "tp-cp-dp", "tp").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(SIZES, "tp-cp-dp", "cp").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(SIZES, "tp-cp-dp", "dp").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(SIZES, "tp-cp-dp", "dp", "cp").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # member order follows the mesh, not the order the axes are named in
    assert group_ranks(SIZES, "tp-cp-dp", "cp", "dp").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]


SHAPES = [
    ({"tp": 3, "cp": 1, "dp": 2}, "tp-cp-dp"),
    ({"tp": 2, "cp": 3, "dp": 4}, "dp-tp-cp"),
    ({"tp": 4, "cp": 2, "dp": 3}, "cp-dp-tp"),
    ({"tp": 1, "cp": 5, "dp": 2}, "cp-dp"),
    ({"a": 2, "b": 3, "c": 2, "d": 2}, "c-a-d-b"),
]


@pytest.mark.parametrize("sizes,order", SHAPES)
def test_against_brute_force(sizes, order):
    for k in range(len(sizes) + 1):
        for axes in itertools.combinations(sizes, k):
            expected = brute_force(sizes, order, axes)
            assert group_ranks(sizes, order, *axes).tolist() == expected, axes


def test_million_ranks_without_mpi():
    sizes = {"tp": 8, "cp": 5, "dp": 25000}
    tp = group_ranks(sizes, "tp-cp-dp", "tp")
    dp = group_ranks(sizes, "cp-tp-dp", "dp")
    assert tp.shape == (125000, 8) and dp.shape == (40, 25000)
    np.testing.assert_array_equal(tp[7], np.arange(56, 64))
    # cp-tp-dp: cp stride 1, tp stride 5, dp stride 40; groups ordered cp fastest, then tp
    np.testing.assert_array_equal(dp[1], np.arange(1, 10**6, 40))
    np.testing.assert_array_equal(dp[5], np.arange(5, 10**6, 40))
    # every rank appears exactly once per axis
    for axes in [("tp",), ("cp",), ("dp",), ("dp", "cp")]:
        table = group_ranks(sizes, "tp-cp-dp", *axes)
        assert np.array_equal(np.sort(table.ravel()), np.arange(10**6))


@pytest.mark.parametrize("order,message", [
    ("tp-xp-dp", "unknown axis 'xp'"),
    ("tp-tp-cp-dp", "repeats axis 'tp'"),
    ("tp-cp", "leaves out axis 'dp' of size 2"),
])
def test_bad_order(order, message):
    with pytest.raises(ValueError, match=message):
        parse_order(order, SIZES)


def test_missing_axis_of_size_one_is_outermost():
    assert parse_order("tp-dp", {"tp": 2, "cp": 1, "dp": 2}) == ("tp", "dp", "cp")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        group_ranks({"tp": bad, "dp": 2}, "tp-dp", "tp")


# --------------------------------------------------------------------------- on real ranks:
# creating a mesh and each group is collective, and the ranks agree on it first.


@pytest.mark.mpi(min_size=1)
def test_alike_calls_make_the_groups_of_the_rank_math():
    mesh = Mesh(WORLD, {"a": WORLD.size, "b": 1}, "b-a")
    group = mesh.group("a", key="all")
    try:
        agree(group.ranks == tuple(range(WORLD.size)) and group.rank == WORLD.rank
              and group.name == "all-" + "-".join(map(str, range(WORLD.size)))
              and group.comm.allgather(WORLD.rank) == list(range(WORLD.size)),
              f"got {group.name} {group.ranks}")
    finally:
        group.free()


@pytest.mark.mpi(min_size=2)
def test_orders_that_differ_raise_on_every_rank():
    p = WORLD.size
    order = "a-b" if WORLD.rank == 0 else "b-a"
    raises_everywhere(CollectiveMismatchError,
                      rf"Mesh is collective .* Mesh\(a={p} x b=1, innermost first\) on ranks "
                      rf"\[0\]; Mesh\(b=1 x a={p}, innermost first\) on ranks \[1",
                      Mesh, WORLD, {"a": p, "b": 1}, order)


@pytest.mark.mpi(min_size=2)
def test_a_bad_size_on_one_rank_raises_on_every_rank():
    sizes = {"a": 0 if WORLD.rank == 0 else WORLD.size}
    raises_everywhere(CollectiveMismatchError,
                      r"on ranks \[0\]; .*size of axis 'a' must be an integer >= 1|"
                      r"size of axis 'a' must be an integer >= 1.* on ranks \[0\]",
                      Mesh, WORLD, sizes)


@pytest.mark.mpi(min_size=1)
def test_sizes_that_are_not_a_mapping_raise_on_every_rank():
    raises_everywhere(TypeError, "sizes must be a mapping of axis names to sizes, such as .*"
                      "not list", Mesh, WORLD, [("a", WORLD.size)])
    if WORLD.size > 1:  # on one rank only: the others raise too instead of waiting
        sizes = None if WORLD.rank == 0 else {"a": WORLD.size}
        raises_everywhere(CollectiveMismatchError, "not NoneType", Mesh, WORLD, sizes)


@pytest.mark.mpi(min_size=2)
def test_groups_created_in_different_orders_raise_on_every_rank():
    mesh = Mesh(WORLD, {"a": WORLD.size, "b": 1})
    first, second = ("a", "b") if WORLD.rank == 0 else ("b", "a")
    raises_everywhere(CollectiveMismatchError,
                      r"Mesh.group is collective .* Mesh.group\('a', key=None\) on ranks \[0\]; "
                      r"Mesh.group\('b', key=None\) on ranks \[1",
                      mesh.group, first)
    raises_everywhere(CollectiveMismatchError, r"key='x'\) on ranks \[0\]; .*key='y'\) on ranks",
                      mesh.group, second, key="x" if WORLD.rank == 0 else "y")


@pytest.mark.mpi(min_size=2)
def test_settings_that_differ_raise_on_every_rank():
    with debug_mode(enabled=WORLD.rank == 1, timeout=60.0):
        raises_everywhere(ValueError, r"PYMPAR_DEBUG must be set alike on every rank.*"
                          r"off \(PYMPAR_DEBUG=.*\) on ranks \[0.*on \(PYMPAR_DEBUG=.*\) on "
                          r"ranks \[1\]", Mesh, WORLD, {"w": WORLD.size})
    mesh = Mesh(WORLD, {"w": WORLD.size})
    with debug_mode(enabled=False, timeout=30.0 if WORLD.rank == 0 else None):
        raises_everywhere(ValueError, r"PYMPAR_TIMEOUT must be set alike.*30.0 s .*on ranks "
                          r"\[0\].*off", mesh.group, "w")
