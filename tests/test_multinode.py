"""The agreement check across nodes: the path a group takes when its ranks are on several nodes.

A group whose ranks share a node checks through a board in shared memory; a group across
nodes cannot (:mod:`pympar._board`). These tests run where ``PYMPAR_TEST_NODES=N`` says
that the world is spread over ``N`` nodes, real or emulated, and fail unless the cross-node
path is really taken there:

* ``make test``'s phase "4 ranks, 2 emulated nodes" (``scripts/test_phases.sh``): MPICH's
  ``MPIR_CVAR_ODD_EVEN_CLIQUES=1`` makes ``COMM_TYPE_SHARED`` put the even and the odd
  ranks on two nodes (the MPICH alias ``MPICH_ODD_EVEN_CLIQUES=1`` reaches the jobs that
  tests start themselves, whose environment drops ``MPIR_*``);
* ``make test-slurm`` (``scripts/slurm_check.py``): ``srun -N2 -n4 --mpi=pmi2`` on a
  Slurm of two ``slurmd`` on one host, where the ranks split 2+2 or 3+1.

Everywhere else (the other phases of ``make test``) they skip, saying so. The board's type is
asserted through its ``shared`` attribute only: ``False`` for a group across nodes, ``True``
for a group inside one, whatever board a later pympar uses across nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere
from pympar import manager
from pympar.errors import CollectiveMismatchError
from pympar.group import Group
from pympar.mesh import Mesh

REPO = Path(__file__).resolve().parent.parent
#: How many nodes the world is spread over (0: not said, the tests skip).
NODES = int(os.environ.get("PYMPAR_TEST_NODES", "0") or 0)

needs_nodes = pytest.mark.skipif(
    NODES < 2, reason="PYMPAR_TEST_NODES is not set: the ranks are not said to be on several "
    "nodes (make test's phase '4 ranks, 2 emulated nodes' and make test-slurm set it)")
in_a_job = pytest.mark.skipif(
    WORLD.size < 2, reason="needs ranks on several nodes (this is the one-rank run of the "
    "phase, whose tests start their own jobs)")
alone = pytest.mark.skipif(
    WORLD.size > 1, reason="starts its own 2-rank job; runs in the one-rank run of the phase")


def node_of_every_rank(comm: MPI.Intracomm = WORLD) -> list[int]:
    """The node of each rank of ``comm`` as the lowest rank on it (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    lowest = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    node.Free()
    return comm.allgather(lowest)


def spans_nodes(group: Group, nodes: list[int]) -> bool:
    """Whether the members of ``group`` (world ranks) are on more than one node."""
    return len({nodes[r] for r in group.ranks}) > 1


@pytest.fixture(scope="module")
def nodes() -> list[int]:
    return node_of_every_rank()


@pytest.fixture
def across(nodes):
    """The world as one group (it spans every node)."""
    group = Mesh(WORLD, {"w": WORLD.size}).group("w", key="across")
    yield group
    group.free()


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=2)
def test_the_world_is_split_into_the_nodes_said(nodes):
    sizes = sorted(nodes.count(n) for n in set(nodes))
    agree(len(sizes) == NODES, f"COMM_TYPE_SHARED split the {WORLD.size} ranks into "
          f"{len(sizes)} node(s) of {sizes} ranks (node of each rank: {nodes}), but "
          f"PYMPAR_TEST_NODES={NODES}: the nodes are not emulated")
    if WORLD.rank == 0:
        print(f"\n[test_multinode] {WORLD.size} ranks on {len(sizes)} nodes of {sizes} ranks "
              f"(lowest rank of each rank's node: {nodes})")


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=2)
def test_a_group_across_nodes_is_not_on_a_shared_board(nodes, across):
    board = across._state.board
    agree(board is not None and board.shared is False,
          f"the world group (ranks on the nodes of lowest rank {sorted(set(nodes))}) has "
          f"the board {board!r} "
          f"(shared={getattr(board, 'shared', None)})")


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=2)
def test_a_group_inside_one_node_is_on_a_shared_board():
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    members = node.allgather(WORLD.rank)
    group = Group(node, f"node-{'-'.join(map(str, members))}", members)
    try:
        board = group._state.board
        # A node with a single rank (3+1 under srun) has no board: nothing to agree with.
        ok = board is None if group.size == 1 else board is not None and board.shared is True
        agree(ok, f"the group of node {members} has the board {board!r}")
        agree(any(WORLD.allgather(group.size > 1)), "no node has two ranks: no shared board "
              "to check")
        y = group.all_reduce(np.full(3, float(WORLD.rank)))
        assert_equal(y, np.full(3, float(sum(members))), "sum inside a node", comm=WORLD)
    finally:
        group.free()


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=4)
def test_the_managers_groups_take_the_path_of_their_placement(clean_state, nodes):
    """TP=2 on the world: whichever of its groups span nodes check by messages, the others
    through shared memory (both kinds exist under the odd-even cliques and srun -N2 alike)."""
    state = manager.initialize_parallel(tensor_parallel_size=2)
    seen, bad = [], []
    for name in ("tensor", "context", "data", "data_context"):
        group = getattr(state, name)
        if group.size == 1:
            continue
        board, spans = group._state.board, spans_nodes(group, nodes)
        seen.append(spans)
        if board is None or board.shared is spans:
            bad.append(f"{group.name}: spans nodes {spans}, board {board!r}")
        x = np.arange(5.0) + group.rank
        want = np.arange(5.0) * group.size + group.size * (group.size - 1) / 2
        if not np.array_equal(group.all_reduce(x), want):
            bad.append(f"{group.name}: wrong sum")
    every = sum(WORLD.allgather(seen), [])
    agree(not bad, "; ".join(bad))
    agree(any(every), f"no group of the TP=2 state spans nodes (nodes {nodes})")


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
def test_all_reduce_across_nodes_equals_numpy(across, dtype):
    p, r = across.size, across.rank
    rng = np.random.default_rng(7)
    # Integer-valued data: every order of summation gives NumPy's sum exactly.
    inputs = [rng.integers(-1000, 1000, (33, 5)).astype(dtype) for _ in range(p)]
    assert_equal(across.all_reduce(inputs[r]), np.sum(inputs, axis=0, dtype=dtype), "sum")
    assert_equal(across.all_reduce(inputs[r], op="max"), np.max(inputs, axis=0), "max")
    big = [np.full(1 << 18, float(k + 1)) for k in range(p)]  # 2 MiB: beyond eager limits
    assert_equal(across.all_reduce(big[r]), np.sum(big, axis=0), "2 MiB sum")
    real = [rng.standard_normal((7, 3)) for _ in range(p)]
    assert_close(across.all_reduce(real[r]), np.sum(real, axis=0), rtol=1e-13, atol=1e-13,
                 what="float sum")


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_across_nodes_equals_numpy(across, axis):
    p, r = across.size, across.rank
    # Uneven blocks (rank k holds k + 1 along the axis), learned or given.
    blocks = [np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) + 100 * k for k in range(p)]
    blocks = [np.repeat(b, k + 1, axis=axis) for k, b in enumerate(blocks)]
    want = np.concatenate(blocks, axis=axis)
    assert_equal(across.all_gather(blocks[r], axis=axis), want, f"all_gather axis {axis}")
    sizes = [b.shape[axis] for b in blocks]
    assert_equal(across.all_gather(blocks[r], axis=axis, sizes=sizes), want,
                 f"all_gather axis {axis} with sizes")


