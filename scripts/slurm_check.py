#!/usr/bin/env python3
"""`make test-slurm`: the real batch scripts of examples/slurm under a real two-node Slurm.

Run by scripts/test_slurm.sh once scripts/slurm_cluster.sh has started the daemons
(SLURM_CONF set; two nodes, n1 and n2, both on this host). Every job is the real
``examples/slurm/cpu.sbatch`` (or ``gpu.sbatch``) with only its ``EDIT:`` lines replaced:
the nodes, 4 ranks, the partition, the PMI plugin (``pmi2``: the PyPI MPICH wheel), the time
limit, the signal lead, the checkpoint directory, the layout and the program's flags (a small
model). The checks:

1. ``srun --mpi=none`` with 4 tasks: one error line naming ``--mpi=pmi2``; every task fails.
2. Across nodes: under ``srun -N2 -n4 --mpi=pmi2`` MPI's ``COMM_TYPE_SHARED`` splits the
   ranks as Slurm placed them (2+2 or 3+1), and the cross-node tests of ``make test``
   (``scripts/test_phases.sh --nodes-tests``, NumPy variants) pass there with
   ``PYMPAR_TEST_NODES=2``, ``tests/test_multinode.py`` taking the cross-node path.
3. A reference: the same training, uninterrupted (``srun --mpi=pmi2``, placed as the jobs).
4. The time-limit job, on two nodes (2 ranks on each, TP=2 x CP=2: the CP groups cross
   them): Slurm's own ``--signal=B:USR1@lead`` stops it twice; each time every rank saves,
   the program exits 75 and ``run_step`` requeues; before the third run the check plants
   stale MPICH segments under this job's names on both nodes and raises the time limit; the
   third run resumes under another layout (the mesh order reversed: every rank loads other
   shards, and the TP groups cross the nodes; the LAYOUT line picks it from the restart
   count) and completes. Final loss and validation error equal the reference's.
5. The manual job, on two nodes as well: ``scancel --batch --signal=USR1`` (the batch shell)
   while it trains, then ``scancel --signal=USR1`` (the steps only) while it trains, then a
   signal to the batch shell while the ``pympar info`` step runs (before the training step
   exists): each is requeued; the fourth run completes, equal to the reference.
6. ``gpu.sbatch`` without CuPy: the job fails, with one line that names CuPy.

Where scripts/slurm_cluster.sh could start only one node (``$SLURM_CI_DIR/one-node`` says
why), check 2 says SKIPPED and why, and the jobs run on that one node.

Every state a job passes through is recorded: never TIMEOUT, CANCELLED or FAILED (but for
the GPU job, which must fail). A requeued job waits for its BeginTime: Slurm holds it back
``cred_expire`` + 1 seconds, 2 minutes by default; this cluster sets ``cred_expire=20``
(scripts/slurm_cluster.sh), a site's job simply waits the 2 minutes. (Moving the BeginTime
to now with ``scontrol update StartTime=now`` is no shortcut: the run would start while
slurmd still refuses the ended run's revoked credential, and fail.) Exits 0 when every
check passes, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Written by scripts/slurm_cluster.sh where the second node could not be had: why.
ONE_NODE = Path(os.environ.get("SLURM_CI_DIR", "/tmp/pympar-slurm")) / "one-node"
SLURM = REPO / "examples" / "slurm"
WORK = Path(os.environ.get("SLURM_CHECK_DIR", REPO / "out" / "slurm-check"))
PYTHON = str(REPO / ".venv" / "bin" / "python")
RANKS = 4
#: The layout of the jobs and the reference, and the one the time-limit job resumes under:
#: the mesh order reversed, so that every rank resumes with other shards and the TP groups,
#: inside a node before, cross the two nodes (2 ranks on each; the CP groups the other way).
#: The same shards are computed, on other ranks: the losses stay equal bit for bit. (Other
#: sizes, e.g. CP=4, resume as well, but sum in another order: after the change the losses
#: drift apart, 1e-14 relative after 400 steps of this model, 1.5e-8 after 3300.)
LAYOUT = ["--tp", "2", "--cp", "2"]
OTHER_LAYOUT = ["--tp", "2", "--cp", "2", "--order", "cp-tp-dp"]
#: Rank 0's TP and CP groups under each, as the program prints them ("groups  tp-0-1  ...").
GROUPS, OTHER_GROUPS = "tp-0-1  cp-0-2", "tp-0-2  cp-0-1"
#: The program's flags, the same for every job and the reference: a small model.
MODEL = ["--batch", "8", "--grid", "16", "--hidden", "8", "--heads", "2", "--layers", "1",
         "--trajectories", "4", "--frames", "3", "--dtype", "float64", "--seed", "3"]
#: Seconds of training (at the speed of the jobs' 4 ranks alone, measured on their placement
#: with their one BLAS thread per rank) the jobs must take: more than the two windows between
#: the start of a run and Slurm's signal (--time=2, --signal=B:USR1@60: the signal comes 30
#: to 60 s after the start, after the start-up of the training step, 60 s before the limit):
#: the reference runs beside the time-limit job all along (and the manual job mostly), so
#: that job trains at half that speed or less: 80 s alone are 160 s or more of its runs,
#: beyond the two windows (some 110 s).
TRAINING_SECONDS = 80.0
#: Where the reference (and the calibration) runs: set by main to the jobs' placement (2 ranks
#: on each of 2 nodes), whose speed sets the number of steps. The reductions of the TP=2 x
#: CP=2 layout add two numbers each, alike in every order: the placement leaves the losses
#: bit for bit the same.
PLACEMENT: list[str] = []
#: One BLAS thread per rank, as the batch scripts set it (srun passes the environment on).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
BAD_STATES = ("TIMEOUT", "CANCELLED", "FAILED", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
              "BOOT_FAIL", "DEADLINE")
DONE_STATES = ("COMPLETED",) + BAD_STATES


#: The jobs being watched: every wait polls them all (and releases any that was requeued).
WATCHED: list["Job"] = []
#: Called at every poll, e.g. to look into /dev/shm while a job runs.
WATCHERS: list = []


class CheckFailed(Exception):
    """One check did not hold."""


def say(message: str) -> None:
    print(f"[test-slurm {time.strftime('%H:%M:%S')}] {message}", flush=True)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def run(command: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          **kwargs)


def mpich_shm_name(job: str, step: int, node: int = 0) -> str:
    """MPICH's segment of step ``step`` of job ``job`` on node ``node`` of the step (FNV-1a
    of "job.step")."""
    value = 2166136261
    for byte in f"{job}.{step}".encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return f"mpich_shm_{value:x}_{node}"


def edited(script: Path, overrides: dict[str, str | None]) -> str:
    """``script`` with the lines that start with each key replaced (None: deleted).

    Every replaced line must carry the script's ``# EDIT:`` mark and every key must match:
    the job runs the script as a site would, changed only where the script says so.
    """
    used, lines = set(), []
    for line in script.read_text(encoding="utf-8").splitlines():
        key = next((k for k in overrides if line.startswith(k)), None)
        if key is None:
            lines.append(line)
            continue
        require("# EDIT:" in line, f"{script.name}: {line!r} is not marked EDIT:")
        used.add(key)
        if overrides[key] is not None:
            lines.append(f"{overrides[key]}   # (test-slurm)")
    require(used == set(overrides), f"{script.name}: no EDIT: line for {set(overrides) - used}")
    return "\n".join(lines) + "\n"


def cpu_script(name: str, minutes: int, lead: int, steps: int, nodes: int = 1,
               other_layout_from: int | None = None) -> str:
    """The CPU job on ``nodes`` nodes (RANKS ranks in all); from restart
    ``other_layout_from`` on, under OTHER_LAYOUT."""
    flags = " ".join(MODEL + ["--steps", str(steps)])
    layout = f"LAYOUT=({' '.join(LAYOUT)})"
    if other_layout_from is not None:
        layout += (f'; if (( ${{SLURM_RESTART_COUNT:-0}} >= {other_layout_from} )); then '
                   f'LAYOUT=({" ".join(OTHER_LAYOUT)}); fi')
    return edited(SLURM / "cpu.sbatch", {
        "#SBATCH --nodes": f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node": f"#SBATCH --ntasks-per-node={RANKS // nodes}",
        "#SBATCH --time": f"#SBATCH --time={minutes}",
        "#SBATCH --partition": "#SBATCH --partition=ci",
        "#SBATCH --account": None,
        "#SBATCH --signal": f"#SBATCH --signal=B:USR1@{lead}",
        "module purge": None,
        "module load": None,
        "SRUN_MPI=": "SRUN_MPI=pmi2",
        "CKPT_DIR=": f"CKPT_DIR={WORK / name / 'ckpt'}",
        "LAYOUT=": layout,
        "PROGRAM=": f'PROGRAM=(examples/burgers.py "${{LAYOUT[@]}}" {flags})',
    })


def gpu_script() -> str:
    return edited(SLURM / "gpu.sbatch", {
        "#SBATCH --nodes": "#SBATCH --nodes=1",
        "#SBATCH --gpus-per-node": None,          # this machine has none
        "#SBATCH --ntasks-per-node": f"#SBATCH --ntasks-per-node={RANKS}",
        "#SBATCH --cpus-per-task": "#SBATCH --cpus-per-task=1",
        "#SBATCH --time": "#SBATCH --time=5",
        "#SBATCH --partition": "#SBATCH --partition=ci",
        "#SBATCH --account": None,
        "#SBATCH --signal": "#SBATCH --signal=B:USR1@30",
        "module purge": None,
        "module load": None,
        "SRUN_MPI=": "SRUN_MPI=pmi2",
        "CKPT_DIR=": f"CKPT_DIR={WORK / 'gpu' / 'ckpt'}",
        "GPU_BIND=": "GPU_BIND=none",
        "MPI_VENDOR=": "MPI_VENDOR=mpich",
    })


def srun_burgers(mpi: str, flags: list[str], out: Path, timeout: float = 900,
                 placement: tuple[str, ...] = ()):
    return run(["srun", f"--mpi={mpi}", "-n", str(RANKS), *placement, "--cpus-per-task=1",
                PYTHON, "-m", "mpi4py", "examples/burgers.py", *LAYOUT,
                *flags, "--out", str(out)], timeout=timeout, env={**os.environ, **ONE_THREAD})


class Job:
    """A submitted batch job, watched: its states, its restarts, its log."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        (WORK / name).mkdir(parents=True, exist_ok=True)
        script = WORK / name / "job.sbatch"
        script.write_text(text, encoding="utf-8")
        done = run(["sbatch", "--parsable", str(script)])
        require(done.returncode == 0, f"{name}: sbatch failed: {done.stderr}")
        self.id = done.stdout.strip().split(";")[0]
        self.states: list[str] = []
        self.last_info: dict[str, str] = {}
        self.released: set[int] = set()
        self.before_release = {}   # restart count -> called once it is pending again
        # The script's own --output=%x-%j.out, in the submit directory.
        job_name = re.search(r"--job-name=(\S+)", text).group(1)
        self.log_path = REPO / f"{job_name}-{self.id}.out"
        self.out = REPO / "out" / f"burgers-{self.id}"
        shutil.rmtree(self.out, ignore_errors=True)  # a run of an earlier check: not ours
        WATCHED.append(self)
        say(f"{name}: submitted job {self.id}")

    def info(self) -> dict[str, str]:
        """What scontrol says of the job; what it said last once the job is forgotten."""
        done = run(["scontrol", "show", "job", "-o", self.id])
        found = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
        if found.get("JobId") == self.id:
            self.last_info = found
        return self.last_info

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def steps(self) -> dict[str, str]:
        """The job's running steps: step id -> the name of its program."""
        done = run(["squeue", "-h", "-s", "-j", self.id, "-o", "%i %j"])
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if " " in line)

    def poll(self) -> dict[str, str]:
        info = self.info()
        state = info.get("JobState", "?")
        restarts = int(info.get("Restarts", "0") or 0)
        if not self.states or self.states[-1] != f"{state}/{restarts}":
            self.states.append(f"{state}/{restarts}")
        if state == "PENDING" and info.get("Reason") == "BeginTime" \
                and restarts not in self.released:
            self.released.add(restarts)
            if restarts in self.before_release:
                self.before_release[restarts]()
            # Slurm holds a requeued job back (BeginTime: cred_expire + 1 s, here 21 s). Not
            # to be cut short: a run started at once is refused ("Job credential revoked").
            say(f"{self.name}: requeued ({restarts} so far); waits for its BeginTime "
                f"{info.get('StartTime')}")
        return info

    def wait(self, what: str, until, timeout: float, every: float = 0.25) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for job in WATCHED:
                if job is not self:
                    job.poll()
            for watcher in WATCHERS:
                watcher()
            info = self.poll()
            if until(info):
                return info
            if info.get("JobState") in DONE_STATES and not until(info):
                raise CheckFailed(f"{self.name}: job {self.id} ended {info.get('JobState')} "
                                  f"while waiting for {what}; states {self.states}\n"
                                  f"{self.log()[-3000:]}")
            time.sleep(every)
        raise CheckFailed(f"{self.name}: no {what} within {timeout:.0f} s; states "
                          f"{self.states}\n{self.log()[-3000:]}")

    def wait_restarts(self, count: int, timeout: float) -> None:
        self.wait(f"requeue number {count}", lambda i: int(i.get("Restarts", 0)) >= count,
                  timeout)

    def runs(self) -> list[str]:
        """The log of each run: requeue.sh says when a run starts."""
        return self.log().split(f"requeue.sh: job {self.id}, run ")[1:]

    def wait_training(self, run_index: int, timeout: float) -> None:
        """Until run ``run_index`` of the job has trained a step (its log says so)."""
        def training(_):
            runs = self.runs()
            return (len(runs) > run_index and "checkpoints in " in runs[run_index]
                    and " loss " in runs[run_index].split("checkpoints in ", 1)[1])
        self.wait(f"training in run {run_index}", training, timeout)

    def wait_done(self, timeout: float) -> dict[str, str]:
        return self.wait("the end", lambda i: i.get("JobState") in DONE_STATES, timeout)

    def signal(self, *flags: str) -> None:
        done = run(["scancel", "--signal=USR1", *flags, self.id])
        require(done.returncode == 0, f"{self.name}: scancel failed: {done.stderr}")
        say(f"{self.name}: scancel --signal=USR1 {' '.join(flags)} {self.id}")

    def keep_log(self) -> None:
        """Move the job's log and outputs from the submit directory into the check's."""
        if self.log_path.exists():
            shutil.move(self.log_path, WORK / self.name / "job.out")
        if self.out.exists():
            shutil.move(self.out, WORK / self.name / "out")


