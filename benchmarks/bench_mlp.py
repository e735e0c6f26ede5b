"""Tensor-parallel MLP step (``h -> 4h -> h``, GELU, forward + backward, float32).

Run on 2 ranks (any number ``p`` works; TP = ``p``)::

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_mlp.py \\
        [--shapes 256x8192,1024x2048] [--repeats 9] [--json PATH] [--no-torch]

A shape ``HxT`` is hidden size ``H`` and ``T`` tokens (rows of the input). The
variants, timed in the same job, interleaved round by round:

* ``pympar serial 1 thread``: ``Linear -> GELU -> Linear`` on rank 0 with one
  BLAS thread while the other ranks sleep (one core);
* ``pympar serial p threads``: the same with ``p`` BLAS threads (all cores);
* ``pympar TP=p``: ``ColumnParallelLinear(gather_output=False) -> GELU ->
  RowParallelLinear(input_is_parallel=True)``, one BLAS thread per rank;
* ``pympar TP=p no dx``: the same model built with ``input_grad=False``: no input
  gradient, and no all-reduce of it;
* ``hand-written NumPy + mpi4py TP=p``: the same step written by hand
  (:mod:`benchmarks.mlp_by_hand`): same BLAS calls, same local GELU, no pympar. The limit for
  this stack: ``pympar TP / hand-written TP`` is what pympar's machinery costs;
* ``torch serial 1 / p threads`` and ``torch DTensor TP=p``
  (``ColwiseParallel``/``RowwiseParallel`` through ``parallelize_module`` on
  gloo), and ``torch DTensor TP=p no dx`` (an input that does not require its
  gradient), when torch is installed.

A step is forward and backward with fresh gradients (set to None before each
step, so no variant pays for accumulation); the input requires its gradient
in every variant but the two ``no dx`` ones, which compare the same work side by side.
All variants start from the same weights (pympar's seeded init, copied into torch), and
the first step of each is checked against the serial pympar result (output, and input
gradient where computed). Parallel efficiency is ``serial 1 thread / (p x TP=p)``.

Every ratio names its anchor. Against torch, the serial steps come first: ``torch serial /
pympar serial`` (one thread each) is the difference of the two BLAS builds and kernels, not
of any parallel machinery, and it is most of ``pympar TP / torch DTensor TP``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.mlp_by_hand import HandWrittenTP  # noqa: E402
from pympar import manager  # noqa: E402
from pympar.modules import (GELU, ColumnParallelLinear, Linear, RowParallelLinear,  # noqa: E402
                            Sequential)

WORLD = MPI.COMM_WORLD
SEEDS = (1, 2)
#: Seconds of rest after each sample: OpenBLAS's idle workers spin ~2**28 cycles before
#: sleeping, and would steal a core from the variant after a 2-thread one.
SETTLE = 0.2


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"256x8192,1024x2048"`` -> ``[(256, 8192), (1024, 2048)]`` (hidden, tokens)."""
    shapes = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            hidden, tokens = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}; use HxT, e.g. 256x8192")
        shapes.append((hidden, tokens))
    return shapes


# --------------------------------------------------------------------------- pympar


def pympar_serial(hidden: int, ffn: int) -> Sequential:
    """The serial MLP ``Linear(h, f) -> GELU -> Linear(f, h)``, float32."""
    return Sequential(Linear(hidden, ffn, seed=SEEDS[0]), GELU(), Linear(ffn, hidden, seed=SEEDS[1]))


def pympar_tensor_parallel(hidden: int, ffn: int, input_grad: bool = True) -> Sequential:
    """The Megatron MLP over the current tensor-parallel group (same full weights);
    ``input_grad=False`` skips the input gradient and its all-reduce."""
    return Sequential(ColumnParallelLinear(hidden, ffn, gather_output=False, seed=SEEDS[0]), GELU(),
                      RowParallelLinear(ffn, hidden, input_is_parallel=True, seed=SEEDS[1]),
                      input_grad=input_grad)


def pympar_step(model: Sequential, x: np.ndarray, dy: np.ndarray) -> tuple[Any, Any]:
    """One forward + backward with fresh gradients; returns ``(y, dx)``."""
    model.zero_grad(set_to_none=True)
    y = model.forward(x)
    return y, model.backward(dy)


# --------------------------------------------------------------------------- torch


def torch_serial(torch: Any, serial: Sequential) -> Any:
    """``nn.Linear -> nn.GELU('tanh') -> nn.Linear`` holding the pympar model's weights."""
    nn = torch.nn
    first, _, second = list(serial)
    model = nn.Sequential(nn.Linear(first.in_features, first.out_features), nn.GELU(approximate="tanh"),
                          nn.Linear(second.in_features, second.out_features))
    with torch.no_grad():
        for layer, ours in ((model[0], first), (model[2], second)):
            layer.weight.copy_(torch.from_numpy(ours.weight.data))
            layer.bias.copy_(torch.from_numpy(ours.bias.data))
    return model


