"""Checkpoint and restart of examples/burgers.py: bitwise resume, other layouts, kill, signal.

The in-process tests run the example's ``train`` on the test's ranks. The two tests that need
a job of their own (a rank killed with SIGKILL, SIGUSR1 sent to one rank of a 4-rank mpiexec
run) start ``scripts/mpirun.sh`` themselves, and so run only in the one-rank session of the
suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from checkpoint_helpers import differing_tensors
from mpi_helpers import WORLD, agree
from pympar import checkpoint
from pympar.preemption import REQUEUE_STATUS
from test_examples import TINY, load

REPO = Path(__file__).resolve().parent.parent
SMALL = [a for a in TINY if a != "--quiet"] + ["--quiet"]



def run(burgers, flags, comm=WORLD):
    return burgers.train(burgers.parse_args(SMALL + flags), comm)


def layout_flags(world):
    """A layout with tensor parallelism 1 using every rank (context first, then data)."""
    cp = 2 if world % 2 == 0 else 1
    return ["--cp", str(cp)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("resume_flags", [[], ["--recompute"]], ids=["same", "recompute"])
def test_resume_same_layout_is_bitwise(shared_dir, resume_flags):
    """Also with --recompute switched on at the restart: it keeps the parameter names and is
    bitwise, so the run is the same."""
    burgers = load("burgers")
    flags = layout_flags(WORLD.size) + ["--steps", "6", "--checkpoint-every", "3"]
    straight = run(burgers, flags + ["--checkpoint-dir", os.path.join(shared_dir, "a")])
    if WORLD.rank == 0:  # stop after step 3: resume from there
        shutil.copytree(os.path.join(shared_dir, "a", "step_00000003"),
                        os.path.join(shared_dir, "b", "step_00000003"))
    WORLD.Barrier()
    resumed = run(burgers, flags + resume_flags + ["--checkpoint-dir",
                                                   os.path.join(shared_dir, "b"), "--resume"])
    a, b = (os.path.join(shared_dir, x, "step_00000006") for x in "ab")
    differ = differing_tensors(a, b)
    agree(resumed["losses"] == straight["losses"] and not differ
          and resumed["val_rel_l2"] == straight["val_rel_l2"],
          f"losses {resumed['losses']} vs {straight['losses']}; differ {differ}")


def resume_cases(world):
    """(save layout, [(resume layout, ranks)]) that fit ``world`` ranks; ranks 1 = serial."""
    cases = []
    if world % 2 == 0:
        cases.append((["--cp", "2"], [(["--dp", str(world)], world), (["--cp", str(world)], world),
                                      (["--dp", "2"], 2), ([], 1)]))
    if world % 4 == 0:
        cases.append((["--tp", "2", "--cp", "2"],
                      [(["--tp", "4"], 4), (["--dp", "2", "--tp", "1"], 2), ([], 1)]
                      + ([(["--tp", "8", "--mode", "3d"], 8)] if world == 8 else [])))
    return cases


@pytest.mark.mpi(min_size=2)
def test_resume_under_other_layouts(shared_dir):
    burgers = load("burgers")
    steps = ["--steps", "6"]
    reference = run(burgers, steps, MPI.COMM_SELF)["losses"]
    bad = []
    for i, (saved, targets) in enumerate(resume_cases(WORLD.size)):
        root = os.path.join(shared_dir, str(i))
        run(burgers, saved + steps + ["--checkpoint-dir", os.path.join(root, "src"),
                                      "--checkpoint-every", "3"])
        for j, (target, ranks) in enumerate(targets):
            # The first ``ranks`` ranks resume together (one rank: the serial layers).
            where = os.path.join(root, str(j))
            if WORLD.rank == 0:
                shutil.copytree(os.path.join(root, "src", "step_00000003"),
                                os.path.join(where, "step_00000003"))
            sub = WORLD.Split(0 if WORLD.rank < ranks else MPI.UNDEFINED, WORLD.rank)
            if sub != MPI.COMM_NULL:
                got = run(burgers, target + steps + ["--checkpoint-dir", where, "--resume"],
                          sub)["losses"]
                sub.Free()
                if not np.allclose(got, reference, rtol=1e-12, atol=1e-12):
                    bad.append(f"{saved} -> {target} on {ranks}: {got} vs {reference}")
    agree(not bad, "; ".join(bad))


def launch(n, args, **kwargs):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL"))}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.Popen([str(REPO / "scripts" / "mpirun.sh"), str(n), sys.executable,
                             "-m", "mpi4py", *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


own_job = pytest.mark.skipif(WORLD.size > 1, reason="starts its own mpiexec job; runs in the "
                             "one-rank session only")

KILL_DRIVER = """
import os, signal, sys
sys.path.insert(0, {examples!r})
import burgers
from pympar.checkpoint import saving
calls = []
real = saving._commit
def commit(*args):
    calls.append(1)
    if len(calls) == 2:   # everything written and fsync'd, nothing committed yet
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args)
saving._commit = commit
sys.exit(burgers.main(sys.argv[1:]))
"""


@own_job
def test_rank_killed_before_commit_leaves_previous(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER.format(examples=str(REPO / "examples")))
    ckpt = tmp_path / "ckpt"
    flags = SMALL + ["--steps", "6", "--cp", "2", "--checkpoint-dir", str(ckpt),
                     "--out", str(tmp_path / "out")]
    out, _ = launch(2, [str(driver), *flags, "--checkpoint-every", "2"]).communicate(timeout=120)
    entries = sorted(os.listdir(ckpt))
    assert checkpoint.latest(ckpt) == str(ckpt / "step_00000002"), (entries, out[-2000:])
    assert any(e.startswith(".step_00000004.tmp-") for e in entries), entries
    proc = launch(2, ["examples/burgers.py", *flags, "--resume"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    burgers = load("burgers")
    reference = run(burgers, ["--steps", "6"], MPI.COMM_SELF)["losses"]
    assert np.allclose(metrics["losses"], reference, rtol=1e-12, atol=1e-12)
    assert checkpoint.latest(ckpt) == str(ckpt / "step_00000006")


def rank_pids(marker):
    """Process ids of the ranks whose command line contains ``marker``, by world rank."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in b" ".join(cmd) and b"burgers.py" in b" ".join(cmd):
            ranks = dict(item.split(b"=", 1) for item in env if item.startswith(RANK_VARIABLES))
            for name in RANK_VARIABLES:  # MPICH's Hydra says PMI_RANK, Open MPI the others
                if name.rstrip(b"=") in ranks:
                    found[int(ranks[name.rstrip(b"=")])] = int(pid)
                    break
    return found


