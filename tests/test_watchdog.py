"""Every job ends on its own terms: the watchdog, a rank that ends early, errors said once.

Each test launches its own 2- or 3-rank job (plain ``python script.py``, or under
``python -m mpi4py``) with the watchdog shortened to ``PYMPAR_TIMEOUT=3``, so they run in
the pass without a launcher only. Each rank runs under a small shell that prints
``[exit R] S`` with its own exit status, when the job does not abort. A job must end within
the timeout plus 10 s plus three times a measured trivial job (the launch and imports that
load stretches), never at the launcher's 90 s limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mpi_helpers import WORLD, agree
from pympar import faults, manager

REPO = Path(__file__).resolve().parent.parent
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
}


def launch(tmp_path: Path, scenario: str, *args: str, ranks: int = 2, mpi4py: bool = False,
           command: list[str] | None = None, **env: str) -> tuple[int, str, float]:
    """Run a scenario on ``ranks`` ranks; return (job status, output, seconds)."""
    script = tmp_path / f"{scenario}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCENARIOS[scenario]))
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PYMPAR_"))}
    clean.update(PYMPAR_LAUNCH_TIMEOUT="90", PYMPAR_TIMEOUT=str(TIMEOUT), **env,
                 PYTHONPATH=os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")]))
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if mpiexec.exists():
        clean.setdefault("MPIEXEC", str(mpiexec))
    program = command or [sys.executable, *(["-m", "mpi4py"] if mpi4py else []), str(script),
                          *args]
    shell = ('"$@"; s=$?; echo "[exit ${PMI_RANK:-$OMPI_COMM_WORLD_RANK}] $s" >&2; exit $s')
    start = time.monotonic()
    done = subprocess.run([str(REPO / "scripts" / "mpirun.sh"), str(ranks), "sh", "-c", shell,
                           "sh", *program], capture_output=True, text=True, timeout=120,
                          env=clean, cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def bound(tmp_path_factory) -> float:
    """The seconds a job may take to end: the timeout + 10 s + 3 trivial jobs, measured."""
    status, output, seconds = launch(tmp_path_factory.mktemp("baseline"), "trivial")
    assert status == 0, output
    return TIMEOUT + 10 + 3 * seconds


def exits(output: str) -> dict[int, int]:
    """Each rank's exit status, as its shell printed it."""
    return {int(r): int(s) for r, s in re.findall(r"\[exit (\d+)\] (\d+)", output)}


def said_once(line: str, output: str) -> None:
    """``line`` is the one line of pympar's in the output, and no traceback is shown."""
    lines = [x for x in output.splitlines() if "[pympar" in x]
    assert len(lines) == 1 and line in lines[0], output
    assert "Traceback" not in output, output


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("code,mpi4py,board", [("0", False, "shared"), ("3", False, "shared"),
                                               ("0", True, "shared"), ("3", True, "message")])
def test_a_rank_that_exits_ends_the_job_at_once(tmp_path, bound, code, mpi4py, board):
    status, output, seconds = launch(tmp_path, "exit", code, board, mpi4py=mpi4py)
    assert status != 0 and seconds < bound, (status, seconds, output)
    said_once("[pympar] PeerEndedError on rank 0: all_reduce(shape=(4,), dtype=float64, "
              "op='sum') on group 'tp-0-1': rank 1 (global 1) ended the program", output)
    # The waiting rank fails; the one that left keeps its own status.
    assert exits(output) == {0: 1, 1: int(code)}, output


@single_process
@pytest.mark.mpi(min_size=1)
def test_a_mapping_that_one_rank_calls_while_the_other_ends(tmp_path, bound):
    status, output, seconds = launch(tmp_path, "mapping_ended")
    assert status != 0 and seconds < bound, (status, seconds, output)
    said_once("[pympar] PeerEndedError on rank 1: all_reduce(shape=(4,), dtype=float64, "
              "op='sum') on group 'tp-0-1': rank 0 (global 0) ended the program", output)
    assert exits(output) == {0: 0, 1: 1}, output


