"""pympar.preemption: a signal on one rank stops every rank at the same step boundary."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from mpi_helpers import WORLD, agree
from pympar.preemption import Preemption


@pytest.mark.mpi(min_size=1)
def test_signal_on_one_rank_stops_all():
    previous = signal.getsignal(signal.SIGUSR1)
    with Preemption(WORLD) as stop:
        quiet = stop.should_stop()
        if WORLD.rank == WORLD.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # handled at once: only sets the flag
        stopped = stop.should_stop()
        mine = stop.requested()
    agree(not quiet and stopped and mine == (WORLD.rank == WORLD.size - 1)
          and signal.getsignal(signal.SIGUSR1) is previous,
          f"before {quiet}, after {stopped}, requested here {mine}")


@pytest.mark.mpi(min_size=1)
def test_sigterm_and_budget():
    with Preemption(WORLD, budget=3600) as stop:
        if WORLD.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        agree(stop.should_stop() and (WORLD.rank != 0 or stop.received == signal.SIGTERM),
              "SIGTERM on rank 0 did not stop every rank")
    with Preemption(WORLD, signals=["SIGUSR2"], budget=0.0) as stop:
        agree(stop.should_stop(), "a spent budget did not stop")
    with pytest.raises(ValueError, match="budget must be >= 0"):
        Preemption(WORLD, budget=-1)


def test_requeue_only_under_slurm_with_scontrol(tmp_path, monkeypatch):
    log = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with Preemption(WORLD) as stop:
        outside = stop.requeue()
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        inside = stop.requeue()
    want = WORLD.rank == 0
    calls = log.read_text().split("\n") if log.exists() else []
    agree(not outside and inside == want and calls[:1] == (["requeue 4242"] if want else []),
          f"outside {outside}, inside {inside}, calls {calls}")
