"""Driver of ``python -m pympar bench``: spawn each benchmark under mpiexec, then report.

Runs, each in its own ``mpiexec`` job:

==================  =====  =======================================================
JSON file           ranks  script
==================  =====  =======================================================
mappings.json       2      bench_mappings.py: mappings/collectives vs raw mpi4py
torch_comm.json     2      bench_torch_comm.py: vs torch.distributed gloo (or skipped)
mlp.json            2      bench_mlp.py: tensor-parallel MLP step vs serial and torch
comm_volume_8.json  8      bench_comm_volume.py: Linear3D pair vs Column+Row bytes
comm_volume_27.json 27     the same on a cube of depth 3 (full run only, oversubscribed)
memory.json         2      bench_memory.py: bytes per rank with ZeRO/bf16/recompute, ZeRO step
attention.json      4      bench_attention.py: ring vs Ulysses bytes, time, memory, zig-zag
checkpoint.json     4      bench_checkpoint.py: save/load GB/s on 1, 2, 4 ranks vs disk, DCP
fft_1/2/4.json      1/2/4  bench_fft.py: FFT round trip vs mpi4py-fft, bytes, FNO layer
halo.json           2      bench_halo.py: HaloExchange vs raw mpi4py Sendrecv of the same faces
pipeline.json       4      bench_pipeline.py: GPipe and 1F1B bubble vs the ideal, memory per stage
pipeline_small.json 4      the same at m = 4p on a stage of half the compute for the same bytes
mappings_2nodes.json 2     bench_mappings.py across two emulated nodes (MPICH's odd-even
                           cliques: even and odd ranks on two "nodes"; skipped under Open MPI)
mappings_2nodes_4.json 4   the same on 4 ranks sharing the 2 cores, 2 ranks a node
halo_2nodes.json    2      bench_halo.py across two emulated nodes
mappings_ab.json    2      bench_mappings_ab.py: mappings of an earlier commit vs this tree
                           (only with ``--only mappings_ab``; it starts its own jobs)
plan.json           1-8    bench_plan.py: the planner's predicted step times of the examples
                           vs measured (only with ``--only plan``; it starts its own jobs)
==================  =====  =======================================================

then writes ``results.md`` (tables) and PNG plots beside the JSON files
(:mod:`benchmarks.report`). The launcher is found like ``scripts/mpirun.sh``
does: ``$MPIEXEC``, else ``mpiexec`` next to the running Python, else on
``PATH``; Open MPI gets ``--oversubscribe`` and its two run-as-root variables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: The OpenBLAS variables known to select a slower kernel on some machines.
SLOW_BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


@dataclass
class Job:
    """One benchmark run: a script under ``ranks`` ranks writing ``output`` (JSON)."""

    name: str
    script: str
    ranks: int
    output: str
    args: list[str] = field(default_factory=list)
    timeout: float = 1800.0
    #: Run without a launcher: the script starts its own ``mpiexec`` jobs.
    launches: bool = False
    #: Environment variables of the job (MPICH's cliques emulate two nodes).
    env: dict[str, str] = field(default_factory=dict)


#: Even and odd ranks on two emulated nodes (MPICH; COMM_TYPE_SHARED splits them).
TWO_NODES = {"MPIR_CVAR_ODD_EVEN_CLIQUES": "1"}


def _across_nodes(quick: bool) -> list[Job]:
    """The mappings and halo jobs across two emulated nodes."""
    mapping = ["--sizes", "1KiB,64KiB,1MiB", "--repeats", "5" if quick else "11",
               "--warmup", "2"]
    halo = (["--shapes", "256x256,64x64x64", "--repeats", "5", "--warmup", "1"] if quick else
            ["--shapes", "1024x1024,4096x4096,128x128x128", "--repeats", "15",
             "--warmup", "2", "--sample-seconds", "0.02"])
    return [Job("mappings_2nodes", "bench_mappings.py", 2, "mappings_2nodes.json", mapping,
                600, env=TWO_NODES),
            Job("mappings_2nodes_4", "bench_mappings.py", 4, "mappings_2nodes_4.json", mapping,
                900, env=TWO_NODES),
            Job("halo_2nodes", "bench_halo.py", 2, "halo_2nodes.json", halo, 900,
                env=TWO_NODES)]


def plan(quick: bool) -> list[Job]:
    """The jobs of a quick or a full run.

    Parameters
    ----------
    quick : bool
        Few sizes, few repeats and small shapes (well under two minutes on two
        cores), or the full run documented in ``benchmarks/README.md``.
    """
    ab = Job("mappings_ab", "bench_mappings_ab.py", 2, "mappings_ab.json",
             ["--rounds", "2", "--repeats", "3", "--warmup", "1"] if quick else [], 600, True)
    if quick:
        sizes = "1KiB,64KiB,1MiB"
        return [ab, 
            Job("mappings", "bench_mappings.py", 2, "mappings.json",
                ["--sizes", sizes, "--repeats", "5", "--warmup", "2"], 300),
            Job("torch_comm", "bench_torch_comm.py", 2, "torch_comm.json",
                ["--sizes", sizes, "--repeats", "5", "--warmup", "2"], 300),
            Job("mlp", "bench_mlp.py", 2, "mlp.json",
                ["--shapes", "128x2048", "--repeats", "3", "--warmup", "1"], 300),
            Job("comm_volume_8", "bench_comm_volume.py", 8, "comm_volume_8.json",
                ["--shapes", "256x64x256,13x9x35"], 300),
            Job("memory", "bench_memory.py", 2, "memory.json",
                ["--shapes", "128x256", "--repeats", "3", "--warmup", "1",
                 "--burgers", "20"], 300),
            Job("attention", "bench_attention.py", 4, "attention.json",
                ["--seq", "512", "--repeats", "3"], 300),
            Job("checkpoint", "bench_checkpoint.py", 4, "checkpoint.json", ["--quick"], 300),
            *_fft_jobs(["--shapes", "32x32x32,33x30x17", "--repeats", "3", "--warmup", "1",
                        "--fno", "2x32x32x8x6"], 300),
            Job("halo", "bench_halo.py", 2, "halo.json",
                ["--shapes", "256x256,64x64x64", "--repeats", "5", "--warmup", "1"], 300),
            Job("pipeline", "bench_pipeline.py", 4, "pipeline.json",
                ["--micro", "p,4p", "--repeats", "3", "--layers", "2", "--sleep-ms", "15"],
                300),
            *_across_nodes(quick),
        ]
    sizes = "1KiB,4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
    shapes = "8192x1024x4096,2048x256x1024,13x9x35"
    return [
        ab,
        Job("mappings", "bench_mappings.py", 2, "mappings.json",
            ["--sizes", sizes, "--repeats", "25", "--warmup", "3"]),
        Job("torch_comm", "bench_torch_comm.py", 2, "torch_comm.json",
            ["--sizes", sizes, "--repeats", "11", "--warmup", "3"]),
        # mlp and checkpoint together take about 6 minutes on 2 quiet cores (mlp ~1.5).
        Job("mlp", "bench_mlp.py", 2, "mlp.json",
            ["--shapes", "256x8192", "--repeats", "9", "--warmup", "1"], 600),
        Job("comm_volume_8", "bench_comm_volume.py", 8, "comm_volume_8.json", ["--shapes", shapes]),
        Job("comm_volume_27", "bench_comm_volume.py", 27, "comm_volume_27.json",
            ["--shapes", shapes], 900),
        Job("memory", "bench_memory.py", 2, "memory.json",
            ["--shapes", "512x1024,1024x2048", "--repeats", "11", "--warmup", "2",
             "--burgers", "600"]),
        Job("attention", "bench_attention.py", 4, "attention.json",
            ["--seq", "4096", "--repeats", "7"], 900),
        Job("checkpoint", "bench_checkpoint.py", 4, "checkpoint.json",
            ["--size", "1GiB", "--repeats", "5"], 900),
        *_fft_jobs(["--shapes", "128x128x128,256x256x256", "--repeats", "7", "--warmup", "2",
                    "--fno", "4x128x128x32x16"], 1800),
        # 31 samples of 20 ms: with 11 of 5 ms two runs of one tree differed by up to 10%
        # on a case of small faces (a 20-35 us exchange).
        Job("halo", "bench_halo.py", 2, "halo.json",
            ["--shapes", "1024x1024,4096x4096,128x128x128,256x256x256", "--repeats", "31",
             "--warmup", "2", "--sample-seconds", "0.02"], 900),
        # About 5 minutes on 2 quiet cores, then 1 for the stage of half the compute.
        Job("pipeline", "bench_pipeline.py", 4, "pipeline.json", ["--repeats", "11"], 900),
        Job("pipeline_small", "bench_pipeline.py", 4, "pipeline_small.json",
            ["--repeats", "11", "--micro", "4p", "--layers", "4", "--sleep-ms", "30"], 600),
        *_across_nodes(quick),
    ]


def named_only(quick: bool) -> list[Job]:
    """Jobs that run only when ``--only`` names them, beside :func:`plan`'s: ``plan``, the
    examples under the planner's layouts on 1-8 ranks (about 13 minutes on 2 cores, the
    machine calibrated before each round; it starts its own jobs)."""
    return [Job("plan", "bench_plan.py", 8, "plan.json",
                ["--rounds", "1", "--steps", "20", "--extra", "0"] if quick else
                ["--wait-quiet", "60"], 3600, True)]


def _fft_jobs(args: list[str], timeout: float) -> list[Job]:
    """bench_fft.py on 1, 2 and 4 ranks (``fft_<ranks>.json``)."""
    return [Job(f"fft_{n}", "bench_fft.py", n, f"fft_{n}.json", args, timeout) for n in (1, 2, 4)]


# --------------------------------------------------------------------------- launcher


def find_mpiexec(explicit: str | None = None) -> str:
    """The launcher to use: ``explicit``, ``$MPIEXEC``, next to ``sys.executable``, or on PATH.

    Raises
    ------
    FileNotFoundError
        When none is found.
    """
    for candidate in (explicit, os.environ.get("MPIEXEC")):
        if candidate:
            found = shutil.which(candidate)
            if found is None:
                raise FileNotFoundError(f"mpiexec {candidate!r} not found")
            return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec next to this Python nor on PATH; install an MPI "
                                "(e.g. pip install mpich) or set MPIEXEC")
    return found


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` belongs to Open MPI (which needs ``--oversubscribe``)."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    text = text.lower()
    # Open MPI 5: "mpirun (Open MPI) 5.0.x"; 4.x: "mpirun (OpenRTE) 4.1.4" (a name of its own).
    return any(key in text for key in ("open mpi", "openmpi", "openrte", "open-rte", "prrte"))


def launch_command(mpiexec: str, ranks: int, argv: Sequence[str],
                   open_mpi: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment to run ``argv`` on ``ranks`` ranks.

    Follows ``scripts/mpirun.sh``: Open MPI gets ``--oversubscribe`` and
    ``OMPI_ALLOW_RUN_AS_ROOT*``; every rank defaults to one BLAS/OpenMP thread
    (the benchmarks raise it where they measure more threads).
    """
    open_mpi = is_open_mpi(mpiexec) if open_mpi is None else open_mpi
    env = dict(os.environ)
    flags: list[str] = []
    if open_mpi:
        flags.append("--oversubscribe")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return [mpiexec, *flags, "-n", str(ranks), *argv], env


def busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of CPU time spent busy over ``seconds`` (Linux ``/proc/stat``; NaN elsewhere)."""
    def read() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = read()
        time.sleep(seconds)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return float("nan")
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total > 0 else float("nan")


def _busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine so far (Linux ``/proc/stat``; NaN elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(limit: float, threshold: float = 0.15) -> float:
    """Wait up to ``limit`` seconds for the machine to be idle; return the last busy fraction."""
    deadline = time.monotonic() + limit
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction(2.0)
    return busy


def run_job(job: Job, out: Path, mpiexec: str, open_mpi: bool, log: Any = sys.stdout) -> dict:
    """Run one job; return ``{"name", "ok", "seconds", "returncode", "command", ...}``."""
    target = out / job.output
    if target.exists():
        target.unlink()
    if job.env and open_mpi:
        print(f"== {job.name}: SKIPPED (two nodes are emulated with MPICH's cliques; Open MPI "
              f"has none)", file=log, flush=True)
        return {"name": job.name, "ok": True, "skipped": True, "seconds": 0.0,
                "returncode": None, "ranks": job.ranks, "command": ""}
    argv = [sys.executable, "-m", "mpi4py", str(HERE / job.script), *job.args,
            "--json", str(target)]
    cmd, env = launch_command(mpiexec, job.ranks, argv, open_mpi)
    env.update(job.env)
    if job.launches:
        cmd = [sys.executable, str(HERE / job.script), "--ranks", str(job.ranks), *job.args,
               "--json", str(target)]
        argv = cmd
    shown = " ".join(Path(c).name if i in (0, len(cmd) - len(argv)) else c
                     for i, c in enumerate(cmd))
    print(f"== {job.name}: {job.ranks} ranks: {shown}", file=log, flush=True)
    start, busy0, ours0 = time.monotonic(), _busy_seconds(), os.times()
    try:
        proc = subprocess.run(cmd, env=env, timeout=job.timeout, cwd=str(REPO))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - start
    ours1 = os.times()
    ours = (ours1.children_user + ours1.children_system
            - ours0.children_user - ours0.children_system)
    # CPU time that other processes of the machine used while the job ran, as a fraction
    # of the machine's capacity: the job's figures are only as good as this is small.
    foreign = (_busy_seconds() - busy0 - ours) / (seconds * (os.cpu_count() or 1))
    ok = code == 0 and target.exists()
    status = "ok" if ok else ("timed out" if code is None else f"failed (exit {code})")
    print(f"== {job.name}: {status} in {seconds:.1f} s", file=log, flush=True)
    return {"name": job.name, "ok": ok, "seconds": round(seconds, 1), "returncode": code,
            "ranks": job.ranks, "command": shown,
            "foreign_cpu": round(max(0.0, foreign), 3) if foreign == foreign else None}


def record_runs(path: Path, quick: bool, seconds: float, runs: list[dict]) -> None:
    """Write ``runs.json``; jobs of an earlier run of the same kind that were not rerun stay."""
    jobs = {r["name"]: r for r in runs}
    try:
        before = json.loads(path.read_text())
        if bool(before.get("quick")) == quick:
            kept = [j for j in before.get("jobs", []) if j["name"] not in jobs]
            seconds += sum(j.get("seconds", 0.0) for j in kept)
            jobs = {**{j["name"]: j for j in kept}, **jobs}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    order = [j.name for j in plan(quick)]
    merged = sorted(jobs.values(), key=lambda j: order.index(j["name"]) if j["name"] in order else 99)
    path.write_text(json.dumps({"quick": quick, "seconds": round(seconds, 1), "jobs": merged},
                               indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pympar bench`` (also ``python benchmarks/run.py``)."""
    parser = argparse.ArgumentParser(prog="python -m pympar bench",
                                     description="Run pympar's benchmarks and write JSON, "
                                                 "PNG plots and a markdown table.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (shared with ``python -m pympar bench``)."""
    parser.add_argument("--quick", action="store_true",
                        help="few sizes, few repeats, small shapes (under two minutes)")
    parser.add_argument("--out", default="bench-results",
                        help="folder for JSON, plots and results.md (default: ./bench-results)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this job (mappings, torch_comm, mlp, comm_volume_8, "
                             "comm_volume_27, memory, attention, checkpoint, halo, "
                             "pipeline, pipeline_small, and "
                             "mappings_ab and plan, which run only when named); repeatable")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME",
                        help="skip this job; repeatable")
    parser.add_argument("--mpiexec", default=None, help="launcher (default: as scripts/mpirun.sh)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each job, wait up to this long for an idle machine")
    parser.add_argument("--report-only", action="store_true",
                        help="do not run anything; rewrite results.md and plots from --out")


