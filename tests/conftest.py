"""Test harness shared by every rank.

The suite runs without a launcher and under ``mpiexec -n N python -m mpi4py -m
pytest --with-mpi``. Every rank runs the same tests in the same order, so after
each test the ranks agree on a verdict: a test that failed on any rank fails on
every rank (``failed on ranks [...]``), and only rank 0 prints pytest's report;
other ranks print their own failures to stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

import gpu_stand_in
from pympar import manager
from pympar.mesh import Mesh

WORLD = MPI.COMM_WORLD
# The verdict exchange has a communicator of its own, so it can never be matched
# with a collective that a failing test left half-done on other ranks.
VERDICT = WORLD.Dup()
SYNC_TIMEOUT = float(os.environ.get("PYMPAR_TEST_SYNC_TIMEOUT", "180"))

_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def clean_state():
    """No current parallel state when the test starts, and none left when it ends."""
    manager.destroy_parallel()
    yield
    manager.destroy_parallel()


@pytest.fixture
def cube(clean_state):
    """A 3D parallel state of depth 2 (skips unless the world size is a multiple of 8)."""
    if WORLD.Get_size() % 8:
        pytest.skip("needs a depth-2 cube: a world size that is a multiple of 8")
    manager.initialize_parallel(8, tensor_parallel_mode="3d")


@pytest.fixture(params=["numpy", "cupy-staged", "cupy-aware"])
def xp(request: pytest.FixtureRequest):
    """The array module under test; CuPy both staged and CUDA-aware (gpu_stand_in)."""
    if request.param == "numpy":
        return np
    return gpu_stand_in.cupy_in_mode(request.param.split("-")[1])


@pytest.fixture(scope="module")
def groups():
    """The whole world and, with >= 4 ranks, TP groups of 2 inside it."""
    made = {"world": Mesh(WORLD, {"w": WORLD.size}).group("w")}
    if WORLD.size >= 4 and WORLD.size % 2 == 0:
        made["tp2"] = Mesh(WORLD, {"tp": 2, "dp": WORLD.size // 2}).group("tp")
    yield made
    for group in made.values():
        group.free()


@pytest.fixture(params=["world", "tp2"])
def group(request: pytest.FixtureRequest, groups: dict):
    """A group: the world, or a TP group of 2 that is not the whole world."""
    if request.param not in groups:
        pytest.skip("a TP group of 2 inside the world needs an even world of >= 4 ranks")
    return groups[request.param]


@pytest.fixture
def shared_dir():
    """A temporary directory that every rank of the world sees, removed at the end."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="pympar-test-") if WORLD.rank == 0 else None)
    yield path
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def saved_figures(monkeypatch):
    """Every matplotlib figure saved during the test, by file name (kept open until its end)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure
    import matplotlib.pyplot as plt

    figures = {}
    real_savefig, real_close = matplotlib.figure.Figure.savefig, plt.close

    def savefig(fig, path, **kwargs):
        figures[os.path.basename(path)] = fig
        return real_savefig(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    yield figures
    for fig in figures.values():
        real_close(fig)


def pytest_addoption(parser: pytest.Parser) -> None:
    gpu_stand_in.add_option(parser)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    gpu_stand_in.configure(config)
    if WORLD.Get_size() > 1 and config.option.basetemp is None:
        # pytest's shared temporary root is pruned by every process at start-up: ranks
        # racing to prune it warn. One fixed root per rank, emptied by pytest each session.
        config.option.basetemp = os.path.join(tempfile.gettempdir(),
                                              f"pympar-pytest-rank{WORLD.Get_rank()}")
    if WORLD.Get_rank() != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.stash[_FAILED] = True
    if report.when != "teardown" or WORLD.Get_size() == 1:
        return
    failed_here = item.stash.get(_FAILED, False)
    failed = [r for r, f in enumerate(_exchange_verdicts(failed_here, item.nodeid)) if f]
    if failed and not failed_here:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} failed on ranks {failed} (see their stderr)"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if WORLD.Get_rank() != 0 and report.failed and "failed on ranks" not in str(report.longrepr):
        sys.stderr.write(f"\n[rank {WORLD.Get_rank()}] FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()


def _exchange_verdicts(failed_here: bool, nodeid: str) -> np.ndarray:
    """All ranks' verdicts; aborts the job when some rank never arrives.

    A rank that failed early reaches this point while the others may still wait
    inside one of the test's collectives: they would wait forever, so after
    ``PYMPAR_TEST_SYNC_TIMEOUT`` seconds the job is aborted with a message.
    """
    mine = np.array([failed_here], dtype=np.int8)
    verdicts = np.zeros(WORLD.Get_size(), dtype=np.int8)
    request = VERDICT.Iallgather(mine, verdicts)
    deadline = time.monotonic() + SYNC_TIMEOUT
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(f"\n[rank {WORLD.Get_rank()}] {nodeid}: other ranks did not finish "
                             f"this test within {SYNC_TIMEOUT:.0f} s (a rank failed while others "
                             "wait in a collective?); aborting the job\n")
            sys.stderr.flush()
            WORLD.Abort(1)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return verdicts
