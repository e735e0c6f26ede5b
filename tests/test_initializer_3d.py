"""3D groups: the seed initializers and the manager's 3D mode, on real ranks."""

import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import manager
from pympar.initializer_3d import (Initializer_3D, Initializer_3D_Input, Initializer_3D_Output,
                                   Initializer_3D_Weight, ParallelMode, cube_depth)

# The documented worked example: d=2 on 8 ranks
EXPECTED_D2 = {
    ParallelMode.PARALLEL_3D_INPUT: [[0, 2], [4, 6], [1, 3], [5, 7]],
    ParallelMode.PARALLEL_3D_WEIGHT: [[0, 1], [2, 3], [4, 5], [6, 7]],
    ParallelMode.PARALLEL_3D_OUTPUT: [[0, 4], [2, 6], [1, 5], [3, 7]],
    ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: [[0, 1, 2, 3], [4, 5, 6, 7]],
    ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: [[0, 1, 4, 5], [2, 3, 6, 7]],
}


def independent_3d_members(rank, depth, mode):
    """Members of rank's group from the formula rank = h*d^3 + i + d*(j + d*k)."""
    d3 = depth ** 3
    h, local = divmod(rank, d3)
    i, j, k = local % depth, (local // depth) % depth, local // (depth * depth)
    at = lambda i, j, k: h * d3 + i + depth * (j + depth * k)  # noqa: E731
    r = range(depth)
    return {
        ParallelMode.PARALLEL_3D_INPUT: [at(i, jj, k) for jj in r],
        ParallelMode.PARALLEL_3D_WEIGHT: [at(ii, j, k) for ii in r],
        ParallelMode.PARALLEL_3D_OUTPUT: [at(i, j, kk) for kk in r],
        ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: [at(ii, jj, k) for jj in r for ii in r],
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: [at(ii, j, kk) for kk in r for ii in r],
    }[mode]


def check(results, depth):
    for local_rank, size, group, ranks, mode in results:
        expected = independent_3d_members(WORLD.rank, depth, mode)
        members = group.comm.allgather(WORLD.rank)
        agree(ranks == expected == members == list(group.ranks) and size == len(expected)
              and local_rank == expected.index(WORLD.rank) and group.name.startswith(mode.value),
              f"{mode.value}: got {ranks} (comm {members}) local {local_rank}, expected {expected}")
        group.free()


@pytest.mark.mpi(min_size=8)
def test_design_example_d2():
    if WORLD.size != 8:
        pytest.skip("the worked example has 8 ranks")
    results = Initializer_3D().init_dist_group()
    agree([r[4] for r in results] == list(ParallelMode), "modes out of order")
    for local_rank, size, group, ranks, mode in results:
        row = [g for g in EXPECTED_D2[mode] if WORLD.rank in g][0]
        agree(ranks == row and local_rank == row.index(WORLD.rank) and size == len(row),
              f"{mode.value}: {ranks} local {local_rank}, expected {row}")
    check(results, 2)


@pytest.mark.mpi(min_size=1)
def test_depth_one_blocks_any_world():
    results = Initializer_3D(None, 1).init_dist_group()
    agree(all(r[1] == 1 and r[3] == [WORLD.rank] for r in results))
    check(results, 1)


@pytest.mark.mpi(min_size=8)
def test_single_initializers_and_manager_3d_mode():
    depth = 2
    num_group = WORLD.size // 8
    if num_group * 8 != WORLD.size:
        pytest.skip("needs a multiple of 8 ranks")
    for cls in (Initializer_3D_Input, Initializer_3D_Weight, Initializer_3D_Output):
        check([cls(num_group, depth, None, 8).init_dist_group()], depth)
    state = manager.initialize_parallel(8, tensor_parallel_mode="3d")
    try:
        agree(state.depth == 2 and manager.get_tensor_parallel_world_size() == 8)
        for mode in ParallelMode:
            group = manager.get_3d_group(mode)
            expected = independent_3d_members(WORLD.rank, depth, mode)
            agree(list(group.ranks) == expected == group.comm.allgather(WORLD.rank),
                  f"manager {mode.value}: {group.ranks} vs {expected}")
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_bad_3d_arguments():
    with pytest.raises(ValueError, match="cube"):
        cube_depth(4)
    assert [cube_depth(n) for n in (1, 8, 27, 64, 125)] == [1, 2, 3, 4, 5]
    raises_everywhere(ValueError, "do not tile", Initializer_3D_Input, WORLD.size + 1, 1)
    if WORLD.size > 1:
        non_cube = next(n for n in range(2, WORLD.size + 1)
                        if WORLD.size % n == 0 and round(n ** (1 / 3)) ** 3 != n)
        raises_everywhere(ValueError, "cube tensor-parallel size", Initializer_3D, None, non_cube)
        raises_everywhere(ValueError, "does not match", Initializer_3D_Weight, WORLD.size, 1,
                          None, WORLD.size)
    manager.initialize_parallel()
    try:
        if WORLD.size > 1:
            raises_everywhere(RuntimeError, "tensor_parallel_mode='3d'", manager.get_3d_group,
                              "3d_input")
    finally:
        manager.destroy_parallel()