@single_process
@pytest.mark.mpi(min_size=1)
def test_a_mapping_that_one_rank_calls_while_the_other_is_busy(tmp_path, bound):
    status, output, seconds = launch(tmp_path, "mapping_busy")
    assert status != 0 and TIMEOUT < seconds < bound, (status, seconds, output)
    said_once("[pympar rank 1/2] uncaught CollectiveTimeoutError: all_reduce(shape=(4,), "
              "dtype=float64, op='sum') on group 'tp-0-1' did not complete within 3 s on rank "
              "1 (global 1) of 2: rank 0 (global 0) did not arrive", output)


@single_process
@pytest.mark.mpi(min_size=1)
def test_initialize_parallel_on_some_ranks_only(tmp_path, bound):
    status, output, seconds = launch(tmp_path, "init_some")
    assert status != 0 and TIMEOUT < seconds < bound, (status, seconds, output)
    # No group exists yet: a roll call after the timeout names the rank that never came.
    said_once("[pympar rank 0/2] uncaught CollectiveTimeoutError: initialize_parallel did "
              "not complete within 3 s on rank 0 of 2: rank(s) [1] of the communicator did "
              "not call it", output)


@single_process
@pytest.mark.mpi(min_size=1)
def test_initialize_parallel_over_different_communicators(tmp_path, bound):
    status, output, seconds = launch(tmp_path, "init_comms")
    assert status != 0 and TIMEOUT < seconds < bound, (status, seconds, output)
    assert "initialize_parallel did not complete within 3 s on rank" in output, output
    # Each rank waits on its own communicator, where the other never calls it.
    for rank, other in ((0, 1), (1, 0)):
        assert (f"within 3 s on rank {rank} of 2: rank(s) [{other}] of the communicator did "
                f"not call it") in output, output
    assert "Traceback" not in output, output


@single_process
@pytest.mark.mpi(min_size=1)
def test_should_stop_on_some_ranks_only(tmp_path, bound):
    status, output, seconds = launch(tmp_path, "should_stop")
    assert status != 0 and TIMEOUT < seconds < bound, (status, seconds, output)
    said_once("[pympar rank 0/2] uncaught CollectiveTimeoutError: all_reduce(shape=(1,), "
              "dtype=int32, op='max') on group 'preemption-0-1' did not complete within 3 s "
              "on rank 0 (global 0) of 2: rank 1 (global 1) did not arrive", output)


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mpi4py", [False, True])
def test_an_error_every_rank_raises_is_said_once_by_the_lowest_rank(tmp_path, bound, mpi4py):
    status, output, seconds = launch(tmp_path, "mismatch", mpi4py=mpi4py)
    assert status != 0 and seconds < bound, (status, seconds, output)
    said_once("[pympar] CollectiveMismatchError on ranks 0, 1: ", output)
    assert exits(output) == {0: 1, 1: 1}, output


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mpi4py", [False, True])
def test_a_layout_that_does_not_fit_is_said_once(tmp_path, bound, mpi4py):
    status, output, seconds = launch(tmp_path, "layout", ranks=3, mpi4py=mpi4py)
    assert status != 0 and seconds < bound, (status, seconds, output)
    said_once("[pympar] ValueError on ranks 0, 1, 2: world size 3 is not divisible by "
              "tensor_parallel_size 2", output)
    assert exits(output) == {0: 1, 1: 1, 2: 1}, output


@single_process
@pytest.mark.mpi(min_size=1)
def test_debug_mode_adds_the_traceback_once(tmp_path, bound):
    status, output, seconds = launch(tmp_path, "mismatch", PYMPAR_DEBUG="1")
    assert status != 0 and seconds < bound, (status, seconds, output)
    assert output.count("Traceback") == 1 and output.count("[pympar]") == 1, output


@single_process
@pytest.mark.mpi(min_size=1)
def test_info_with_a_bad_cuda_setting_ends(tmp_path, bound):
    status, output, seconds = launch(
        tmp_path, "trivial", command=[sys.executable, "-m", "pympar", "info"],
        PYMPAR_CUDA_AWARE="maybe")
    assert status == 2 and seconds < bound, (status, seconds, output)
    assert output.count("PYMPAR_CUDA_AWARE must be auto, 0 or 1, not 'maybe'") == 1, output
    assert exits(output) == {0: 2, 1: 2}, output


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
