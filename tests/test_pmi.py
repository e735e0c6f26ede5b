"""pympar.pmi: srun's wrong PMI plugin (one world of one rank per task) is named once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree
from pympar.pmi import LauncherMismatchError, check_launcher, first_task, slurm_step_tasks

REPO = Path(__file__).resolve().parent.parent
SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
              "SLURM_NTASKS": "4", "SLURM_NPROCS": "4"}


def _clear(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


@pytest.mark.mpi(min_size=1)
def test_mismatch_raises_only_in_a_world_of_one(monkeypatch):
    _clear(monkeypatch)
    for name, value in {**SLURM_STEP, "SLURM_PROCID": str(WORLD.rank)}.items():
        monkeypatch.setenv(name, value)
    try:
        check_launcher()
        raised = None
    except LauncherMismatchError as err:
        raised = str(err)
    if WORLD.size == 1:
        check_launcher(MPI.COMM_SELF)  # many one-rank jobs on COMM_SELF, on purpose: fine
        ok = raised is not None and "--mpi=pmi2" in raised and "4 tasks" in raised
    else:
        ok = raised is None          # the plugin works: MPI sees the tasks as one world
    agree(ok, f"raised {raised!r} on a world of {WORLD.size}")


def test_task_counts_come_from_the_step_not_the_batch_script(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("SLURM_NTASKS", "8")      # the batch script sees the job's tasks ...
    assert slurm_step_tasks() == 0               # ... but is no step: nothing to check
    if WORLD.size == 1:
        check_launcher()
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert slurm_step_tasks() == 8
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert slurm_step_tasks() == 2
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert first_task() is False or WORLD.size > 1


TASK = """from pympar import manager
manager.initialize_parallel(2)
print("unreachable")
"""


@pytest.mark.skipif(WORLD.size > 1, reason="starts its own processes; one-rank session only")
@pytest.mark.parametrize("program, status", [
    (["-m", "mpi4py", "examples/burgers.py", "--tp", "2", "--cp", "2", "--steps", "2"], 2),
    (["-c", TASK], 1)], ids=["burgers", "initialize_parallel"])
def test_four_tasks_of_one_rank_each_say_it_once_and_all_fail(tmp_path, program, status):
    """What ``srun --mpi=none -n 4`` starts: 4 singletons that Slurm calls tasks 0..3."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL",
                                 "SLURM_"))}
    base["PYTHONPATH"] = f"{REPO}{os.pathsep}{base.get('PYTHONPATH', '')}"
    extra = ["--out", str(tmp_path)] if "examples/burgers.py" in program else []
    tasks = [subprocess.Popen([sys.executable, *program, *extra], cwd=REPO, env={**base, **SLURM_STEP, "SLURM_PROCID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    results = [task.communicate(timeout=300) + (task.returncode,) for task in tasks]
    lines = [line for out, err, _ in results for line in (out + err).splitlines() if line]
    assert [code for _, _, code in results] == [status] * 4, results
    assert len(lines) == 1 and "srun --mpi=pmi2" in lines[0] and "error:" in lines[0], lines
    assert results[0][1].strip() == lines[0], "task 0 prints it"
