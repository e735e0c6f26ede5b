"""pympar.preemption: a signal on one rank, or the stop file, stops every rank at one step."""

from __future__ import annotations

import os
import signal

import pytest

from mpi_helpers import WORLD, agree
from pympar.preemption import REQUEUE_STATUS, STOP_FILE_VARIABLE, Preemption


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


@pytest.mark.mpi(min_size=1)
def test_stop_file_stops_every_rank_at_start_and_later(tmp_path, monkeypatch):
    """Rank 0 looks for $PYMPAR_STOP_FILE when Preemption starts and at every boundary."""
    path = os.path.join(str(tmp_path), "stop")  # rank 0's path is the one that counts
    path = WORLD.bcast(path, root=0)
    monkeypatch.setenv(STOP_FILE_VARIABLE, path)
    with Preemption(WORLD) as stop:
        quiet = stop.should_stop()
        if WORLD.rank == 0:
            open(path, "w").close()
        later = stop.should_stop()
        watching = stop.stop_file == (path if WORLD.rank == 0 else None)
    with Preemption(WORLD) as stop:   # the file was there before: a request made early
        early = stop.requested_at_start == (WORLD.rank == 0) and stop.should_stop()
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.remove(path)
    WORLD.Barrier()
    with Preemption(WORLD, stop_file="") as stop:  # "" (or no variable): no stop file
        none = stop.stop_file is None and not stop.should_stop()
    agree(not quiet and later and watching and early and none,
          f"quiet {quiet}, later {later}, watching {watching}, early {early}, none {none}")


def test_requeue_status_is_the_scripts():
    """The program and the batch script agree on the status that asks for a requeue."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "requeue.sh"
    assert f"PYMPAR_REQUEUE_STATUS={REQUEUE_STATUS}" in script.read_text(encoding="utf-8")
    assert STOP_FILE_VARIABLE == "PYMPAR_STOP_FILE"