def stops(log: str) -> list[int]:
    """The steps at which the runs of a log stopped early and saved."""
    return [int(s) for s in re.findall(r"asked to stop: step (\d+) saved", log)]


def resumes(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)\)", log)]


def check_finished_like_reference(job: Job, reference: dict, requeues: int,
                                  layout_changed: bool = False) -> None:
    """The job completed after ``requeues`` stops, its losses and validation error equal to
    the uninterrupted ``reference``'s, bit for bit; with ``layout_changed``, its last run
    under OTHER_LAYOUT (its groups as OTHER_GROUPS), the others under LAYOUT."""
    info = job.info()
    log = job.log()
    bad = [s for s in job.states if s.split("/")[0] in BAD_STATES]
    require(info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0" and not bad,
            f"{job.name}: ended {info.get('JobState')} {info.get('ExitCode')}; states "
            f"{job.states}\n{log[-3000:]}")
    require(int(info.get("Restarts", -1)) == requeues,
            f"{job.name}: {info.get('Restarts')} restarts, expected {requeues}")
    require(log.count("requeueing job") == requeues and len(stops(log)) == requeues
            and len(resumes(log)) == requeues,
            f"{job.name}: expected {requeues} stops, requeues and resumes in the log: stops "
            f"{stops(log)}, resumes {resumes(log)}\n{log[-3000:]}")
    require(stops(log) == resumes(log), f"{job.name}: resumed at {resumes(log)} after "
            f"stopping at {stops(log)}")
    # The requeue ends the batch shell once the step is over: slurmstepd may say "CANCELLED
    # ... DUE TO JOB REQUEUE" about the script (when it had not ended yet); never a step.
    cancelled = re.findall(r"\*\*\* (\w+) [\d.]+ ON \S+ CANCELLED AT \S+( DUE TO JOB REQUEUE)?",
                           log)
    require(set(cancelled) <= {("JOB", " DUE TO JOB REQUEUE")} and len(cancelled) <= requeues
            and "TIME LIMIT" not in log and len(job.runs()) == requeues + 1,
            f"{job.name}: unexpected cancellations {cancelled} or runs {len(job.runs())}\n"
            f"{log[-3000:]}")
    require("Traceback" not in log and "MPI_Abort" not in log, f"{job.name}: errors in the log"
            f"\n{log[-3000:]}")
    metrics = json.loads((job.out / "metrics.json").read_text())
    require(metrics["losses"] == reference["losses"]
            and metrics["final_loss"] == reference["final_loss"]
            and metrics["val_rel_l2"] == reference["val_rel_l2"],
            f"{job.name}: final loss {metrics['final_loss']!r}, error {metrics['val_rel_l2']!r}"
            f" vs uninterrupted {reference['final_loss']!r}, {reference['val_rel_l2']!r}")
    layouts = ""
    if layout_changed:
        runs = job.runs()
        groups = [re.findall(r"^groups  (\S+  \S+)", text, re.M)[:1] for text in runs]
        expected = [[GROUPS]] * (len(runs) - 1) + [[OTHER_GROUPS]]
        require(groups == expected and metrics["layout"]["order"] == OTHER_LAYOUT[-1],
                f"{job.name}: the runs' TP and CP groups (rank 0's) {groups}, expected "
                f"{expected}; the last run's layout {metrics['layout']}")
        layouts = (f"; the last run resumed at step {resumes(log)[-1]} under "
                   f"{' '.join(OTHER_LAYOUT)} (rank 0's groups {OTHER_GROUPS}, before "
                   f"{GROUPS})")
    say(f"{job.name}: stopped at steps {stops(log)}, requeued {requeues} times{layouts}, "
        f"completed; final loss {metrics['final_loss']:.6g} and validation error "
        f"{metrics['val_rel_l2']:.6e} equal the uninterrupted run's; states {job.states}")


