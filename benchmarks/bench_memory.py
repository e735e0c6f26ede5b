"""Memory per rank with ZeRO, mixed precision and recomputation, and ZeRO's step time.

Run on 2 ranks (DP = the number of ranks)::

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_memory.py \\
        [--shapes 512x1024] [--repeats 9] [--warmup 2] [--json PATH] [--no-torch] \\
        [--burgers STEPS [--burgers-flags "--cp 2"]]

A shape ``HxT`` is the MLP ``Linear(H, 4H) -> GELU -> Linear(4H, H)`` with ``T`` tokens per
rank. For every configuration the largest per-rank count of :mod:`pympar.memory` (parameters,
gradients, optimizer state, cached activations after forward) is reported beside its formula
for ``N`` parameters over ``d`` data-parallel ranks:

* ``AdamW`` (float32): 4N parameters, 4N gradients, 8N optimizer state;
* ``ZeRO``: optimizer state 8N/d;
* ``ZeRO + bf16``: 2N parameters, 2N + 4N/d gradients (the float32 reduced share),
  12N/d optimizer state (moments and float32 masters);
* ``recompute``: cached activations = the block input (``4 T H`` bytes) instead of all of them.

Step time (forward, backward, gradient sync, AdamW update, float32) is timed for the unsharded
step (``allreduce_gradients`` + ``AdamW``) and ``ZeroRedundancyOptimizer``, interleaved, median
of rounds; with torch installed also torch's ``DistributedDataParallel`` + ``AdamW`` and
``ZeroRedundancyOptimizer`` on gloo, with their optimizer-state bytes.

``--burgers STEPS`` also trains the main example (``examples/burgers.py``, default model, the
example's flags in ``--burgers-flags``) for ``STEPS`` steps in each configuration (fp32, ZeRO,
recompute, bf16, ZeRO + bf16) and reports its validation error, its median step time and the
largest per-rank bytes, the activations being the peak cached during a step, beside the
formulas for the ``N`` parameters of a rank (ZeRO over the data x context group of size ``d``).
fp16 is left out: NumPy has no float16 matrix product kernel, so it times nothing useful.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.bench_mlp import parse_shapes  # noqa: E402
from pympar import backend  # noqa: E402
from pympar.group import Group  # noqa: E402
from pympar.memory import memory_report  # noqa: E402
from pympar.modules import GELU, Linear, Sequential  # noqa: E402
from pympar.modules.recompute import Recompute  # noqa: E402
from pympar.optim import AdamW, allreduce_gradients  # noqa: E402
from pympar.zero import ZeroRedundancyOptimizer  # noqa: E402

WORLD = MPI.COMM_WORLD
KINDS = ("parameters", "gradients", "optimizer", "activations")


def mlp(hidden: int, dtype: Any = np.float32) -> Sequential:
    """``Linear(H, 4H) -> GELU -> Linear(4H, H)`` with seeded weights."""
    return Sequential(Linear(hidden, 4 * hidden, dtype=dtype, seed=1), GELU(),
                      Linear(4 * hidden, hidden, dtype=dtype, seed=2))


def measure(hidden: int, tokens: int, group: Group, config: str) -> dict[str, Any]:
    """One forward/backward/step of ``config``; the largest per-rank bytes and the formulas."""
    half = config == "ZeRO + bf16"
    dtype = backend.bfloat16 if half else np.float32
    inner = mlp(hidden, dtype)
    model = Recompute(inner) if config == "recompute" else inner
    sharded = config.startswith("ZeRO")
    opt = ZeroRedundancyOptimizer(model, AdamW, group=group) if sharded else AdamW(model)
    x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(dtype)
    y = model(x)
    cached = memory_report(model)["activations"]
    model.backward(y)
    if not sharded:
        allreduce_gradients(model, group)
    opt.step()
    report = memory_report(model, opt)
    report["activations"] = cached
    measured = {k: group.comm.allreduce(report[k], op=MPI.MAX) for k in KINDS}
    n, d, t, h = sum(p.size for p in model.parameters()), group.size, tokens, hidden
    size = 2 if half else 4
    # Column input, GELU input + tanh, second Linear input: (H + 4H + 4H + 4H) x T elements.
    formula = {"parameters": size * n,
               "gradients": size * n + (4 * n / d if half else 0),
               "optimizer": (12 if half else 8) * n / (d if sharded else 1),
               "activations": 4 * t * h if config == "recompute" else size * t * 13 * h}
    return {"config": config, "params": n, "ranks": d, "measured": measured, "formula": formula}


def torch_variants(torch: Any, hidden: int, tokens: int) -> dict[str, Any]:
    """torch DDP + AdamW and DDP + ZeroRedundancyOptimizer(AdamW) steps, same weights."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel

    nn = torch.nn
    ours = mlp(hidden)
    out = {}
    for name, zero in (("torch DDP + AdamW", False), ("torch ZeRO", True)):
        model = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                              nn.Linear(4 * hidden, hidden))
        with torch.no_grad():
            for layer, src in ((model[0], ours[0]), (model[2], ours[2])):
                layer.weight.copy_(torch.from_numpy(src.weight.data))
                layer.bias.copy_(torch.from_numpy(src.bias.data))
        ddp = DistributedDataParallel(model)
        opt = (TorchZero(ddp.parameters(), optimizer_class=torch.optim.AdamW) if zero
               else torch.optim.AdamW(ddp.parameters()))
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((tokens, hidden))
                             .astype(np.float32))

        def step(ddp: Any = ddp, opt: Any = opt, x: Any = x) -> None:
            opt.zero_grad(set_to_none=False)
            y = ddp(x)
            y.backward(y.detach())
            opt.step()

        step()
        state = opt.optim.state if zero else opt.state
        nbytes = sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        out[name] = (step, nbytes)
    return out