def torch_dtensor(torch: Any, serial: Sequential, comm: MPI.Comm) -> Any:
    """The serial torch MLP sharded with ``ColwiseParallel`` / ``RowwiseParallel`` on gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (comm.Get_size(),))
    model = torch_serial(torch, serial)
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _host(a: Any) -> np.ndarray:
    """A NumPy view of a pympar or torch result."""
    return np.asarray(a.detach().numpy() if hasattr(a, "detach") else a)


def torch_step(model: Any, x: Any, dy: Any) -> tuple[Any, Any]:
    """One forward + backward with fresh gradients; returns ``(y, dx)`` (``dx`` None when
    ``x`` requires no gradient)."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    y = model(x)
    y.backward(dy)
    return y, x.grad


# --------------------------------------------------------------------------- driver


def _threads(torch: Any, n: int) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Wrap a callable so that NumPy's BLAS (and torch) use ``n`` threads while it runs."""
    def wrap(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            if torch is not None:
                torch.set_num_threads(n)
            with common.blas_threads(n):
                return fn()
        return run
    return wrap


def run_shape(hidden: int, tokens: int, repeats: int, warmup: int, torch: Any,
              comm: MPI.Comm) -> dict[str, Any]:
    """Time every variant on one shape; returns one result row (rank 0's copy is complete)."""
    p = comm.Get_size()
    ffn = 4 * hidden
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    dy = (rng.standard_normal((tokens, hidden)) / np.sqrt(tokens * hidden)).astype(np.float32)
    serial = pympar_serial(hidden, ffn)
    parallel = pympar_tensor_parallel(hidden, ffn)
    no_dx = pympar_tensor_parallel(hidden, ffn, input_grad=False)
    one, many = _threads(torch, 1), _threads(torch, p)

    # Reference and checks: every variant's first step against the serial pympar one.
    with common.blas_threads(1):
        y_ref, dx_ref = pympar_step(serial, x, dy)
    checks: dict[str, float] = {}

    def check(name: str, y: Any, dx: Any) -> None:
        pairs = [(y, y_ref)] + ([] if dx is None else [(dx, dx_ref)])
        err = max(float(np.max(np.abs(_host(a) - ref)) / np.max(np.abs(ref))) for a, ref in pairs)
        checks[name] = comm.allreduce(err, op=MPI.MAX)

    steps: dict[str, Callable[[], float]] = {}
    s1, sp, tp = "pympar serial 1 thread", f"pympar serial {p} threads", f"pympar TP={p}"
    tp_nodx = f"pympar TP={p} no dx"
    def sampler(timer: Callable[..., float], threads: Callable[..., Callable[[], Any]],
                step: Callable[[], Any]) -> Callable[[], float]:
        # Thread counts are set outside the timed region.
        return lambda: threads(lambda: timer(comm, step))()

    root, every = common.timed_on_root, common.timed_parallel
    steps[s1] = sampler(root, one, lambda: pympar_step(serial, x, dy))
    steps[sp] = sampler(root, many, lambda: pympar_step(serial, x, dy))
    steps[tp] = sampler(every, one, lambda: pympar_step(parallel, x, dy))
    steps[tp_nodx] = sampler(every, one, lambda: pympar_step(no_dx, x, dy))
    first, _, second = list(serial)
    hand = HandWrittenTP(first.weight.data, first.bias.data, second.weight.data,
                         second.bias.data, comm)
    hand_tp = f"hand-written NumPy + mpi4py TP={p}"
    steps[hand_tp] = sampler(every, one, lambda: hand.step(x, dy))
    with common.blas_threads(1):
        check(tp, *pympar_step(parallel, x, dy))
        check(tp_nodx, *pympar_step(no_dx, x, dy))
        check(hand_tp, *hand.step(x, dy))
    names = {"serial1": s1, "serialp": sp, "tp": tp, "tp_nodx": tp_nodx, "hand_tp": hand_tp}
    if torch is not None:
        t_serial = torch_serial(torch, serial)
        t_parallel = torch_dtensor(torch, serial, comm)
        tx = torch.from_numpy(x.copy()).requires_grad_(True)
        tx_nodx = torch.from_numpy(x.copy())  # requires no gradient
        tdy = torch.from_numpy(dy.copy())
        t1, tpn, ttp = "torch serial 1 thread", f"torch serial {p} threads", f"torch DTensor TP={p}"
        ttp_nodx = f"torch DTensor TP={p} no dx"
        steps[t1] = sampler(root, one, lambda: torch_step(t_serial, tx, tdy))
        steps[tpn] = sampler(root, many, lambda: torch_step(t_serial, tx, tdy))
        steps[ttp] = sampler(every, one, lambda: torch_step(t_parallel, tx, tdy))
        steps[ttp_nodx] = sampler(every, one, lambda: torch_step(t_parallel, tx_nodx, tdy))
        torch.set_num_threads(1)
        check(t1, *torch_step(t_serial, tx, tdy))
        check(ttp, *torch_step(t_parallel, tx, tdy))
        check(ttp_nodx, *torch_step(t_parallel, tx_nodx, tdy))
        names.update(torch_serial1=t1, torch_serialp=tpn, torch_tp=ttp, torch_tp_nodx=ttp_nodx)
    samples = common.interleaved(steps, repeats, warmup, comm, settle=SETTLE)
    ms = {name: common.median(values) * 1e3 for name, values in samples.items()}
    row: dict[str, Any] = {
        "hidden": hidden, "tokens": tokens, "ffn": ffn, "ranks": p,
        "step_ms": ms, "min_ms": {k: min(vs) * 1e3 for k, vs in samples.items()},
        "samples_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in samples.items()},
        "max_rel_error": checks, "names": names,
        "gflop": 3 * 2 * 2 * tokens * hidden * ffn / 1e9,
        "efficiency_pympar": ms[s1] / (p * ms[tp]),
        "ratio_pympar_tp_over_hand_tp": ms[tp] / ms[hand_tp],
        # Paired within each round: the machine's drift falls on both alike.
        "ratio_pympar_tp_over_hand_tp_paired": common.paired_ratio(samples[tp],
                                                                   samples[hand_tp]),
    }
    if torch is not None:
        row["efficiency_torch"] = ms[names["torch_serial1"]] / (p * ms[names["torch_tp"]])
        row["ratio_pympar_tp_over_torch_tp"] = ms[tp] / ms[names["torch_tp"]]
        row["ratio_pympar_nodx_over_torch_nodx"] = ms[tp_nodx] / ms[names["torch_tp_nodx"]]
        row["ratio_pympar_tp_over_torch_serialp"] = ms[tp] / ms[names["torch_serialp"]]
        row["ratio_torch_serial1_over_pympar_serial1"] = ms[names["torch_serial1"]] / ms[s1]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("256x8192,1024x2048"),
                        help="comma-separated HIDDENxTOKENS")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per shape")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch variants")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    comm = WORLD
    torch, reason = (None, "--no-torch given") if args.no_torch else common.import_torch_distributed()
    if torch is None:
        common.say(comm, f"bench_mlp: skipping the torch variants: {reason}")
    info = common.machine_info(comm)
    manager.initialize_parallel(tensor_parallel_size=comm.Get_size(), comm=comm)
    dist = None
    try:
        if torch is not None:
            dist = common.init_torch_gloo(comm)
        rows = []
        for hidden, tokens in args.shapes:
            common.say(comm, f"bench_mlp: H={hidden} T={tokens} on {comm.Get_size()} ranks ...")
            rows.append(run_shape(hidden, tokens, args.repeats, args.warmup, torch, comm))
            if comm.Get_rank() == 0:
                print(format_row(rows[-1]), flush=True)
    finally:
        if dist is not None:
            dist.destroy_process_group()
        manager.destroy_parallel()
    if comm.Get_rank() == 0:
        common.write_json(args.json, {
            "benchmark": "mlp", "machine": info, "repeats": args.repeats, "warmup": args.warmup,
            "torch_skipped": reason, "rows": rows})
    return 0