def check_pmi_mismatch() -> None:
    done = srun_burgers("none", MODEL + ["--steps", "3"], WORK / "pmi", timeout=300)
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if "error:" in line and "srun:" not in line]
    failed = set()
    for spec in re.findall(r"tasks? ([\d,-]+): Exited with exit code [1-9]", output):
        for part in spec.split(","):   # "0-1,3"
            first, _, last = part.partition("-")
            failed.update(range(int(first), int(last or first) + 1))
    require(done.returncode != 0 and len(errors) == 1 and "--mpi=pmi2" in errors[0]
            and failed == set(range(RANKS)) and "Traceback" not in output
            and "MPI_Abort" not in output,
            f"srun --mpi=none: status {done.returncode}, error lines {errors}, failed tasks "
            f"{sorted(failed)}:\n{output[-3000:]}")
    say(f"srun --mpi=none -n {RANKS}: one line ({errors[0][:90]}...), tasks "
        f"{sorted(failed)} failed")


#: Run by every rank of a 4-task step on two nodes: rank, Slurm's node, MPI's node (the lowest
#: rank of COMM_TYPE_SHARED's split).
PROBE = """
import os
from mpi4py import MPI
w = MPI.COMM_WORLD
node = w.Split_type(MPI.COMM_TYPE_SHARED)
rows = w.gather((w.Get_rank(), os.environ.get("SLURMD_NODENAME", "?"),
                 node.allreduce(w.Get_rank(), op=MPI.MIN)))
if w.Get_rank() == 0:
    for row in rows:
        print("rank %d slurm node %s mpi node %d" % row, flush=True)
"""


