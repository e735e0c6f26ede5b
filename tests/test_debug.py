"""Debug mode and timeouts: mismatches and skipped collectives become errors on every rank.

In-process tests need >= 2 ranks. The end-to-end tests launch a 2-rank job of
``tests/debug_scripts/scenarios.py`` in a subprocess; they run in the pass
without a launcher (a world of one rank) so that the launch is not nested.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere
from pympar import debug, mappings
from pympar.debug import CollectiveMismatchError, debug_mode
from pympar.mesh import Mesh

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world():
    group = Mesh(WORLD, {"w": WORLD.size}).group("w")
    yield group
    group.free()


@pytest.fixture(autouse=True)
def switches_off():
    """Every test starts and ends with debug mode and the timeout off."""
    debug.disable()
    debug.set_timeout(None)
    yield
    debug.disable()
    debug.set_timeout(None)


# --------------------------------------------------------------------------- switches


@pytest.mark.mpi(min_size=1)
def test_switches_and_their_context_manager():
    assert not debug.is_enabled() and debug.get_timeout() is None
    debug.enable()
    assert debug.is_enabled()
    debug.disable()
    assert not debug.is_enabled()
    with debug_mode(timeout=2.5):
        assert debug.is_enabled() and debug.get_timeout() == 2.5
        with debug_mode(enabled=False):
            assert not debug.is_enabled() and debug.get_timeout() == 2.5
    assert not debug.is_enabled() and debug.get_timeout() is None
    debug.set_timeout(0)  # 0: never, as None
    assert debug.get_timeout() is None
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            debug.set_timeout(bad)


@pytest.mark.mpi(min_size=1)
def test_environment_parsing():
    assert debug._parse_flag("1") and debug._parse_flag(" yes ") and not debug._parse_flag("")
    assert not debug._parse_flag("0") and not debug._parse_flag("off")
    with pytest.raises(ValueError, match="PYMPAR_DEBUG"):
        debug._parse_flag("maybe")
    # Unset: the default watchdog (NCCL's 10 minutes); 0 turns it off.
    assert debug._parse_timeout("2.5") == 2.5 and debug._parse_timeout("") == 600.0
    assert debug.DEFAULT_TIMEOUT == 600.0 and debug._parse_timeout("0") is None
    with pytest.raises(ValueError, match="PYMPAR_TIMEOUT"):
        debug._parse_timeout("soon")
    with pytest.raises(ValueError, match="PYMPAR_TIMEOUT"):
        debug._parse_timeout("-3")


# --------------------------------------------------------------------------- mismatches


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_names_every_rank_and_debug_mode_where_it_was_called(world):
    r = WORLD.rank
    for enabled in (False, True):
        with debug_mode(enabled):
            err = raises_everywhere(CollectiveMismatchError, f"group '{world.name}'",
                                    world.all_reduce, np.zeros((4, 3 + (r == 1))))
        text = str(err)
        others = "rank 0 (global 0)" if WORLD.size == 2 else "ranks 0, 2"
        # One line, each call once, with the ranks that made it.
        agree(f"{others}" in text.split(": all_reduce(shape=(4, 3)")[0]
              and "rank 1 (global 1): all_reduce(shape=(4, 4)" in text
              and text.count("all_reduce(shape=(4, 3)") == 1 and "\n" not in text, text)
        # Debug mode adds where each rank called in (raises_everywhere), and only that.
        agree(("at mpi_helpers.py:" in text) == enabled, text)
    # The check completed on every rank: the group is still usable.
    assert_equal(world.all_reduce(np.ones(2)), np.full(2, float(WORLD.size)))


@pytest.mark.mpi(min_size=2)
def test_gather_checks_other_dims_but_allows_uneven_axis(world):
    r = WORLD.rank
    if True:
        y = world.all_gather(np.full((1 + r % 2, 3), float(r)), axis=0)
        expected = np.concatenate([np.full((1 + q % 2, 3), float(q)) for q in range(WORLD.size)])
        assert_equal(y, expected)
        raises_everywhere(CollectiveMismatchError, "all_gather",
                          world.all_gather, np.zeros((2, 3 + (r == 1))), 0)
        sizes = [2] * WORLD.size
        if r == 1:
            sizes[0] = 3  # rank 1 claims another size for rank 0
        raises_everywhere(CollectiveMismatchError, "sizes",
                          world.all_gather, np.zeros((2, 3)), 0, sizes=sizes)


@pytest.mark.mpi(min_size=2)
def test_different_mappings_on_different_ranks_raise(world):
    r = WORLD.rank
    x = np.ones((2, 3))
    # The same all-reduce under two mappings' labels.
    mapping = mappings.copy_to_all.backward if r == 0 else mappings.reduce_from_all
    err = raises_everywhere(CollectiveMismatchError, "copy_to_all.backward", mapping, x, world)
    agree("reduce_from_all.forward" in str(err), str(err))
    # Matching calls pass.
    y = mappings.gather_from_sequence(np.ones((1 + r % 2, 2)), world)
    agree(y.shape == (sum(1 + q % 2 for q in range(WORLD.size)), 2), str(y.shape))


# --------------------------------------------------------------------------- timeouts


@pytest.mark.mpi(min_size=1)
def test_collectives_with_a_timeout_give_the_same_results(world):
    """With a timeout set every collective runs as its non-blocking variant."""
    p, r = world.size, world.rank
    rng = np.random.default_rng(3)
    full = rng.standard_normal((2 * p + 1, 3, p + 2))
    inputs = [rng.standard_normal(full.shape) for _ in range(p)]
    mine = np.array_split(full, p, axis=2)[r]
    blocking = [world.all_reduce(inputs[r]), world.all_gather(mine, 2),
                world.reduce_scatter(inputs[r], 2), world.all_to_all(mine, 0, 2),
                world.broadcast(inputs[r], root=p - 1)]
    for enabled in (False, True):
        with debug_mode(enabled=enabled, timeout=60.0):
            timed = [world.all_reduce(inputs[r]), world.all_gather(mine, 2),
                     world.reduce_scatter(inputs[r], 2), world.all_to_all(mine, 0, 2),
                     world.broadcast(inputs[r], root=p - 1)]
        # Sums may round differently: MPI does not promise Iallreduce the same reduction
        # order as Allreduce (Open MPI on 4 ranks differs in the last bit). Moves are exact.
        for name, a, b in zip(("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                               "broadcast"), timed, blocking):
            if name in ("all_reduce", "reduce_scatter"):
                assert_close(a, b, rtol=1e-14, atol=1e-14, what=f"{name} debug={enabled}")
            else:
                assert_equal(a, b, f"{name} debug={enabled}")


# --------------------------------------------------------------------------- whole jobs


def launch(scenario: str, **env: str) -> tuple[int, str]:
    """Run a 2-rank job of the scenario script; return (exit status, stdout + stderr)."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    found = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PYMPAR_"))}
    clean.update(MPIEXEC=found, PYMPAR_LAUNCH_TIMEOUT="90",
                 PYTHONPATH=os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")]), **env)
    command = [str(REPO / "scripts" / "mpirun.sh"), "2", sys.executable, "-m", "mpi4py",
               str(REPO / "tests" / "debug_scripts" / "scenarios.py"), scenario]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=clean,
                          cwd=REPO)
    return done.returncode, done.stdout + done.stderr


