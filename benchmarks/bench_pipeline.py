"""Pipeline schedules: the measured bubble against the ideal, and the memory of each stage.

Run on 4 ranks (2-stage cases use the first 2, the others wait asleep)::

    PYTHONPATH=. mpiexec -n 4 python benchmarks/bench_pipeline.py \\
        [--stages 2,4] [--micro 1,p,2p,4p] [--work compute,sleep] [--repeats 9] \\
        [--width 512 --rows 384 --layers 8] [--sleep-ms 60] [--json PATH]

Every stage is the same: with ``--work compute``, ``--layers`` pairs of ``Linear(width,
width)`` and ``GELU`` on micro-batches of ``--rows`` rows (float32, one BLAS thread per
rank); with ``--work sleep``, one layer whose forward sleeps a third of ``--sleep-ms`` and
whose backward two thirds (and which caches its input, as a layer does). A step is one
:meth:`~pympar.pipeline.PipelineSchedule.run` of ``m`` micro-batches on ``p`` stages
(the loss: the mean of the output, about 0.1 ms a micro-batch), GPipe and 1F1B sampled in
interleaved rounds; its time is the slowest stage's.

The bubble is the fraction of the step a stage spends without work. Measured two ways:

* ``bubble``: ``(T - m t) / T``, ``T`` the step's time and ``t`` the time of one
  micro-batch's forward and backward on the slowest stage alone (each stage in turn, the
  others asleep, the largest of their times: the pace of a pipeline is its slowest stage's;
  with equal stages the last, whose work includes the loss), sampled in every round beside
  the steps; the median over rounds of the round's value. Everything that is not compute
  counts as bubble: the transfers, the schedule's own work, and compute slowed down by
  ranks sharing a core.
* ``idle``: ``1 - busy / T`` per stage, ``busy`` the time its forward and backward (and
  on the last stage the loss) took during that very step (the mean over the stages, median
  over rounds): no calibration, and compute slowed by sharing a core counts as busy.
  ``paced``, the same for the stage that was busiest in the step (median over rounds), is
  ``bubble`` with ``m t`` measured within the step: where the two differ, compute ran at
  another speed in the step than alone (the other stages computing beside it on the
  shared cache and memory, the schedule's order of work, such as a forward between each
  forward and its backward, or the machine's speed moving between the two).

Both are compared with the ideal ``(p - 1) / (m + p - 1)`` of equal stages and free
transfers (GPipe's and 1F1B's alike: ``scripts/draw_pipeline.py`` draws their timelines).
The target is ``bubble`` within 10 % of the ideal at ``m = 4p``
(``benchmarks/report_pipeline.py``).

The transfers are the part of the bubble that the ideal leaves out, and their share depends
on the stage, not on the schedule: each micro-batch sends its activation forward and its
gradient back, ``--rows x --width`` float32 each way (768 KiB by default; 0.19-0.26 ms here
for MPICH to move into a receiver that comes to it from other work, measured with plain
mpi4py), and 1F1B's steady state has both on its critical path. The default stage (8
layers) computes about 60 ms a micro-batch, so each transfer is about 0.4 % of its compute:
a transformer stage (hidden size 4096, 8 layers, 4096 tokens a micro-batch) on GPUs sends
32 MiB for about 0.2 s of compute, 0.05 % over NVLink and 0.7 % over a 25 GB/s network, and
a CPU stage computes longer still. The stage is deepened rather than widened so that two
stages' weights (8 MiB each) still share the 32 MiB cache here without evicting each other.
The full benchmark (``python -m pympar bench``) also runs the stage of half the compute for
the same bytes (``--layers 4 --sleep-ms 30``, ``pipeline_small.json``), where the transfers
are twice the share. Compute on ranks that share cores does not measure a schedule: with 4
stages on 2 cores two stages compute at once on one core, each at half speed, so those rows
are not judged and ``--work sleep`` stands in for the compute (a sleeping stage needs no
core: what is left to measure is the schedule's ordering, the transfers and the waits).

Memory (``--work compute``): the micro-batches each stage holds at most (counted by the
schedule, ``peak_in_flight``) against GPipe's ``m`` and 1F1B's ``min(p - s, m)``, their
cached activations (that count times one micro-batch's ``activation_bytes``) and the peak
that ``tracemalloc`` sees during one step above its start (every array the step
allocates: caches, received activations, temporaries).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from pympar.memory import activation_bytes  # noqa: E402
from pympar.mesh import Mesh  # noqa: E402
from pympar.modules import GELU, Linear, Module, Sequential  # noqa: E402
from pympar.pipeline import GPipe, OneFOneB, split_stages  # noqa: E402

WORLD = MPI.COMM_WORLD
SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB}
WORKS = ("compute", "sleep")


class Clocked(Module):
    """A stage's layers (or the last stage's loss), adding the seconds their forwards and
    backwards take to ``busy``."""

    def __init__(self, inner: Module) -> None:
        super().__init__()
        self.inner, self.busy = inner, 0.0

    def forward(self, *args: Any) -> Any:
        start = time.perf_counter()
        y = self.inner.forward(*args)
        self.busy += time.perf_counter() - start
        return y

    def backward(self, dy: Any) -> Any:
        start = time.perf_counter()
        dx = self.inner.backward(dy)
        self.busy += time.perf_counter() - start
        return dx


class Sleep(Module):
    """Compute stood in for by sleeps: ``forward`` sleeps, caches its input and returns it;
    ``backward`` sleeps and returns the output gradient."""

    def __init__(self, forward_seconds: float, backward_seconds: float) -> None:
        super().__init__()
        self.seconds = (forward_seconds, backward_seconds)

    def forward(self, x: Any) -> Any:
        time.sleep(self.seconds[0])
        self.save_for_backward(x)
        return x

    def backward(self, dy: Any) -> Any:
        self.saved_tensors()
        time.sleep(self.seconds[1])
        return dy


class MeanLoss(Module):
    """The mean of the output: a loss whose forward and backward cost next to nothing."""

    def forward(self, y: Any, target: Any) -> float:
        self.save_for_backward(y.shape, y.dtype)
        return float(y.mean())

    def backward(self, grad: float = 1.0) -> Any:
        shape, dtype = self.saved_tensors()
        return np.full(shape, grad / max(int(np.prod(shape)), 1), dtype=dtype)


def stage_layers(work: str, args: argparse.Namespace) -> Clocked:
    """One stage's layers for ``work``, clocked."""
    if work == "sleep":
        third = args.sleep_ms / 3e3
        return Clocked(Sleep(third, 2 * third))
    pairs = [[Linear(args.width, args.width, seed=i), GELU()] for i in range(args.layers)]
    return Clocked(Sequential(*(layer for pair in pairs for layer in pair)))


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def micro_batch_counts(text: str, p: int) -> list[int]:
    """``"1,p,2p,4p"`` for ``p`` stages: ``[1, p, 2p, 4p]`` (repeats dropped)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        m = (int(item[:-1] or 1) * p) if item.endswith("p") else int(item)
        if m < 1:
            raise ValueError(f"--micro: {item!r} gives {m} micro-batches")
        if m not in out:
            out.append(m)
    return out


class Pipeline:
    """A pipeline of ``p`` equal stages on ``comm`` and both schedules on ``m``
    micro-batches, with the whole batch and a target."""

    def __init__(self, comm: MPI.Intracomm, work: str, p: int, m: int,
                 args: argparse.Namespace) -> None:
        self.comm = comm
        self.group = Mesh(comm, {"pp": p}).group("pp")
        self.stage = split_stages([lambda: stage_layers(work, args)] * p, self.group)
        self.clock = next(iter(self.stage))
        last = self.group.rank == p - 1
        self.loss = Clocked(MeanLoss()) if last else None
        self.clocks = [self.clock] + ([self.loss] if last else [])  # this stage's work
        self.runs = {name: schedule(self.stage, self.group, m, self.loss,
                                    label=f"bench-{name}")
                     for name, schedule in SCHEDULES.items()}
        rng = np.random.default_rng(self.group.rank)
        self.batch = rng.standard_normal((m * args.rows, args.width)).astype(np.float32)
        self.micro_batch = self.batch[:args.rows]

    def step(self, name: str) -> tuple[float, float]:
        """One step of schedule ``name``: (the slowest stage's seconds, this stage's busy
        seconds)."""
        self.stage.zero_grad()
        common.sleep_barrier(self.comm)
        for clock in self.clocks:
            clock.busy = 0.0
        start = time.perf_counter()
        self.runs[name].run(self.batch, self.batch)
        mine = time.perf_counter() - start
        return self.comm.allreduce(mine, op=MPI.MAX), sum(clock.busy for clock in self.clocks)

    def alone(self, calls: int = 3) -> list[float]:
        """One micro-batch's forward and backward (and the last stage's loss) on each
        stage in turn, the others asleep: each stage's median seconds, in stage order."""
        times = []
        for s in range(self.group.size):
            common.sleep_barrier(self.comm)
            if self.group.rank == s:
                for _ in range(calls):
                    start = time.perf_counter()
                    y = self.stage.forward(self.micro_batch)
                    if self.loss is not None:  # the last stage's work includes the loss
                        self.loss.forward(y, y)
                        y = self.loss.backward(1.0)
                    self.stage.backward(y)
                    times.append(time.perf_counter() - start)
        common.sleep_barrier(self.comm)
        return [float(t) for t in self.comm.allgather(common.median(times))]

    def free(self) -> None:
        for run in self.runs.values():
            run.free()
        self.group.free()