def check_cross_node_tests() -> None:
    """``srun -N2 -n4``: MPI splits the ranks as Slurm placed them, and the cross-node tests
    of make test pass, test_multinode.py's on the cross-node path (none skipped but the one
    that starts its own job)."""
    step = ["srun", "-N2", "-n", str(RANKS), "--mpi=pmi2", "--cpus-per-task=1"]
    done = run([*step, PYTHON, "-c", PROBE], timeout=300)
    rows = re.findall(r"rank (\d+) slurm node (\S+) mpi node (\d+)", done.stdout)
    require(done.returncode == 0 and len(rows) == RANKS,
            f"srun -N2 -n{RANKS} probe: status {done.returncode}\n{done.stdout[-2000:]}"
            f"{done.stderr[-2000:]}")
    slurm = {int(r): node for r, node, _ in rows}
    mpi = {int(r): int(low) for r, _, low in rows}
    same = all((slurm[a] == slurm[b]) == (mpi[a] == mpi[b]) for a in mpi for b in mpi)
    sizes = sorted(list(mpi.values()).count(low) for low in set(mpi.values()))
    require(len(set(slurm.values())) == 2 and same and sizes in ([2, 2], [1, 3]),
            f"srun -N2 -n{RANKS}: Slurm placed the ranks on {slurm}, COMM_TYPE_SHARED split "
            f"them by lowest rank {mpi}: not two nodes of 2+2 or 3+1 that agree")
    sizes.reverse()
    placed = " | ".join(" ".join(str(r) for r in sorted(slurm) if slurm[r] == node)
                        for node in sorted(set(slurm.values())))
    say(f"srun -N2 -n{RANKS} --mpi=pmi2: Slurm placed ranks {placed} on "
        f"{', '.join(sorted(set(slurm.values())))}; COMM_TYPE_SHARED splits them alike "
        f"({'+'.join(map(str, sizes))})")
    files = run(["scripts/test_phases.sh", "--nodes-tests"]).stdout.split()
    require(bool(files), "scripts/test_phases.sh --nodes-tests named no files")
    env = dict(os.environ, PYMPAR_TEST_NODES="2", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    began = time.monotonic()
    done = run([*step, PYTHON, "-m", "mpi4py", "-m", "pytest", "--with-mpi", "-q", "-rfEsp",
                "-p", "no:cacheprovider", "-k", "not cupy", *files], timeout=1200, env=env)
    output = done.stdout + done.stderr
    (WORK / "cross-node.log").write_text(output, encoding="utf-8")
    summary = re.findall(r"^=*\s*(\d+ passed.*?) in [\d.]+s", output, re.M)
    passed = re.findall(r"^PASSED tests/test_multinode\.py::(\S+)", output, re.M)
    skipped = re.findall(r"^SKIPPED \[\d+\] tests/test_multinode\.py:\d+: (.*)$", output, re.M)
    require(done.returncode == 0 and summary and "failed" not in summary[-1]
            and "error" not in summary[-1] and passed
            and all("starts its own 2-rank job" in why for why in skipped),
            f"the cross-node tests under srun -N2 -n{RANKS} (PYMPAR_TEST_NODES=2): status "
            f"{done.returncode}, {summary[-1:] or 'no summary'}, test_multinode passed "
            f"{passed}, skipped {skipped}; log in {WORK / 'cross-node.log'}\n"
            f"{output[-3000:]}")
    say(f"the cross-node tests ({len(files)} files, NumPy variants) under srun -N2 "
        f"-n{RANKS}: {summary[-1]} in {time.monotonic() - began:.0f} s; test_multinode.py's "
        f"{len(passed)} tests on the ranks passed (cross-node path taken)")


def reference_run(steps: int) -> dict:
    out = WORK / f"reference-{steps}"
    done = srun_burgers("pmi2", MODEL + ["--steps", str(steps)], out, placement=PLACEMENT)
    require(done.returncode == 0, f"reference run failed:\n{done.stdout[-2000:]}"
            f"{done.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


class Reference:
    """The uninterrupted run, in the background while the jobs are watched."""

    def __init__(self, steps: int) -> None:
        self.out = WORK / f"reference-{steps}"
        self.log = open(WORK / "reference.log", "w")
        self.proc = subprocess.Popen(
            ["srun", "--mpi=pmi2", "-n", str(RANKS), *PLACEMENT, "--cpus-per-task=1", PYTHON,
             "-m", "mpi4py", "examples/burgers.py", *LAYOUT, *MODEL,
             "--steps", str(steps), "--out", str(self.out)],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **ONE_THREAD})

    def result(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            for job in WATCHED:
                job.poll()
            time.sleep(0.5)
        if self.proc.poll() is None:
            self.proc.kill()
        require(self.proc.returncode == 0, f"reference run: status {self.proc.returncode}:\n"
                f"{(WORK / 'reference.log').read_text()[-2000:]}")
        return json.loads((self.out / "metrics.json").read_text())


def check_gpu_refusal(job: Job) -> None:
    info = job.wait_done(300)
    log = job.log()
    lines = [line for line in log.splitlines() if "error:" in line and "srun:" not in line]
    require(info.get("JobState") == "FAILED" and len(lines) == 1 and "CuPy" in lines[0]
            and "Traceback" not in log and "MPI_Abort" not in log and "world size" in log,
            f"gpu.sbatch without CuPy: {info.get('JobState')}, error lines {lines}\n"
            f"{log[-3000:]}")
    say(f"gpu.sbatch without CuPy: the job FAILED with one line: {lines[0][:100]}...")


def main() -> int:
    if shutil.which("sbatch") is None or "SLURM_CONF" not in os.environ:
        print("slurm_check.py: no Slurm here (run scripts/test_slurm.sh)", file=sys.stderr)
        return 2
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    began = time.monotonic()
    jobs: list[Job] = []
    try:
        check_pmi_mismatch()
        one_node = ONE_NODE.read_text().strip() if ONE_NODE.exists() else None
        nodes = 1 if one_node else 2
        if one_node:
            say(f"two-node checks SKIPPED: {one_node}; the jobs run on one node")
        else:
            check_cross_node_tests()
        PLACEMENT[:] = ["-N", str(nodes), f"--ntasks-per-node={RANKS // nodes}"]
        calibration = reference_run(200)
        step = calibration["median_step_seconds"]
        steps = int(min(max(TRAINING_SECONDS / step, 400), 40000))
        say(f"{step * 1e3:.1f} ms per step on {RANKS} ranks ({' '.join(PLACEMENT)}): the jobs "
            f"train {steps} steps")

        timed = Job("time-limit", cpu_script("time-limit", 2, 60, steps, nodes=nodes,
                                             other_layout_from=2))
        manual = Job("manual", cpu_script("manual", 30, 10, steps, nodes=nodes))
        gpu = Job("gpu", gpu_script())
        jobs = [timed, manual, gpu]
        background = Reference(steps)

        planted = []

        def before_third_run() -> None:
            # What a run killed before MPI_Finalize leaves: segments named for this job's
            # steps on both its nodes (one /dev/shm here), with garbage in them. Without the
            # clean-up the next MPI_Init hangs.
            for step_id in range(3):
                for node in range(nodes):
                    path = Path("/dev/shm") / mpich_shm_name(timed.id, step_id, node)
                    path.write_bytes(os.urandom(1 << 21))
                    planted.append(path)
            # The third run must finish: a time limit that no longer comes.
            run(["scontrol", "update", f"JobId={timed.id}", "TimeLimit=30"])
            say(f"time-limit: planted {[p.name for p in planted]}; time limit now 30 min")

        timed.before_release[2] = before_third_run
        # MPICH's own segments of the training step (step 1), one per node of the job.
        segments = [Path("/dev/shm") / mpich_shm_name(timed.id, 1, node)
                    for node in range(nodes)]
        seen_segment: set = set()
        WATCHERS.append(lambda: seen_segment.update(p.name for p in segments if p.exists()))

        # The manual job, watched while the time-limit job runs beside it.
        manual.wait_training(0, 600)
        manual.signal("--batch")                      # to the batch shell only
        manual.wait_restarts(1, 300)
        manual.wait_training(1, 600)
        manual.signal()                               # to the job steps only
        manual.wait_restarts(2, 300)
        # Its first program (after requeue.sh's clean-up of /dev/shm, a bash step on two
        # nodes) is pympar info; the training step comes after it.
        manual.wait("the info step of run 2",
                    lambda i: i.get("Restarts") == "2"
                    and "python" in manual.steps().values(), 600, every=0.1)
        manual.signal("--batch")                      # before the training step starts
        manual.wait_restarts(3, 600)

        timed.wait_done(1200)
        manual.wait_done(1200)
        check_gpu_refusal(gpu)
        reference = background.result(900)
        say(f"uninterrupted run of {steps} steps: final loss {reference['final_loss']:.6g}, "
            f"validation error {reference['val_rel_l2']:.6e}")

        info = timed.info()
        require("Ignoring --ntasks-per-node" not in timed.log(),
                "time-limit: the clean-up step did not run one task per node:\n"
                + timed.log()[-3000:])
        require(info.get("NumNodes") == str(nodes)
                and info.get("NodeList") == ("n[1-2]" if nodes == 2 else "n1"),
                f"time-limit: ran on {info.get('NumNodes')} node(s) {info.get('NodeList')}, "
                f"not on {nodes}")
        check_finished_like_reference(timed, reference, 2, layout_changed=True)
        require(seen_segment == {p.name for p in segments},
                f"MPICH's segments of the training step on the job's nodes, "
                f"{[p.name for p in segments]}, did not all appear (seen: {seen_segment}): "
                f"the clean-up looks for the wrong names")
        log = timed.log()
        # Both nodes' clean-up tasks look into the one /dev/shm: a file may be named twice.
        removed = sorted(set(re.findall(r"run_step: removing /dev/shm/(\S+),", log)))
        require(removed == sorted(p.name for p in planted)
                and not any(p.exists() for p in planted),
                f"planted {[p.name for p in planted]}, removed {removed}")
        say(f"time-limit: on nodes {info.get('NodeList')}; the stale segments {removed} were "
            f"removed by requeue.sh (on every node of the job) and the third run did not hang; "
            f"{sorted(seen_segment)} (step 1, one per node) were MPICH's own names")

        check_finished_like_reference(manual, reference, 3)
        runs = manual.runs()
        shell = ["run_step: SIGUSR1" in text for text in runs]
        require(shell == [True, False, True, False],
                f"manual: the batch shell got SIGUSR1 in runs {shell}, expected in 0 and 2")
        require(runs[2].index("run_step: SIGUSR1") < runs[2].index("checkpoints in "),
                "manual: the signal of run 2 came after its training step had started")
        first, second, third = stops(manual.log())
        resumed = resumes(manual.log())
        require(third == resumed[1],
                f"manual: the signal before the step should stop run 2 at its start "
                f"(step {resumed[1]}), it stopped at {third}")
        say(f"manual: batch-shell signal (step {first}), step signal (step {second}) and a "
            f"signal before the training step (stopped at its start, step {third}) each "
            f"requeued; the last run completed")
    except CheckFailed as err:
        say(f"FAILED: {err}")
        return 1
    finally:
        for job in jobs:
            if job.info().get("JobState") not in DONE_STATES:
                run(["scancel", job.id])
        deadline = time.monotonic() + 90  # the ranks of a cancelled job take a while to go
        while time.monotonic() < deadline and any(
                job.info().get("JobState", "COMPLETED") not in DONE_STATES for job in jobs):
            time.sleep(1)
        for job in jobs:
            job.keep_log()
        for path in Path("/dev/shm").glob("mpich_shm_*"):
            if any(path.name == mpich_shm_name(job.id, s) for job in jobs for s in range(64)):
                path.unlink(missing_ok=True)
    say(f"all Slurm checks passed in {time.monotonic() - began:.0f} s"
        + (f" (the two-node checks SKIPPED: {ONE_NODE.read_text().strip()})"
           if ONE_NODE.exists() else ""))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