def said_by(rank: int, output: str) -> str:
    """The first line a rank printed (the launcher may glue two ranks' lines together)."""
    start = output.find(f"[rank {rank}] ")
    if start < 0:
        return ""
    text = output[start + 1:]
    ends = [i for i in (text.find("\n"), text.find("[rank ")) if i >= 0]
    return text[:min(ends)] if ends else text


single_process = pytest.mark.skipif(WORLD.size != 1, reason="launches its own 2-rank job; "
                                    "runs in the pass without a launcher")


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("scenario,env,expected", [
    ("shapes", {"PYMPAR_DEBUG": "1"},
     ["CollectiveMismatchError", "group 'w-0-1'", "all_reduce(shape=(4, 3)",
      "all_reduce(shape=(4, 4)"]),
    ("dtypes", {"PYMPAR_DEBUG": "1"},
     ["CollectiveMismatchError", "dtype=float64", "dtype=float32"]),
    ("mappings_differ", {"PYMPAR_DEBUG": "1"},
     ["CollectiveMismatchError", "copy_to_all.backward", "reduce_from_all.forward",
      "scenarios.py:"]),
    ("timed_rows", {"PYMPAR_TIMEOUT": "5"},
     ["CollectiveMismatchError", "all_reduce(shape=(32, 8)", "all_reduce(shape=(16, 8)",
      "reduce_from_all.forward"]),
    # Nothing set: float32 against int32 (same item size).
    ("big_dtypes", {}, ["CollectiveMismatchError", "dtype=float32", "dtype=int32"]),
])
def test_checks_end_a_mismatched_job_with_the_error_on_every_rank(scenario, env, expected):
    status, output = launch(scenario, **env)  # ended: launch() allows 90 s, load included
    assert status != 0, output
    for rank in (0, 1):
        message = said_by(rank, output)
        assert message and all(text in message for text in expected), output