def run_shape(hidden: int, tokens: int, repeats: int, warmup: int, torch: Any,
              group: Group) -> dict[str, Any]:
    """Memory table and timed steps for one shape."""
    configs = ["AdamW", "ZeRO", "recompute"]
    if backend.bfloat16 is not None:
        configs.append("ZeRO + bf16")
    memory = [measure(hidden, tokens, group, c) for c in configs]
    comm = group.comm
    x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32)
    steps: dict[str, Callable[[], float]] = {}
    for name, sharded in (("pympar allreduce + AdamW", False), ("pympar ZeRO", True)):
        model = mlp(hidden)
        opt = ZeroRedundancyOptimizer(model, AdamW, group=group) if sharded else AdamW(model)

        def step(model: Sequential = model, opt: Any = opt, sharded: bool = sharded) -> None:
            opt.zero_grad()
            model.backward(model(x))
            if not sharded:
                allreduce_gradients(model, group)
            opt.step()

        steps[name] = lambda step=step: common.timed_parallel(comm, step)
    torch_bytes = {}
    if torch is not None:
        torch.set_num_threads(1)  # one thread per rank, like NumPy's BLAS here
        for name, (step, nbytes) in torch_variants(torch, hidden, tokens).items():
            steps[name] = lambda step=step: common.timed_parallel(comm, step)
            torch_bytes[name] = comm.allreduce(nbytes, op=MPI.MAX)
    with common.blas_threads(1):
        samples = common.interleaved(steps, repeats, warmup, comm)
    ms = {k: common.median(v) * 1e3 for k, v in samples.items()}
    row = {"hidden": hidden, "tokens": tokens, "ranks": group.size, "memory": memory,
           "step_ms": ms, "samples_ms": {k: [round(v * 1e3, 3) for v in vs]
                                         for k, vs in samples.items()},
           "ratio_zero_over_allreduce": ms["pympar ZeRO"] / ms["pympar allreduce + AdamW"],
           "torch_optimizer_bytes": torch_bytes}
    if torch is not None:
        row["ratio_pympar_zero_over_torch_zero"] = ms["pympar ZeRO"] / ms["torch ZeRO"]
    return row


def format_row(row: dict[str, Any]) -> str:
    """The row as text: bytes per rank vs formula, then step times."""
    lines = [f"  H={row['hidden']} T={row['tokens']} DP={row['ranks']}"]
    for entry in row["memory"]:
        got, want = entry["measured"], entry["formula"]
        cells = ", ".join(f"{k} {got[k] / 2**20:.2f}/{want[k] / 2**20:.2f}" for k in KINDS)
        lines.append(f"    {entry['config']:12} MiB measured/formula: {cells}")
    for name, value in row["step_ms"].items():
        lines.append(f"    {name:26} {value:9.2f} ms")
    lines.append(f"    ZeRO / allreduce step {row['ratio_zero_over_allreduce']:.3f}")
    for name, nbytes in row["torch_optimizer_bytes"].items():
        lines.append(f"    {name} optimizer state {nbytes / 2**20:.2f} MiB per rank")
    return "\n".join(lines)


#: The example's flags of each Burgers configuration.
BURGERS_CONFIGS = {"fp32": [], "ZeRO": ["--zero"], "recompute": ["--recompute"],
                   "bf16": ["--precision", "bf16"],
                   "ZeRO + bf16": ["--zero", "--precision", "bf16"]}