def measure(comm: MPI.Intracomm, work: str, p: int, m: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """The bubble of both schedules, ``m`` micro-batches on ``p`` stages (ranks of
    ``comm``)."""
    pipe = Pipeline(comm, work, p, m, args)
    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in SCHEDULES}
    alone: list[list[float]] = []  # per round, each stage's seconds

    def sampler(name: str):
        def sample() -> float:
            seconds, busy = pipe.step(name)
            steps[name].append((seconds, busy))
            return seconds
        return sample

    def calibrate() -> float:
        alone.append(pipe.alone())
        return max(alone[-1])

    samplers = {name: sampler(name) for name in SCHEDULES}
    samplers["alone"] = calibrate
    common.interleaved(samplers, args.repeats, args.warmup, comm)
    alone = alone[args.warmup:]
    ideal = (p - 1) / (m + p - 1)
    out: dict[str, Any] = {"work": work, "stages": p, "micro_batches": m, "ideal": ideal,
                           "oversubscribed": bool(comm.allreduce(cores() < p, op=MPI.LOR)),
                           "micro_batch_ms": 1e3 * common.median([max(a) for a in alone]),
                           "stage_ms": [1e3 * common.median(list(a)) for a in zip(*alone)],
                           "alone_ms": [[1e3 * t for t in a] for a in alone],
                           "schedules": {}}
    for name in SCHEDULES:
        timed = steps[name][args.warmup:]
        step = [s for s, _ in timed]
        # Every stage's busy seconds of each step, gathered: the idle fraction per stage.
        busy = np.array(comm.allgather([b for _, b in timed]))  # (stages, rounds)
        idle = 1.0 - busy / np.array(step)[None, :]
        # The slowest stage sets the pace (with equal stages the last, whose work includes
        # the loss).
        bubble = [1.0 - m * max(a) / s for a, s in zip(alone, step)]
        out["schedules"][name] = {
            "step_ms": 1e3 * common.median(step), "samples_ms": [1e3 * s for s in step],
            "bubble": common.median(bubble), "idle": float(np.median(idle.mean(axis=0))),
            "paced": float(np.median(idle.min(axis=0))),
            "idle_per_stage": [float(v) for v in np.median(idle, axis=1)],
            "idle_samples": idle.T.tolist()}  # per round, each stage's
    pipe.free()
    return out


