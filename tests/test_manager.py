"""DP/CP/TP groups on real MPI ranks: worked examples, other layouts, bad input."""

import typing

import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import manager
from pympar.group import Group
from pympar.mesh import group_ranks

AXES = ("tensor", "context", "data", "data_context")
MESH_AXES = {"tensor": ("tp",), "context": ("cp",), "data": ("dp",), "data_context": ("dp", "cp")}
KEYS = {"tensor": "tp", "context": "cp", "data": "dp", "data_context": "dp-cp"}

pytestmark = pytest.mark.usefixtures("clean_state")


def getters(axis):
    return [getattr(manager, f"get_{axis}_parallel_{view}")
            for view in ("group", "group_name", "rank", "world_size")]


def check_layout(tp, cp, order):
    """Every getter against pure rank math, and each communicator's real members."""
    sizes = {"tp": tp, "cp": cp, "dp": WORLD.size // (tp * cp)}
    rank = WORLD.rank
    for axis in AXES:
        group, name, local, size = (g() for g in getters(axis))
        table = group_ranks(sizes, order, *MESH_AXES[axis])
        row = [list(r) for r in table.tolist() if rank in r][0]
        expected_name = KEYS[axis] + "-" + "-".join(map(str, row))
        members = group.comm.allgather(rank)  # what MPI really put in the communicator
        agree(list(group.ranks) == row and members == row and name == expected_name
              and local == row.index(rank) and size == len(row),
              f"{axis} at tp={tp} cp={cp} {order}: got {name} {members} local {local}, "
              f"expected {expected_name} local {row.index(rank)}")


@pytest.mark.mpi(min_size=8)
def test_design_worked_example():
    if WORLD.size != 8:
        pytest.skip("the worked example has 8 ranks")
    manager.initialize_parallel(2, 2, "tp-cp-dp")
    expected = {
        "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "context": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "data_context": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }
    for axis, table in expected.items():
        row = [r for r in table if WORLD.rank in r][0]
        name = getattr(manager, f"get_{axis}_parallel_group_name")()
        local = getattr(manager, f"get_{axis}_parallel_rank")()
        agree(name == KEYS[axis] + "-" + "-".join(map(str, row)) and local == row.index(WORLD.rank),
              f"{axis}: {name} local {local}, expected {row}")
    check_layout(2, 2, "tp-cp-dp")


def layouts(world):
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4):
            if world % (tp * cp) == 0:
                for order in ("tp-cp-dp", "dp-cp-tp", "cp-tp-dp"):
                    yield tp, cp, order


@pytest.mark.mpi(min_size=1)
def test_every_layout_matches_rank_math():
    for tp, cp, order in layouts(WORLD.size):
        manager.initialize_parallel(tp, cp, order)
        check_layout(tp, cp, order)
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_destroy_then_reinitialize_with_another_layout():
    state = manager.initialize_parallel(tensor_parallel_size=WORLD.size)
    old = state.all_groups()
    agree(manager.get_tensor_parallel_world_size() == WORLD.size)
    manager.destroy_parallel()
    agree(not manager.is_initialized() and all(g.freed for g in old), "state not cleared")
    manager.initialize_parallel(context_parallel_size=WORLD.size, order="cp-tp-dp")
    agree(manager.get_context_parallel_world_size() == WORLD.size
          and manager.get_tensor_parallel_world_size() == 1
          and manager.get_tensor_parallel_group_name() == f"tp-{WORLD.rank}")
    check_layout(1, WORLD.size, "cp-tp-dp")


@pytest.mark.mpi(min_size=1)
def test_size_one_groups_are_real():
    manager.initialize_parallel()
    group = manager.get_tensor_parallel_group()
    agree(group.size == 1 and group.comm != MPI.COMM_NULL and group.comm.allgather(7) == [7])


@pytest.mark.mpi(min_size=1)
def test_getters_before_initialize():
    for axis in AXES:
        for getter in getters(axis):
            raises_everywhere(RuntimeError, "call pympar.manager.initialize_parallel", getter)


@pytest.mark.mpi(min_size=1)
def test_bad_arguments_raise_on_every_rank():
    world = WORLD.size
    raises_everywhere(ValueError, f"world size {world} is not divisible by tensor_parallel_size "
                      f"{world + 1}", manager.initialize_parallel, world + 1)
    raises_everywhere(ValueError, f"context_parallel_size {world + 1}",
                      manager.initialize_parallel, 1, world + 1)
    raises_everywhere(ValueError, "integer >= 1", manager.initialize_parallel, 0)
    raises_everywhere(ValueError, "integer >= 1", manager.initialize_parallel, 1, -2)
    raises_everywhere(ValueError, "unknown axis 'pp'", manager.initialize_parallel, 1, 1, "tp-pp-dp")
    raises_everywhere(ValueError, "repeats axis 'tp'", manager.initialize_parallel, 1, 1, "tp-tp-cp-dp")
    raises_everywhere(ValueError, "tensor_parallel_mode", manager.initialize_parallel,
                      tensor_parallel_mode="2d")
    agree(not manager.is_initialized(), "a failed initialize left state behind")


@pytest.mark.mpi(min_size=2)
def test_missing_axis_of_size_above_one():
    tp = next(n for n in range(2, WORLD.size + 1) if WORLD.size % n == 0)
    raises_everywhere(ValueError, f"leaves out axis 'tp' of size {tp}",
                      manager.initialize_parallel, tp, 1, "cp-dp")


@pytest.mark.mpi(min_size=4)
def test_non_cube_3d_raises():
    raises_everywhere(ValueError, "cube tensor-parallel size", manager.initialize_parallel,
                      4, tensor_parallel_mode="3d")


@pytest.mark.mpi(min_size=2)
def test_different_arguments_on_ranks_raise_everywhere():
    tp = 1 if WORLD.rank == 0 else 2
    raises_everywhere(ValueError, "different arguments on ranks", manager.initialize_parallel, tp)


@pytest.mark.mpi(min_size=1)
def test_initialize_twice_raises():
    manager.initialize_parallel()
    raises_everywhere(RuntimeError, "already initialized", manager.initialize_parallel)
    agree(manager.get_data_parallel_world_size() == WORLD.size, "first state was damaged")


@pytest.mark.mpi(min_size=1)
def test_getters_are_typed():
    """Each of the 16 getters declares what it returns (no Callable[[], object])."""
    expected = {"group": Group, "group_name": str, "rank": int, "world_size": int}
    for axis in AXES:
        for view, kind in expected.items():
            getter = getattr(manager, f"get_{axis}_parallel_{view}")
            agree(typing.get_type_hints(getter)["return"] is kind, f"{getter.__name__}")
    manager.initialize_parallel()
    for axis in AXES:
        for view, kind in expected.items():
            value = getattr(manager, f"get_{axis}_parallel_{view}")()
            agree(isinstance(value, kind), f"{axis} {view}: {value!r}")


@pytest.mark.mpi(min_size=1)
def test_resolve_group():
    raises_everywhere(RuntimeError, "MyLayer needs a context-parallel group.*group=",
                      manager.resolve_group, None, "MyLayer", "context")
    state = manager.initialize_parallel()
    agree(manager.resolve_group(None, "L") is state.tensor
          and manager.resolve_group(None, "L", "data_context") is state.data_context
          and manager.resolve_group(state.data, "L") is state.data, "resolved groups")
    raises_everywhere(ValueError, "unknown group axis 'expert'", manager.resolve_group,
                      None, "L", "expert")


@pytest.mark.mpi(min_size=1)
def test_a_group_name_is_not_a_group():
    manager.initialize_parallel()
    for wrong in ("tp", manager.get_tensor_parallel_group_name(), 0):
        raises_everywhere(TypeError, rf"MyLayer: group must be a pympar Group or None, not "
                          rf"{type(wrong).__name__} ", manager.resolve_group, wrong, "MyLayer")


@pytest.mark.mpi(min_size=1)
def test_barrier_of_a_freed_group_says_so():
    state = manager.initialize_parallel()
    manager.destroy_parallel()
    for group in (state.tensor, state.data):
        raises_everywhere(RuntimeError, rf"barrier: group '{group.name}' has been freed "
                          r"\(Group.free or manager.destroy_parallel\)", group.barrier)


@pytest.mark.mpi(min_size=1)
def test_data_parallel_size_is_checked_when_given():
    world = WORLD.size
    tp = 2 if world % 2 == 0 else 1
    state = manager.initialize_parallel(tensor_parallel_size=tp, data_parallel_size=world // tp)
    agree(state.data.size == world // tp, f"dp size {state.data.size}")
    manager.destroy_parallel()
    # A script written for TP=tp x DP=2*world/tp refuses this job, naming the rank count.
    raises_everywhere(ValueError, rf"needs {2 * world} ranks, and this job has {world}: "
                      rf"run it on {2 * world} ranks", manager.initialize_parallel,
                      tensor_parallel_size=tp, data_parallel_size=2 * world // tp)
    raises_everywhere(ValueError, "must be an integer >= 1", manager.initialize_parallel,
                      data_parallel_size=0)
    agree(not manager.is_initialized(), "a refused call leaves no state")
