"""The requeue protocol of examples/slurm/requeue.sh with the real example, no Slurm needed.

A bash "batch shell" sources requeue.sh (as the sbatch scripts do) and runs the real
``examples/burgers.py`` on 2 ranks through ``run_step``, with ``scripts/mpirun.sh`` in
place of ``srun`` and a fake ``scontrol`` that records its calls. Three runs end as the
protocol says: stopped by a signal to the batch shell before its step started (requeued),
signalled through its step only (requeued), finished (not requeued). ``make test-slurm``
runs the same under a real Slurm. Each test starts its own mpiexec job, so they run in the
one-rank session of the suite only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_helpers import WORLD
from pympar import checkpoint
from pympar.preemption import REQUEUE_STATUS
from test_checkpoint_example import SMALL, rank_pids

REPO = Path(__file__).resolve().parent.parent
REQUEUE_SH = REPO / "examples" / "slurm" / "requeue.sh"

pytestmark = pytest.mark.skipif(WORLD.size > 1, reason="starts its own mpiexec job; runs in "
                                "the one-rank session only")

#: The batch shell: sources requeue.sh, says it is ready, waits for $1 to exist (when set),
#: then runs the step.
SHELL = """set -euo pipefail
cd "$REPO"
. examples/slurm/requeue.sh
touch "$WORK/ready"
while [[ -n ${WAIT_FOR:-} && ! -e $WAIT_FOR ]]; do sleep 0.05; done
run_step scripts/mpirun.sh 2 "$PYTHON" -m mpi4py examples/burgers.py "$@"
echo "batch shell: run_step returned $?"
"""


def batch_shell(tmp_path: Path, flags: list[str], wait_for: str = "") -> subprocess.Popen:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text('#!/bin/sh\necho "scontrol $*" >> "$WORK/calls"\n')
    (fake / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL",
                                "SLURM_", "PYMPAR_STOP"))}
    env.update(PATH=f"{fake}{os.pathsep}{env['PATH']}", REPO=str(REPO), WORK=str(tmp_path),
               PYTHON=sys.executable, SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(tmp_path),
               WAIT_FOR=wait_for,
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    (tmp_path / "shell.sh").write_text(SHELL)
    args = [a for a in SMALL if a != "--quiet"] + [
        "--cp", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
        "--out", str(tmp_path / "out"), *flags]
    return subprocess.Popen(["bash", str(tmp_path / "shell.sh"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition(), (proc.poll(), proc.stdout.read() if proc.poll() is not None else "")


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_signal_to_the_batch_shell_before_the_step_requeues(tmp_path):
    """SIGUSR1 reaches the shell before the program exists: it is not lost (stop file)."""
    stop = tmp_path / ".pympar-stop-4242"
    shell = batch_shell(tmp_path, ["--steps", "6"], wait_for=str(stop))
    wait_for((tmp_path / "ready").exists, shell)
    shell.send_signal(signal.SIGUSR1)   # before run_step has started anything
    out, _ = shell.communicate(timeout=240)
    assert shell.returncode == 0 and "asking the program to stop" in out, out
    assert f"exiting with status {REQUEUE_STATUS}" in out and "step 0 saved" in out, out
    assert calls(tmp_path) == ["scontrol requeue 4242"], (calls(tmp_path), out)
    assert "batch shell: run_step returned 0" in out and not stop.exists(), out
    assert checkpoint.latest(tmp_path / "ckpt").endswith("step_00000000")


def test_signal_to_the_step_only_requeues(tmp_path):
    """The batch shell sees no signal: run_step requeues on the program's status 75."""
    ckpt = tmp_path / "ckpt"
    shell = batch_shell(tmp_path, ["--steps", "100000", "--checkpoint-every", "20"])
    wait_for(lambda: checkpoint.latest(ckpt) is not None, shell)
    pids = rank_pids(str(ckpt))
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGUSR1)
    out, _ = shell.communicate(timeout=120)
    assert shell.returncode == 0 and "asking the program to stop" not in out, out
    assert calls(tmp_path) == ["scontrol requeue 4242"], (calls(tmp_path), out)
    step = json.loads((Path(checkpoint.latest(ckpt)) / "manifest.json").read_text())["step"]
    assert 20 <= step < 100000 and f"step {step} saved" in out, (step, out)


def test_finished_run_is_not_requeued(tmp_path):
    shell = batch_shell(tmp_path, ["--steps", "4"])
    out, _ = shell.communicate(timeout=240)
    assert shell.returncode == 0 and "batch shell: run_step returned 0" in out, out
    assert calls(tmp_path) == [] and "requeueing" not in out, (calls(tmp_path), out)
    assert len(json.loads((tmp_path / "out" / "metrics.json").read_text())["losses"]) == 4


def test_failed_run_is_not_requeued(tmp_path):
    """Any status but 75 is the step's own: returned as it is, never a requeue."""
    shell = batch_shell(tmp_path, ["--steps", "4", "--heads", "3"])  # 8 % 3: refused, 2
    out, _ = shell.communicate(timeout=240)
    assert shell.returncode == 2 and calls(tmp_path) == [], (shell.returncode, out)


def _fnv1a(text: str) -> str:
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return f"{value:x}"


def test_requeued_run_removes_this_jobs_stale_mpich_segments(tmp_path):
    """Sourcing requeue.sh in a requeued run deletes /dev/shm/mpich_shm_<hash of job.step>_*
    of this job, and nothing of another job."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    job = str(900000 + os.getpid() % 90000)
    mine = [Path(f"/dev/shm/mpich_shm_{_fnv1a(f'{job}.{step}')}_{node}")
            for step, node in [(0, 0), (1, 0), (1, 1), (63, 0)]]
    other = Path(f"/dev/shm/mpich_shm_{_fnv1a(f'{int(job) + 1}.1')}_0")
    for path in mine + [other]:
        path.write_bytes(b"\xff" * 4096)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SLURM_JOB_ID=job, SLURM_RESTART_COUNT="1", SLURM_SUBMIT_DIR=str(tmp_path))
        done = subprocess.run(["bash", "-c", f". {REQUEUE_SH}; mpich_shm_hash {job}.1"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == _fnv1a(f"{job}.1")
        assert not any(p.exists() for p in mine) and other.exists(), done.stderr
        assert done.stderr.count("run_step: removing /dev/shm/mpich_shm_") == len(mine)
        env["SLURM_RESTART_COUNT"] = "0"  # a first run has nothing of its own to remove
        mine[0].write_bytes(b"\xff")
        subprocess.run(["bash", "-c", f". {REQUEUE_SH}"], env=env, timeout=60, check=True)
        assert mine[0].exists()
    finally:
        for path in mine + [other]:
            path.unlink(missing_ok=True)
