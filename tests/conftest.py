"""Test harness shared by every rank.

The suite runs without a launcher and under ``mpiexec -n N python -m mpi4py -m
pytest --with-mpi``. Every rank runs the same tests in the same order, so after
each test the ranks agree on a verdict: a test that failed on any rank fails on
every rank (``failed on ranks [...]``), and only rank 0 prints pytest's report;
other ranks print their own failures to stderr.
"""

from __future__ import annotations

import sys

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD

_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
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
    failed = [r for r, f in enumerate(WORLD.allgather(failed_here)) if f]
    if failed and not failed_here:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} failed on ranks {failed} (see their stderr)"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if WORLD.Get_rank() != 0 and report.failed and "failed on ranks" not in str(report.longrepr):
        sys.stderr.write(f"\n[rank {WORLD.Get_rank()}] FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