@needs_nodes
@in_a_job
@pytest.mark.mpi(min_size=2)
def test_a_mismatch_across_nodes_raises_on_every_rank_and_leaves_the_group_usable(across):
    last = across.size - 1
    x = np.ones((4, 4) if across.rank == last else (4, 3))
    raises_everywhere(CollectiveMismatchError, r"all_reduce", across.all_reduce, x)
    raises_everywhere(CollectiveMismatchError, r"", across.all_gather,
                      np.ones(3, np.float32 if across.rank == 0 else np.float64))
    # The ranks are still in step: an agreeing call gives NumPy's answer.
    assert_equal(across.all_reduce(np.full(3, 2.0)), np.full(3, 2.0 * across.size),
                 "sum after the mismatches")


JOB = """
import numpy as np
from mpi4py import MPI
from pympar import manager
world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
state = manager.initialize_parallel(2)
board = state.tensor._state.board
total = state.tensor.all_reduce(np.full(2, world.rank + 1.0))
print(f"rank {world.rank}: node size {node.Get_size()}, shared {board.shared}, "
      f"sum {total[0]:g}", flush=True)
"""


@needs_nodes
@alone
@pytest.mark.mpi(min_size=1)
def test_the_jobs_that_tests_start_cross_nodes_too(tmp_path):
    """A 2-rank job started as tests/test_watchdog.py and test_faults.py start theirs (their
    environment without ``MPIR_*``, ``PYMPAR_*``, ``PMI_*``...): each rank on a node of its
    own, the TP group of both on the cross-node path."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PYMPAR_"))}
    env.update(PYMPAR_LAUNCH_TIMEOUT="90",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if mpiexec.exists():
        env.setdefault("MPIEXEC", str(mpiexec))
    done = subprocess.run([str(REPO / "scripts" / "mpirun.sh"), "2", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: node size 1, shared False, sum 3" in output, output
