"""scripts/test_phases.sh (``make test``): every phase runs, and the summary says which passed.

A stand-in Python prints a pytest summary line and fails where told; a stand-in launcher runs
it once with the rank count in its environment. No MPI job is started. The cross-node phases
(``TEST_NODES_PHASE=1``) run where the probe finds two emulated nodes and say SKIPPED, and
why, under Open MPI or where the probe finds one node.
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
# The probe of the emulated nodes: the lowest rank of each rank's node.
if [[ $1 == -c ]]; then echo "emulated nodes: ${FAKE_NODES:-0 1 0 1}"; exit 0; fi
# A phase on emulated nodes is "<ranks>n" (FAIL_ON="4n" fails the 4 ranks on 2 nodes).
[[ -n ${MPIR_CVAR_ODD_EVEN_CLIQUES:-} ]] && n="${n}n"
echo "args: $* nodes=${PYMPAR_TEST_NODES:-} alias=${MPICH_ODD_EVEN_CLIQUES:-}"
echo "CuPy stand-in: $n CuPy tests passed on it on $n rank(s), 0 failed, 0 skipped"
if [[ " $FAIL_ON " == *" $n "* ]]; then echo "1 failed, 2 passed in 0.10s"; exit 1; fi
# As under Open MPI's mpirun: a NUL byte in the output, pytest's summary in colour.
if [[ -n ${FAKE_COLOUR:-} ]]; then
  printf '\\0\\n\\033[32m3 passed\\033[0m, \\033[33m1 skipped\\033[0m\\033[32m in 0.10s\\033[0m\\n'
  exit 0
fi
echo "3 passed, 1 skipped in 0.10s"
"""
LAUNCHER = """#!/usr/bin/env bash
[[ $1 == --version ]] && { echo "${FAKE_VERSION:-HYDRA build details:}"; exit 0; }
while [[ $1 != -n ]]; do shift; done   # --oversubscribe (Open MPI)
shift; n=$1; shift
FAKE_RANKS=$n exec "$@"
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _phases(tmp_path: Path, fail_on: str, nodes: str = "0", **fake: str
            ) -> subprocess.CompletedProcess:
    python = _script(tmp_path / "python", PYTHON)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MPIR_CVAR_", "MPICH_", "PYMPAR_TEST_NODES", "FAKE_"))}
    env.update(MPIEXEC=str(_script(tmp_path / "mpiexec", LAUNCHER)), FAIL_ON=fail_on,
               PYMPAR_LAUNCH_TIMEOUT="60", TEST_NODES_PHASE=nodes, **fake)
    return subprocess.run([str(ROOT / "scripts" / "test_phases.sh"), str(python), "2 4",
                           "-m", "pytest", "-q", "tests"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


def _summary(done: subprocess.CompletedProcess) -> list[str]:
    return done.stdout.split("== make test: summary ==\n")[1].splitlines()


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="runs once, in the singleton phase of make test")
def test_a_failing_first_phase_still_runs_and_reports_the_others(tmp_path):
    done = _phases(tmp_path, fail_on="1")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = _summary(done)
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


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="runs once, in the singleton phase of make test")
def test_the_summary_reads_a_coloured_log_with_nul_bytes(tmp_path):
    done = _phases(tmp_path, fail_on="", FAKE_COLOUR="1")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(done)
    assert [line.split(":", 1)[1].split()[:4] for line in summary[:3]] == [
        ["passed", "(3", "passed,", "1"]] * 3, summary


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="runs once, in the singleton phase of make test")
def test_the_cross_node_phases_run_their_files_on_emulated_nodes(tmp_path):
    done = _phases(tmp_path, fail_on="", nodes="1")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(done)
    assert [line.split(":")[0] for line in summary[:5]] == [
        "no launcher (1 rank)", "2 ranks", "4 ranks", "4 ranks, 2 emulated nodes",
        "2-rank jobs, 2 emulated nodes"], summary
    assert summary[3].split()[5:8] == ["passed", "(3", "passed,"], summary
    assert summary[-1].startswith("make test: all 5 phases passed in "), summary
    files = subprocess.run([str(ROOT / "scripts" / "test_phases.sh"), "--nodes-tests"],
                           capture_output=True, text=True, timeout=60).stdout.split()
    assert "tests/test_multinode.py" in files and "tests/test_agreement.py" in files, files
    assert all((ROOT / f).is_file() for f in files), files
    runs = [line for line in done.stdout.splitlines() if line.startswith("args: ")]
    # The main phases test "tests"; the cross-node ones their own files, NumPy only, with
    # PYMPAR_TEST_NODES=2; the jobs' phase also under the name their environment keeps.
    assert [r.split("-m pytest -q ")[1] for r in runs[:3]] == ["tests nodes= alias="] * 3, runs
    four, jobs = runs[3], runs[4]
    assert four.endswith(" nodes=2 alias=") and f"-k not cupy {' '.join(files)} " in four, four
    assert " tests " not in four and " tests " not in jobs, (four, jobs)
    assert jobs.endswith(" nodes=2 alias=1") and "tests/test_watchdog.py" in jobs, jobs


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="runs once, in the singleton phase of make test")
def test_the_cross_node_phases_fail_the_run_and_skip_where_nodes_cannot_be_emulated(tmp_path):
    done = _phases(tmp_path, fail_on="4n", nodes="1")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = " ".join(done.stdout.split())
    assert "4 ranks: passed" in summary and "4 ranks, 2 emulated nodes: FAILED (status 1)" \
        in summary and "2-rank jobs, 2 emulated nodes: passed" in summary, summary
    open_mpi = ("Open MPI has no cliques variable: its COMM_TYPE_SHARED always follows the real "
                "host")
    for fake, why in (({"FAKE_VERSION": "mpirun (Open MPI) 5.0.5"}, open_mpi),
                      # Open MPI 4 (Debian's, a cluster's) names its runtime instead
                      ({"FAKE_VERSION": "mpiexec (OpenRTE) 4.1.4"}, open_mpi),
                      ({"FAKE_NODES": "0 0 0 0"}, "this MPI's COMM_TYPE_SHARED ignores "
                       "MPIR_CVAR_ODD_EVEN_CLIQUES=1 (4 ranks, the lowest rank of each one's "
                       "node: 0 0 0 0)")):
        done = _phases(tmp_path, fail_on="", nodes="1", **fake)
        assert done.returncode == 0, done.stdout + done.stderr
        summary = _summary(done)
        assert summary[3].split() == ["4", "ranks,", "2", "emulated", "nodes:", "SKIPPED",
                                      *f"({why})".split()], summary
        assert summary[4].startswith("2-rank jobs, 2 emulated nodes:  SKIPPED ("), summary
        assert summary[-1].startswith("make test: all 3 phases passed in ") and \
            summary[-1].endswith(" (2 SKIPPED, above)"), summary
        assert done.stdout.count("args: ") == 3, "no cross-node phase ran"