def run(args: argparse.Namespace) -> int:
    """Run the planned jobs and write the report; returns the exit status."""
    from benchmarks import report

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    jobs = plan(args.quick) + named_only(args.quick)
    known = {job.name for job in jobs} | {"comm_volume_27"}
    for name in [*args.only, *args.skip]:
        if name not in known:
            print(f"pympar bench: unknown job {name!r}; choose from {sorted(known)}", file=sys.stderr)
            return 2
    jobs = [j for j in jobs if (j.name in args.only if args.only or j.launches else True)
            and j.name not in args.skip]
    runs: list[dict] = []
    if not args.report_only:
        try:
            mpiexec = find_mpiexec(args.mpiexec)
        except FileNotFoundError as err:
            print(f"pympar bench: {err}", file=sys.stderr)
            return 2
        open_mpi = is_open_mpi(mpiexec)
        for name in SLOW_BLAS_ENV:
            if os.environ.get(name):
                print(f"pympar bench: note: {name}={os.environ[name]} is set and may select a "
                      f"slower BLAS kernel; the results record it (unset it for benchmark runs)")
        start = time.monotonic()
        for job in jobs:
            busy = wait_until_quiet(args.wait_quiet) if args.wait_quiet > 0 else busy_fraction(0.5)
            record = run_job(job, out, mpiexec, open_mpi)
            record["busy_before"] = round(busy, 3)
            runs.append(record)
        total = time.monotonic() - start
        record_runs(out / "runs.json", args.quick, total, runs)
        print(f"== all jobs done in {total:.1f} s")
    written = report.write_report(out)
    for path in written:
        print(f"wrote {path}")
    failed = [r["name"] for r in runs if not r["ok"]]
    if failed:
        print(f"pympar bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