def format_row(row: dict[str, Any]) -> str:
    """The row as aligned text lines (step medians, efficiency, ratio)."""
    lines = [f"  H={row['hidden']} T={row['tokens']} ({row['gflop']:.1f} GFLOP per step)"]
    for name, value in row["step_ms"].items():
        err = row["max_rel_error"].get(name)
        lines.append(f"    {name:36} {value:9.1f} ms" + ("" if err is None else f"   rel err {err:.1e}"))
    lines.append(f"    parallel efficiency pympar {row['efficiency_pympar']:.3f}"
                 + (f", torch {row['efficiency_torch']:.3f}" if "efficiency_torch" in row else ""))
    lines.append(f"    pympar TP / hand-written NumPy + mpi4py TP "
                 f"{row['ratio_pympar_tp_over_hand_tp']:.3f} (same BLAS and GELU, no pympar)")
    if "ratio_torch_serial1_over_pympar_serial1" in row:
        lines.append("    torch serial / pympar serial, 1 thread "
                     f"{row['ratio_torch_serial1_over_pympar_serial1']:.3f} (the BLAS builds)")
    if "ratio_pympar_tp_over_torch_tp" in row:
        lines.append(f"    pympar TP / torch DTensor TP {row['ratio_pympar_tp_over_torch_tp']:.3f}"
                     " (input gradient computed)")
    if "ratio_pympar_nodx_over_torch_nodx" in row:
        lines.append("    pympar TP no dx / torch DTensor TP no dx "
                     f"{row['ratio_pympar_nodx_over_torch_nodx']:.3f} (input gradient skipped)")
    return "\n".join(lines)


if __name__ == "__main__":
    # DTensor's functional collectives warn at exit about outputs the benchmark never waits on.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.exit(main())