def load_burgers() -> Any:
    """The main example as a module (``examples/burgers.py``)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "burgers.py"
    spec = importlib.util.spec_from_file_location("burgers_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_burgers(steps: int, flags: list[str], comm: MPI.Intracomm) -> list[dict[str, Any]]:
    """Train the Burgers example in every configuration; one row each, with the formulas."""
    burgers = load_burgers()
    rows: list[dict[str, Any]] = []
    for config, extra in BURGERS_CONFIGS.items():
        if "bf16" in extra and backend.bfloat16 is None:
            common.say(comm, f"bench_memory: skipping Burgers {config}: no ml_dtypes")
            continue
        args = burgers.parse_args(["--steps", str(steps), "--quiet", *flags, *extra])
        with common.blas_threads(1):
            metrics = burgers.train(args, comm)
        worst = {k: max(m[k] for m in metrics["memory"]) for k in (*KINDS, "peak_rss")}
        rows.append({"config": config, "flags": extra, "layout": metrics["layout"],
                     "val_rel_l2": metrics["val_rel_l2"],
                     "step_ms": metrics["median_step_seconds"] * 1e3, "measured": worst})
    n = rows[0]["measured"]["parameters"] / 4  # fp32 parameters of the largest rank
    lay = rows[0]["layout"]
    d = lay["dp"] * lay["cp"]
    for row in rows:
        half, sharded = "bf16" in row["config"], "ZeRO" in row["config"]
        share = d if sharded else 1  # the unsharded bf16 masters are over this rank alone
        row["formula"] = {"parameters": (2 if half else 4) * n,
                          "gradients": (2 * n + 4 * n / share) if half else 4 * n,
                          "optimizer": (12 if half else 8) * n / share}
    return rows


def format_burgers(rows: list[dict[str, Any]], steps: int) -> str:
    """The Burgers rows as text, with the recompute and bf16 ratios against fp32."""
    lay = rows[0]["layout"]
    lines = [f"  Burgers example, {steps} steps, dp={lay['dp']} cp={lay['cp']} tp={lay['tp']} "
             f"({lay['mode']}); MiB per rank measured/formula"]
    for row in rows:
        got, want = row["measured"], row["formula"]
        cells = ", ".join(f"{k} {got[k] / 2**20:.3f}/{want[k] / 2**20:.3f}" for k in want)
        lines.append(f"    {row['config']:12} val {row['val_rel_l2']:.3e}  step "
                     f"{row['step_ms']:7.2f} ms  {cells}, activations "
                     f"{got['activations'] / 2**20:.3f}, peak RSS {got['peak_rss'] / 2**20:.0f}")
    by = {row["config"]: row for row in rows}
    base = by["fp32"]
    rec = by["recompute"]
    lower = base["measured"]["activations"] / rec["measured"]["activations"]
    lines.append(f"    recompute: peak activations {lower:.2f}x lower, step time "
                 f"{rec['step_ms'] / base['step_ms']:.2f}x")
    if "bf16" in by:
        ratio = by["bf16"]["val_rel_l2"] / base["val_rel_l2"]
        lines.append(f"    bf16 / fp32 validation error {ratio:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("512x1024"),
                        help="comma-separated HIDDENxTOKENS (tokens per rank)")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per shape")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch variants")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--burgers", type=int, default=0, metavar="STEPS",
                        help="also train examples/burgers.py STEPS steps per configuration")
    parser.add_argument("--burgers-flags", default="",
                        help="the example's layout/model flags, e.g. \"--cp 2\"")
    args = parser.parse_args(argv)
    comm = WORLD
    torch, reason = ((None, "--no-torch given") if args.no_torch
                     else common.import_torch_distributed())
    if torch is None:
        common.say(comm, f"bench_memory: skipping the torch variants: {reason}")
    info = common.machine_info(comm)
    group = Group(comm, "dp-world", range(comm.Get_size()), owns_comm=False)
    dist = common.init_torch_gloo(comm) if torch is not None else None
    try:
        rows = []
        for hidden, tokens in args.shapes:
            common.say(comm, f"bench_memory: H={hidden} T={tokens} on {comm.Get_size()} ranks ...")
            rows.append(run_shape(hidden, tokens, args.repeats, args.warmup, torch, group))
            if comm.Get_rank() == 0:
                print(format_row(rows[-1]), flush=True)
    finally:
        if dist is not None:
            dist.destroy_process_group()
    burgers = []
    if args.burgers > 0:
        common.say(comm, f"bench_memory: Burgers example, {args.burgers} steps per configuration")
        burgers = run_burgers(args.burgers, shlex.split(args.burgers_flags), comm)
        if comm.Get_rank() == 0:
            print(format_burgers(burgers, args.burgers), flush=True)
    if comm.Get_rank() == 0:
        common.write_json(args.json, {
            "benchmark": "memory", "machine": info, "repeats": args.repeats,
            "warmup": args.warmup, "torch_skipped": reason, "rows": rows,
            "burgers_steps": args.burgers, "burgers": burgers})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.exit(main())
