"""Every job ends on its own terms: the watchdog, a rank that ends early, errors said once.

Each test launches its own 2- or 3-rank job (plain ``python script.py``, or under
``python -m mpi4py``) with the watchdog shortened to ``PYMPAR_TIMEOUT=3``, so they run in
the pass without a launcher only, under whichever launcher ``MPIEXEC`` names (MPICH's
``mpiexec``, Open MPI's ``mpirun``, ``srun``). Each rank's output and exit status are kept
apart from the launcher's (tests/jobs.py), and the tests check the contract: pympar's one
line, the ranks it names, a non-zero status, and an end within the timeout plus 10 s plus
three times a measured trivial job (the launch and imports that load stretches), never at
the launcher's 90 s limit."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest

from jobs import Job, run_job
from mpi_helpers import WORLD, agree
from pympar import faults, manager

TIMEOUT = 3

single_process = pytest.mark.skipif(WORLD.size != 1, reason="launches its own jobs; runs "
                                    "in the pass without a launcher")

PRELUDE = """
import sys, time
import numpy as np
from mpi4py import MPI
from pympar import manager, mappings
from pympar.preemption import Preemption
rank = MPI.COMM_WORLD.Get_rank()
"""

SCENARIOS = {
    "trivial": "manager.initialize_parallel()\n",
    # rank 1 leaves (any status) while rank 0 waits for it in a collective (the group's
    # board in shared memory, or messages as across nodes)
    "exit": """
from pympar import _board
_board.SHARED = sys.argv[2] == "shared"
state = manager.initialize_parallel(2)
if rank == 1:
    sys.exit(int(sys.argv[1]))
state.tensor.all_reduce(np.ones(4))
""",
    # rank 1 calls a mapping that rank 0 never calls; rank 0 ends, or is busy elsewhere
    "mapping_ended": """
state = manager.initialize_parallel(2)
if rank == 1:
    mappings.reduce_from_all(np.ones(4), state.tensor)
""",
    "mapping_busy": """
state = manager.initialize_parallel(2)
if rank == 1:
    mappings.reduce_from_all(np.ones(4), state.tensor)
else:
    time.sleep(60)
""",
    "init_some": """
if rank == 0:
    manager.initialize_parallel()
else:
    time.sleep(60)
""",
    "init_comms": """
other = MPI.COMM_WORLD.Dup()
manager.initialize_parallel(comm=MPI.COMM_WORLD if rank == 0 else other)
""",
    "should_stop": """
manager.initialize_parallel()
with Preemption(MPI.COMM_WORLD) as stop:
    if rank == 0:
        stop.should_stop()
    else:
        time.sleep(60)
""",
    # every rank raises the same CollectiveMismatchError, or ValueError
    "mismatch": """
state = manager.initialize_parallel(2)
state.tensor.all_reduce(np.ones(4 + rank))
""",
    "layout": "manager.initialize_parallel(2)\n",
    # rank 0 lays the world out while rank 1 makes a mesh of it
    "init_mesh": """
from pympar import Mesh
if rank == 0:
    manager.initialize_parallel()
else:
    Mesh(MPI.COMM_WORLD, {"x": 2})
""",
    # one rank destroys its state, then every rank lays the world out again
    "destroy_some": """
manager.initialize_parallel(2)
if rank == int(sys.argv[1]):
    manager.destroy_parallel()