@single_process
@pytest.mark.mpi(min_size=1)
def test_timeout_ends_a_job_where_a_rank_skips_a_collective():
    status, output = launch("skipped", PYMPAR_TIMEOUT="1")
    assert status != 0, output
    assert said_by(0, output).startswith(
        "rank 0] CollectiveTimeoutError: all_reduce(shape=(4,), dtype=float64, op='sum') on "
        "group 'w-0-1' did not complete within 1 s on rank 0 (global 0)"), output
    assert said_by(1, output).startswith(
        "rank 1] CollectiveTimeoutError: all_gather(shape=(4,), dtype=float64, axis=0, "
        "sizes=(4, 4)) on group 'aux-0-1' did not complete within 1 s on rank 1 (global 1)"), output


@single_process
@pytest.mark.mpi(min_size=1)
def test_debug_mode_lets_a_correct_job_finish():
    status, output = launch("matching", PYMPAR_DEBUG="1", PYMPAR_TIMEOUT="30")
    assert status == 0, output
    assert "[rank 0] completed" in output and "[rank 1] completed" in output, output


@pytest.mark.mpi(min_size=2)
def test_a_size_that_fits_only_some_ranks_raises_everywhere(world):
    """``global_size=`` skips the size exchange; a wrong one raises on every rank."""
    x = np.zeros((3, 4))  # every rank holds 3 rows, but size=5 gives rank 0 three, rank 1 two
    with debug_mode(enabled=True, timeout=30.0):
        raises_everywhere(CollectiveMismatchError, "do not fit",
                          mappings.gather_from_sequence, x, world, global_size=3 * world.size - 1)


# --------------------------------------------------------------------------- always-on check

@pytest.mark.mpi(min_size=2)
def test_default_check_catches_what_ranks_must_agree_on(world):
    """Without debug mode or a timeout, every call is checked, whatever its size."""
    r, p = world.rank, world.size
    odd = r == 1
    for row in (8, 8192):
        x = np.ones((2, row))
        raises_everywhere(CollectiveMismatchError, "dtype=int32", world.all_reduce,
                          x.astype(np.int32 if odd else np.float32))
        raises_everywhere(CollectiveMismatchError, "root=1", world.broadcast, x, root=int(odd))
    ROW = 8192
    raises_everywhere(CollectiveMismatchError, "dtype=float32", world.all_reduce,
                      x.astype(np.float32 if odd else np.float64))
    raises_everywhere(CollectiveMismatchError, r"shape=\(3, 8192\)", world.all_reduce,
                      np.ones((2 + odd, ROW)))
    raises_everywhere(CollectiveMismatchError, "op='max'", world.reduce_scatter,
                      np.ones((p, ROW)), 0, None, "max" if odd else "sum")
    # Two mappings whose collectives are the same all_gather: the labels differ.
    mine = np.ones((2, ROW))
    call = (mappings.gather_from_sequence if odd else
            mappings.reduce_scatter_to_sequence.backward)
    raises_everywhere(CollectiveMismatchError, "gather_from_sequence.forward", call, mine,
                      world, global_size=2 * p)
    # A global_size that differs per rank but fits each rank's block.
    raises_everywhere(CollectiveMismatchError, "sizes=", mappings.gather_from_sequence,
                      np.ones((3, ROW)), world, global_size=3 * p + odd)
    # A global_size that fits rank 1's block only: rank 0 refuses, rank 1 learns of it.
    raises_everywhere(CollectiveMismatchError, "do not fit",
                      mappings.gather_from_sequence, np.ones((3, ROW)), world,
                      global_size=3 * p + (r == 0))
    # The group is still usable, and agreeing calls pass.
    y = world.all_reduce(x)
    agree(np.array_equal(y, np.full_like(x, p)), "sum after the mismatches")
