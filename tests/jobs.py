"""Jobs that a test starts itself, to check how a job ends, the same under every launcher.

The job runs under ``scripts/mpirun.sh`` with the launcher that ``MPIEXEC`` names (this
venv's MPI wheel by default: MPICH's ``mpiexec``, Open MPI's ``mpirun``/``prterun``; or
``srun``). Each rank runs under a small shell that writes what the rank prints to a file of
its own, then ``[exit R] S``, its exit status. What the ranks printed is thereby told apart
from what the launcher adds, whatever the launcher: the tests check the contract (pympar's
one line, the ranks it names, a non-zero status, an end in time), never a launcher's banner.

Launchers differ in how a job ends, and pympar relies on none of it: MPICH's Hydra waits for
every rank; Open MPI's ``prterun`` kills the other ranks as soon as one exits non-zero (and
says so in a framed block); ``srun`` waits unless ``--kill-on-bad-exit``. So a rank's exit
status is known only where its shell outlived the first failure: :meth:`Job.check_exits`
checks the statuses that were written, and that one at least was.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The variables of an outer launcher or of pympar's settings, left out of a job's environment.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PRTE_", "PYMPAR_")
# $1: the directory of the ranks' files; the rest: the program. The rank's number comes from
# its launcher (Hydra, Open MPI, PMIx, Slurm).
_RANK_SHELL = ('r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-0}}}}; '
               'd=$1; shift; "$@" >"$d/rank-$r.out" 2>&1; s=$?; '
               'echo "[exit $r] $s" >>"$d/rank-$r.out"; exit $s')


def job_env(**env: str) -> dict[str, str]:
    """This process's environment without an outer launcher's variables or pympar's
    settings, with the repository importable and ``env`` added."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if mpiexec.exists():
        clean.setdefault("MPIEXEC", str(mpiexec))
    clean.update(PYMPAR_LAUNCH_TIMEOUT="90", **env)
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")])
    return clean


@dataclass
class Job:
    """A finished job: its status, wall time, each rank's output and the launcher's own."""

    status: int
    seconds: float
    ranks: dict[int, str]
    launcher: str

    @property
    def printed(self) -> str:
        """What the ranks printed, rank after rank, without the ``[exit R] S`` lines."""
        return "".join(re.sub(r"(?m)^\[exit \d+\] -?\d+\n?", "", self.ranks[r])
                       for r in sorted(self.ranks))

    @property
    def lines(self) -> list[str]:
        """The non-blank lines the ranks printed."""
        return [line for line in self.printed.splitlines() if line.strip()]

    @property
    def exits(self) -> dict[int, int]:
        """The exit status of each rank whose shell could write it."""
        return {int(r): int(s) for text in self.ranks.values()
                for r, s in re.findall(r"(?m)^\[exit (\d+)\] (-?\d+)$", text)}

    def __str__(self) -> str:
        shown = "".join(f"--- rank {r}\n{self.ranks[r]}" for r in sorted(self.ranks))
        return (f"status {self.status} after {self.seconds:.1f} s\n{shown}"
                f"--- launcher\n{self.launcher}")

    def check_exits(self, expected: dict[int, int]) -> None:
        """Every exit status written is the one ``expected`` for its rank, and one at least
        was written (a launcher may kill the others once one rank exits non-zero)."""
        assert self.exits and all(expected.get(r) == s for r, s in self.exits.items()), \
            f"expected {expected}, written {self.exits}\n{self}"

    def said_once(self, line: str) -> None:
        """``line`` is within the one line of pympar's that the ranks printed, and no
        traceback was shown."""
        said = [x for x in self.lines if "[pympar" in x]
        assert len(said) == 1 and line in said[0], str(self)
        assert "Traceback" not in self.printed, str(self)


def run_job(workdir: Path, ranks: int, program: list[str], timeout: float = 120,
            **env: str) -> Job:
    """Run ``program`` on ``ranks`` ranks in ``workdir`` (environment: :func:`job_env`)."""
    outputs = workdir / f"ranks-{time.monotonic_ns()}"
    outputs.mkdir(parents=True)
    start = time.monotonic()
    done = subprocess.run([str(REPO / "scripts" / "mpirun.sh"), str(ranks), "sh", "-c",
                           _RANK_SHELL, "sh", str(outputs), *program], capture_output=True,
                          text=True, timeout=timeout, env=job_env(**env), cwd=workdir)
    seconds = time.monotonic() - start
    printed = {int(path.stem.split("-")[1]): path.read_text(errors="replace")
               for path in outputs.glob("rank-*.out")}
    return Job(done.returncode, seconds, printed, done.stdout + done.stderr)