manager.initialize_parallel(2)
""",
}


def launch(tmp_path: Path, scenario: str, *args: str, ranks: int = 2, mpi4py: bool = False,
           command: list[str] | None = None, **env: str) -> Job:
    """Run a scenario on ``ranks`` ranks (tests/jobs.py: each rank's output apart)."""
    script = tmp_path / f"{scenario}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCENARIOS[scenario]))
    program = command or [sys.executable, *(["-m", "mpi4py"] if mpi4py else []), str(script),
                          *args]
    return run_job(tmp_path, ranks, program, PYMPAR_TIMEOUT=str(TIMEOUT), **env)


@pytest.fixture(scope="module")
def bound(tmp_path_factory) -> float:
    """The seconds a job may take to end: the timeout + 10 s + 3 trivial jobs, measured."""
    job = launch(tmp_path_factory.mktemp("baseline"), "trivial")
    assert job.status == 0, str(job)
    return TIMEOUT + 10 + 3 * job.seconds


def ended(job: Job, bound: float, after: float = 0.0) -> None:
    """The job failed (a non-zero status), after ``after`` s and within ``bound`` s."""
    assert job.status != 0 and after < job.seconds < bound, f"bound {bound:.1f} s\n{job}"


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("code,mpi4py,board", [("0", False, "shared"), ("3", False, "shared"),
                                               ("0", True, "shared"), ("3", True, "message")])
def test_a_rank_that_exits_ends_the_job_at_once(tmp_path, bound, code, mpi4py, board):
    job = launch(tmp_path, "exit", code, board, mpi4py=mpi4py)
    ended(job, bound)
    job.said_once("[pympar] PeerEndedError on rank 0: all_reduce(shape=(4,), dtype=float64, "
                  "op='sum') on group 'tp-0-1': rank 1 (global 1) ended the program")
    # The waiting rank fails; the one that left keeps its own status.
    job.check_exits({0: 1, 1: int(code)})


@single_process
@pytest.mark.mpi(min_size=1)
def test_a_mapping_that_one_rank_calls_while_the_other_ends(tmp_path, bound):
    job = launch(tmp_path, "mapping_ended")
    ended(job, bound)
    job.said_once("[pympar] PeerEndedError on rank 1: all_reduce(shape=(4,), dtype=float64, "
                  "op='sum') on group 'tp-0-1': rank 0 (global 0) ended the program")
    job.check_exits({0: 0, 1: 1})


@single_process
@pytest.mark.mpi(min_size=1)
def test_a_mapping_that_one_rank_calls_while_the_other_is_busy(tmp_path, bound):
    job = launch(tmp_path, "mapping_busy")
    ended(job, bound, after=TIMEOUT)
    job.said_once("[pympar rank 1/2] uncaught CollectiveTimeoutError: all_reduce(shape=(4,), "
                  "dtype=float64, op='sum') on group 'tp-0-1' did not complete within 3 s on "
                  "rank 1 (global 1) of 2: rank 0 (global 0) did not arrive")


@single_process
@pytest.mark.mpi(min_size=1)
def test_initialize_parallel_on_some_ranks_only(tmp_path, bound):
    job = launch(tmp_path, "init_some")
    ended(job, bound, after=TIMEOUT)
    # No group exists yet: a roll call after the timeout names the rank that never came.
    job.said_once("[pympar rank 0/2] uncaught CollectiveTimeoutError: initialize_parallel did "
                  "not complete within 3 s on rank 0 of 2: rank(s) [1] of the communicator "
                  "did not call it")


@single_process
@pytest.mark.mpi(min_size=1)
def test_initialize_parallel_over_different_communicators(tmp_path, bound):
    job = launch(tmp_path, "init_comms")
    ended(job, bound, after=TIMEOUT)
    # Each rank waits on its own communicator, where the other never calls it; the first
    # to abort may take the other with it before it says so.
    said = [(rank, other) for rank, other in ((0, 1), (1, 0))
            if f"initialize_parallel did not complete within 3 s on rank {rank} of 2: rank(s) "
               f"[{other}] of the communicator did not call it" in job.printed]
    assert said and "Traceback" not in job.printed, str(job)


@single_process
@pytest.mark.mpi(min_size=1)
def test_initialize_parallel_where_another_rank_makes_a_mesh(tmp_path, bound):
    # Rank 0 waits for rank 1 to join its end-of-program hooks, which rank 1 (in Mesh) never
    # does: rank 0 stops waiting within the timeout. The error names both calls.
    job = launch(tmp_path, "init_mesh")
    ended(job, bound)
    assert "initialize_parallel() on ranks [0]; Mesh(x=2, innermost first) on ranks [1]" in \
        job.printed, str(job)


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("destroyed", ["0", "1"])
def test_initialize_parallel_after_destroy_parallel_on_some_ranks(tmp_path, bound, destroyed):
    # destroy_parallel is collective: called on one rank only, the next initialize_parallel
    # on every rank says so once, naming the rank that still holds its state, and both fail.
    job = launch(tmp_path, "destroy_some", destroyed)
    ended(job, bound)
    kept = 1 - int(destroyed)
    job.said_once(f"[pympar] RuntimeError on ranks 0, 1: initialize_parallel: a parallel state "
                  f"still exists on ranks [{kept}] but not on ranks [{destroyed}]: "
                  f"destroy_parallel() is collective and was called on some ranks only")
    job.check_exits({0: 1, 1: 1})


@single_process
@pytest.mark.mpi(min_size=1)
def test_should_stop_on_some_ranks_only(tmp_path, bound):
    job = launch(tmp_path, "should_stop")
    ended(job, bound, after=TIMEOUT)
    job.said_once("[pympar rank 0/2] uncaught CollectiveTimeoutError: all_reduce(shape=(1,), "
                  "dtype=int32, op='max') on group 'preemption-0-1' did not complete within 3 "
                  "s on rank 0 (global 0) of 2: rank 1 (global 1) did not arrive")


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mpi4py", [False, True])
def test_an_error_every_rank_raises_is_said_once_by_the_lowest_rank(tmp_path, bound, mpi4py):
    job = launch(tmp_path, "mismatch", mpi4py=mpi4py)
    ended(job, bound)
    job.said_once("[pympar] CollectiveMismatchError on ranks 0, 1: ")
    job.check_exits({0: 1, 1: 1})


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mpi4py", [False, True])
def test_a_layout_that_does_not_fit_is_said_once(tmp_path, bound, mpi4py):
    job = launch(tmp_path, "layout", ranks=3, mpi4py=mpi4py)
    ended(job, bound)
    job.said_once("[pympar] ValueError on ranks 0, 1, 2: world size 3 is not divisible by "
                  "tensor_parallel_size 2 x context_parallel_size 1 = 2: run it on a multiple "
                  "of 2 ranks (mpiexec -n 2 or -n 4), or use sizes whose product divides 3")
    job.check_exits({0: 1, 1: 1, 2: 1})


@single_process
@pytest.mark.mpi(min_size=1)
def test_debug_mode_adds_the_traceback_once(tmp_path, bound):
    job = launch(tmp_path, "mismatch", PYMPAR_DEBUG="1")
    ended(job, bound)
    assert job.printed.count("Traceback") == 1 and job.printed.count("[pympar]") == 1, str(job)


@single_process
@pytest.mark.mpi(min_size=1)
def test_info_with_a_bad_cuda_setting_ends(tmp_path, bound):
    job = launch(tmp_path, "trivial", command=[sys.executable, "-m", "pympar", "info"],
                 PYMPAR_CUDA_AWARE="maybe")
    # Every rank exits 2: whichever a launcher reports, the job's status is 2.
    assert job.status == 2 and job.seconds < bound, str(job)
    assert job.printed.count("PYMPAR_CUDA_AWARE must be auto, 0 or 1, not 'maybe'") == 1, \
        str(job)
    job.check_exits({0: 2, 1: 2})


@pytest.mark.mpi(min_size=1)
def test_the_hooks_live_from_initialize_parallel_to_destroy_parallel():
    manager.destroy_parallel()  # also removes what an earlier failed initialize left
    before = (sys.excepthook, threading.excepthook)
    manager.initialize_parallel()
    try:
        installed = (sys.excepthook is faults._excepthook
                     and threading.excepthook is faults._threading_excepthook
                     and (faults._exit_comm is not None) == (WORLD.size > 1))
    finally:
        manager.destroy_parallel()
    agree(installed and (sys.excepthook, threading.excepthook) == before
          and faults._exit_comm is None, "hooks not installed, or not removed")
