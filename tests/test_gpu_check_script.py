"""scripts/gpu_check.sh on a machine without a GPU: NOT TESTED, with the reason, in seconds."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_without_a_gpu_says_not_tested_within_10_s(tmp_path):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("runs once, in the singleton phase of make test")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPIEXEC")}
    probe = subprocess.run([sys.executable, "-c", "import cupy; "
                            "assert cupy.cuda.runtime.getDeviceCount() > 0"], env=env,
                           capture_output=True, timeout=60)
    if probe.returncode == 0:
        pytest.skip("needs a machine without a GPU: this one has CuPy and a device")
    env.update(PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path))
    start = time.monotonic()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, run.stderr
    assert took < 10, f"took {took:.1f} s"
    assert lines[-1].startswith("VERDICT: NOT TESTED (no CUDA GPU with CuPy"), lines
    assert "No module named 'cupy'" in lines[-1] or "CUDA" in lines[-1], lines
    assert (tmp_path / "summary.txt").read_text().strip().splitlines() == lines
