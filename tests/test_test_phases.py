"""scripts/test_phases.sh (``make test``): every phase runs, and the summary says which passed.

A stand-in Python prints a pytest summary line and fails where told; a stand-in launcher runs
it once with the rank count in its environment. No MPI job is started.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from mpi_helpers import WORLD

ROOT = Path(__file__).resolve().parent.parent

PYTHON = """#!/usr/bin/env bash
n=${FAKE_RANKS:-1}
echo "CuPy stand-in: $n CuPy tests passed on it on $n rank(s), 0 failed, 0 skipped"
if [[ " $FAIL_ON " == *" $n "* ]]; then echo "1 failed, 2 passed in 0.10s"; exit 1; fi
echo "3 passed, 1 skipped in 0.10s"
"""
LAUNCHER = """#!/usr/bin/env bash
[[ $1 == --version ]] && exit 0
shift; n=$1; shift
FAKE_RANKS=$n exec "$@"
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _phases(tmp_path: Path, fail_on: str) -> subprocess.CompletedProcess:
    python = _script(tmp_path / "python", PYTHON)
    env = dict(os.environ, MPIEXEC=str(_script(tmp_path / "mpiexec", LAUNCHER)),
               FAIL_ON=fail_on, PYMPAR_LAUNCH_TIMEOUT="60")
    return subprocess.run([str(ROOT / "scripts" / "test_phases.sh"), str(python), "2 4",
                           "-m", "pytest", "-q"], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="runs once, in the singleton phase of make test")
def test_a_failing_first_phase_still_runs_and_reports_the_others(tmp_path):
    done = _phases(tmp_path, fail_on="1")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = done.stdout.split("== make test: summary ==\n")[1].splitlines()
    assert summary[0].split() == ["no", "launcher", "(1", "rank):", "FAILED", "(status", "1)",
                                  "(1", "failed,", "2", "passed,", "0", "s)"], summary
    assert summary[1].split()[:5] == ["2", "ranks:", "passed", "(3", "passed,"], summary
    assert summary[2].split()[:5] == ["4", "ranks:", "passed", "(3", "passed,"], summary
    assert [line for line in summary if line.startswith("CuPy stand-in:")] == [
        f"CuPy stand-in: {n} CuPy tests passed on it on {n} rank(s), 0 failed, 0 skipped"
        for n in (1, 2, 4)]
    assert summary[-1].startswith("make test: FAILED in "), summary
    assert done.stdout.count("== pytest: ") == 3, "every phase runs"


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="runs once, in the singleton phase of make test")
def test_passing_phases_say_so_and_a_later_failure_fails_the_run(tmp_path):
    done = _phases(tmp_path, fail_on="")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("make test: all 3 phases passed in ")
    done = _phases(tmp_path, fail_on="4")
    assert done.returncode == 1 and "4 ranks: FAILED (status 1)" in " ".join(done.stdout.split())