def memory(comm: MPI.Intracomm, p: int, m: int, args: argparse.Namespace) -> list[dict]:
    """Per schedule and stage: the micro-batches held at most, the formula, the cached
    activations and tracemalloc's peak during a step (compute stages)."""
    pipe = Pipeline(comm, "compute", p, m, args)
    pipe.stage.forward(pipe.micro_batch)
    one = activation_bytes(pipe.stage)  # one micro-batch's caches
    pipe.stage.backward(np.zeros_like(pipe.micro_batch))
    rows = []
    for name, run in pipe.runs.items():
        pipe.step(name)  # gradients and buffers allocated before the measured step
        pipe.stage.zero_grad()
        run.peak_in_flight = 0
        gc.collect()
        common.sleep_barrier(comm)
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        run.run(pipe.batch, pipe.batch)
        peak = tracemalloc.get_traced_memory()[1] - start
        tracemalloc.stop()
        s = pipe.group.rank
        mine = {"stage": s, "in_flight": run.peak_in_flight,
                "formula": m if name == "gpipe" else min(p - s, m),
                "cached_bytes": run.peak_in_flight * one, "traced_peak_bytes": peak}
        rows.append({"schedule": name, "stages": p, "micro_batches": m,
                     "micro_batch_bytes": one, "per_stage": comm.allgather(mine)})
    pipe.free()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4", help="stage counts, comma-separated")
    parser.add_argument("--micro", default="1,p,2p,4p",
                        help="micro-batch counts per step: numbers or multiples of the "
                        "stage count p (2p)")
    parser.add_argument("--work", default="compute,sleep",
                        help=f"what a stage does, comma-separated, of {', '.join(WORKS)}")
    parser.add_argument("--width", type=int, default=512, help="features of a layer")
    parser.add_argument("--rows", type=int, default=384, help="rows of a micro-batch")
    parser.add_argument("--layers", type=int, default=8,
                        help="Linear + GELU per stage (8: about 60 ms a micro-batch, as "
                        "--sleep-ms, on the committed run's cores)")
    parser.add_argument("--sleep-ms", type=float, default=60.0,
                        help="--work sleep: a micro-batch's forward and backward, ms")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed samples per variant")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    works = args.work.split(",")
    try:
        stages = [int(p) for p in args.stages.split(",")]
        counts = {p: micro_batch_counts(args.micro, p) for p in stages}
        if not set(works) <= set(WORKS) or min(stages) < 1 or max(stages) > WORLD.size:
            raise ValueError(f"--work of {', '.join(WORKS)} and --stages from 1 to the "
                             f"{WORLD.size} ranks")
    except ValueError as err:
        common.say(WORLD, f"bench_pipeline: {err}")
        return 2
    info = common.machine_info(WORLD)
    cases: list[dict] = []
    memories: list[dict] = []
    with common.blas_threads(1):
        for p in stages:
            comm = WORLD.Split(0 if WORLD.rank < p else MPI.UNDEFINED, WORLD.rank)
            if comm != MPI.COMM_NULL:
                for work in works:
                    for m in counts[p]:
                        case = measure(comm, work, p, m, args)
                        cases.append(case)
                        common.say(comm, f"  {work} p={p} m={m}: ideal {case['ideal']:.3f}, "
                                   + ", ".join(f"{n} {c['step_ms']:.1f} ms bubble "
                                               f"{c['bubble']:.3f} idle {c['idle']:.3f}"
                                               for n, c in case["schedules"].items()))
                if "compute" in works:
                    for m in counts[p]:
                        memories += memory(comm, p, m, args)
                comm.Free()
            common.sleep_barrier(WORLD, pause=0.05)  # ranks left out wake up rarely
    if WORLD.rank == 0:
        common.write_json(args.json, {
            "benchmark": "pipeline", "machine": info, "args": vars(args),
            "ranks": WORLD.size, "cores": cores(), "cases": cases,
            "memory": memories})
    return 0


if __name__ == "__main__":
    sys.exit(main())