RANK_VARIABLES = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")


@own_job
def test_sigusr1_to_one_rank_saves_and_exits_75(tmp_path):
    """Every rank saves the same step, MPI finalizes, the job exits 75 (requeue me)."""
    ckpt = tmp_path / "ckpt"
    flags = SMALL + ["--cp", "2", "--tp", "1", "--checkpoint-dir", str(ckpt),
                     "--out", str(tmp_path / "out")]
    proc = launch(4, ["examples/burgers.py", *flags, "--steps", "100000",
                      "--checkpoint-every", "20"])
    deadline = time.monotonic() + 120
    while checkpoint.latest(ckpt) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = rank_pids(str(ckpt))
    assert proc.poll() is None and len(pids) == 4, (pids, proc.poll())
    os.kill(pids[2], signal.SIGUSR1)
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert proc.returncode == REQUEUE_STATUS and elapsed < 10, (proc.returncode, elapsed,
                                                                out[-2000:])
    manifest = json.loads((Path(checkpoint.latest(ckpt)) / "manifest.json").read_text())
    step = manifest["step"]
    assert 20 <= step < 100000 and len(manifest["extra"]["losses"]) == step
    proc = launch(4, ["examples/burgers.py", *flags, "--steps", str(step + 2), "--resume"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert len(metrics["losses"]) == step + 2
    assert checkpoint.latest(ckpt).endswith(f"step_{step + 2:08d}")


# -- the example's output (issue: one progress display, errors before the abort) ---------


@pytest.mark.mpi(min_size=1)
def test_losses_printed_once_and_no_bar_off_a_tty(capsys, tmp_path):
    burgers = load("burgers")
    flags = [a for a in TINY if a != "--quiet"] + ["--out", str(tmp_path)]
    status = burgers.main(flags)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    steps = [line.split()[1] for line in lines]
    agree(status == 0 and (WORLD.rank != 0 or (lines and len(steps) == len(set(steps))
                                               and "\r" not in out and "train:" not in out)),
          f"status {status}, output {out[-800:]!r}")


@own_job
@pytest.mark.parametrize("flags, message", [
    (["--tp", "2"], "burgers.py: error: --tp 2 x --cp 1 does not divide 1 ranks"),
    (["--no-such-flag"], "burgers.py: error: unrecognized arguments: --no-such-flag")])
def test_argument_errors_printed_with_the_launcher_hint(flags, message):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL",
                                "SLURM_"))}
    done = subprocess.run([sys.executable, "-m", "mpi4py", "examples/burgers.py", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert message in done.stderr and "`mpiexec -n N python -m mpi4py" in done.stderr, done.stderr
