"""Learn the one-step map of the 1D viscous Burgers equation under DP x CP x TP.

A NumPy finite-difference solver makes the data: random smooth initial fields
on a periodic grid, advanced by RK4. A small transformer over the grid points
learns ``u(t) -> u(t + dt)``:

* context (sequence) parallelism splits the grid points over the CP group and
  runs context-parallel attention (:class:`pympar.modules.ContextAttention`):
  Ulysses by default, ``--attention ring``, or ``--attention hybrid`` (Ulysses
  inside groups of ``--ulysses-size`` context ranks, ring across them);
* tensor parallelism splits each MLP over the TP group (Column -> GELU -> Row),
  or over a 3D cube with ``--mode 3d`` (Linear3D -> GELU -> Linear3D);
* data parallelism splits every batch; gradients are summed over the
  data x context group with :func:`pympar.optim.allreduce_gradients`, or, with
  ``--zero``, reduce-scattered by :class:`pympar.zero.ZeroRedundancyOptimizer`,
  which keeps only this rank's share of the AdamW state.

Memory: ``--recompute`` wraps every transformer block in
:class:`pympar.modules.Recompute` (its activations are recomputed in backward);
``--precision bf16`` or ``fp16`` keeps parameters and compute in half precision
with float32 master weights in the optimizer (and a :class:`pympar.amp.GradScaler`
for fp16). At the end every rank's bytes of parameters, gradients, optimizer
state and peak cached activations (:mod:`pympar.memory`) and its peak resident
set size are printed and written into ``metrics.json``.

Run ``mpiexec -n 4 python -m mpi4py examples/burgers.py --tp 2 --cp 2`` (or with
no launcher, serially). Rank 0 prints the layout, the loss (a progress bar instead
when stdout is a terminal), the validation error against the solver and the
throughput, and writes ``loss.png`` and ``metrics.json`` into ``--out``.

With ``--checkpoint-dir DIR`` the run saves a checkpoint every
``--checkpoint-every`` steps and at the end (``DIR/step_00000100``, the last
three kept). Asked to stop early (SIGUSR1 or SIGTERM to any rank, or the stop
file ``$PYMPAR_STOP_FILE`` of :mod:`pympar.preemption`), it saves at the next
step boundary, finalizes MPI and exits 75, the status on which
``examples/slurm/requeue.sh`` requeues the job; a finished run exits 0.
``--resume`` continues from the newest complete checkpoint in DIR, under any
``--tp/--cp/--dp`` layout; keep ``--steps`` (the learning-rate schedule) and
the model flags as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from pympar import backend, checkpoint, manager
from pympar.amp import GradScaler, master_weights_optimizer
from pympar.launch import RankZeroParser, finalize_and_exit, launcher_hint, report_error
from pympar.memory import activation_bytes, memory_report
from pympar.modules import (GELU, ColumnParallelLinear, ContextAttention, LayerNorm, Linear,
                            Linear3D, Module, Recompute, RowParallelLinear, layout_3d)
from pympar.modules.context_attention import split_context_group
from pympar.optim import AdamW, allreduce_gradients
from pympar.partition import block_slice
from pympar.pmi import LauncherMismatchError, check_launcher
from pympar.preemption import REQUEUE_STATUS, Preemption
from pympar.zero import ZeroRedundancyOptimizer

#: How to run this example (said when it is started as one process without a launcher).
COMMAND = "examples/burgers.py ..."

# ---------------------------------------------------------------- the solver


def burgers_rhs(u: np.ndarray, dx: float, nu: float) -> np.ndarray:
    """``-d(u^2/2)/dx + nu d2u/dx2`` by central differences on a periodic grid (last axis)."""
    up, um = np.roll(u, -1, axis=-1), np.roll(u, 1, axis=-1)
    flux = (up * up - um * um) * (0.25 / dx)
    return nu / (dx * dx) * (up - 2.0 * u + um) - flux


def solve_burgers(u0: np.ndarray, dt: float, substeps: int, frames: int, nu: float) -> np.ndarray:
    """Advance fields ``u0`` (batch, grid) with RK4; return ``(frames + 1, batch, grid)``."""
    dx = 2.0 * np.pi / u0.shape[-1]
    h = dt / substeps
    out = np.empty((frames + 1, *u0.shape))
    out[0] = u = u0
    for frame in range(1, frames + 1):
        for _ in range(substeps):
            k1 = burgers_rhs(u, dx, nu)
            k2 = burgers_rhs(u + 0.5 * h * k1, dx, nu)
            k3 = burgers_rhs(u + 0.5 * h * k2, dx, nu)
            k4 = burgers_rhs(u + h * k3, dx, nu)
            u = u + (h / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
        out[frame] = u
    return out


def random_fields(rng: np.random.Generator, count: int, grid: int, modes: int = 4) -> np.ndarray:
    """Smooth periodic initial fields: a few random Fourier modes, peak |u| about 1."""
    x = np.linspace(0.0, 2.0 * np.pi, grid, endpoint=False)
    k = np.arange(1, modes + 1)
    amp = rng.standard_normal((count, modes, 2)) / k[None, :, None]
    u = (amp[..., 0, None] * np.sin(k[None, :, None] * x) +
         amp[..., 1, None] * np.cos(k[None, :, None] * x)).sum(axis=1)
    return u / np.abs(u).max(axis=1, keepdims=True)


def make_pairs(seed: int, trajectories: int, frames: int, grid: int, dt: float, nu: float):
    """``(u(t), u(t + dt))`` pairs from solver trajectories, each ``(pairs, grid)``."""
    rng = np.random.default_rng(seed)
    traj = solve_burgers(random_fields(rng, trajectories, grid), dt, 10, frames, nu)
    return traj[:-1].reshape(-1, grid), traj[1:].reshape(-1, grid)


# ---------------------------------------------------------------- the model


class MLP(Module):
    """Tensor-parallel MLP: Column -> GELU -> Row (one all-reduce each way)."""

    def __init__(self, hidden: int, ffn: int, dtype, seed: int) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn, gather_output=False, dtype=dtype, seed=seed)
        self.act = GELU()
        self.fc2 = RowParallelLinear(ffn, hidden, input_is_parallel=True, dtype=dtype, seed=seed + 1)

    def forward(self, x):
        return self.fc2.forward(self.act.forward(self.fc1.forward(x)))

    def backward(self, dy):
        return self.fc1.backward(self.act.backward(self.fc2.backward(dy)))


class MLP3D(Module):
    """3D tensor-parallel MLP on replicated activations: split, two Linear3D, gather."""

    def __init__(self, hidden: int, ffn: int, dtype, seed: int) -> None:
        super().__init__()
        self.layout = layout_3d()
        self.fc1 = Linear3D(hidden, ffn, dtype=dtype, seed=seed)
        self.act = GELU()
        self.fc2 = Linear3D(ffn, hidden, swap=True, dtype=dtype, seed=seed + 1)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        h = self.fc1.forward(self.layout.split_input(rows))
        y = self.fc2.layout.gather_output(self.fc2.forward(self.act.forward(h)))
        return y.reshape(x.shape)

    def backward(self, dy):
        rows = dy.reshape(-1, dy.shape[-1])
        dh = self.fc2.backward(self.fc2.layout.split_output(rows))
        dx = self.layout.gather_input(self.fc1.backward(self.act.backward(dh)))
        return dx.reshape(dy.shape)


class Block(Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``h + mlp(ln(h))``."""

    #: Called with no argument at the start of :meth:`backward`, when this block's caches are
    #: full (with ``--recompute`` right after their recomputation): the activation peak probe.
    on_backward = None

    def __init__(self, hidden: int, heads: int, mode: str, dtype, seed: int,
                 attention: str = "ulysses", groups=None) -> None:
        super().__init__()
        self.ln1 = LayerNorm(hidden, dtype=dtype)
        self.attn = ContextAttention(hidden, heads, scheme=attention, groups=groups, dtype=dtype,
                                     seed=seed)
        self.ln2 = LayerNorm(hidden, dtype=dtype)
        mlp = MLP3D if mode == "3d" else MLP
        self.mlp = mlp(hidden, 4 * hidden, dtype, seed + 2)

    def forward(self, x):
        h = x + self.attn.forward(self.ln1.forward(x))
        return h + self.mlp.forward(self.ln2.forward(h))

    def backward(self, dy):
        if self.on_backward is not None:
            self.on_backward()
        dh = dy + self.ln2.backward(self.mlp.backward(dy))
        return dh + self.ln1.backward(self.attn.backward(dh))


class BurgersTransformer(Module):
    """Tokens are grid points ``[grid_local, batch, features]``; predicts ``du`` per point.

    ``attention`` is the :class:`~pympar.modules.ContextAttention` scheme (``groups``: the
    Ulysses and ring groups of ``"hybrid"``); ``recompute`` wraps every block in
    :class:`~pympar.modules.Recompute`. The first layer computes no input gradient: the input
    is data.
    """

    def __init__(self, hidden: int, heads: int, layers: int, mode: str, dtype, seed: int = 0,
                 attention: str = "ulysses", groups=None, recompute: bool = False):
        super().__init__()
        self.embed = Linear(3, hidden, dtype=dtype, seed=seed, input_grad=False)
        blocks = [Block(hidden, heads, mode, dtype, seed + 10 * (i + 1), attention, groups)
                  for i in range(layers)]
        for i, block in enumerate(blocks):
            setattr(self, f"block{i}", block)
        self.norm = LayerNorm(hidden, dtype=dtype)
        self.head = Linear(hidden, 1, init_method="zeros", dtype=dtype, seed=seed + 1)
        # The wrappers come after the blocks, which keep their parameter names
        # (block0.ln1.weight, ...): a checkpoint loads with or without --recompute.
        self.blocks = [Recompute(block) for block in blocks] if recompute else blocks
        if recompute:
            for i, wrapper in enumerate(self.blocks):
                setattr(self, f"recompute{i}", wrapper)

    def watch(self, probe) -> None:
        """Call ``probe()`` at the start of every block's backward (None: stop)."""
        for module in self.modules():
            if isinstance(module, Block):
                module.on_backward = probe

    def forward(self, x):
        h = self.embed.forward(x)
        for block in self.blocks:
            h = block.forward(h)
        return self.head.forward(self.norm.forward(h))[..., 0]

    def backward(self, dy):
        dh = self.norm.backward(self.head.backward(dy[..., None]))
        for block in reversed(self.blocks):
            dh = block.backward(dh)
        return self.embed.backward(dh)  # None: input_grad=False


# ---------------------------------------------------------------- training


def tokens(u: np.ndarray, grid_slice: slice, dtype) -> np.ndarray:
    """Model input ``[grid_local, batch, (u, sin x, cos x)]`` for fields ``u`` (batch, grid)."""
    x = np.linspace(0.0, 2.0 * np.pi, u.shape[1], endpoint=False)[grid_slice]
    local = u[:, grid_slice].T
    out = np.empty((*local.shape, 3), dtype=dtype)
    out[..., 0] = local
    out[..., 1] = np.sin(x)[:, None]
    out[..., 2] = np.cos(x)[:, None]
    return out


def check_layout(args: argparse.Namespace, world: int) -> None:
    """Reject flags that cannot fit the world size or the model (ValueError, one line)."""
    if args.tp * args.cp * max(args.dp, 1) > world or world % (args.tp * args.cp):
        raise ValueError(f"--tp {args.tp} x --cp {args.cp} does not divide {world} ranks: "
                         f"{manager.rank_counts_that_fit(args.tp * args.cp, world)}"
                         + launcher_hint(COMMAND))
    if args.dp and args.dp * args.tp * args.cp != world:
        raise ValueError(f"--tp {args.tp} x --cp {args.cp} x --dp {args.dp} != {world} ranks"
                         + launcher_hint(COMMAND))
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.batch < world // (args.tp * args.cp):
        raise ValueError(f"--batch {args.batch} is smaller than the data-parallel size "
                         f"{world // (args.tp * args.cp)}")
    if args.grid < args.cp:
        raise ValueError(f"--grid {args.grid} has fewer points than --cp {args.cp} ranks")
    if args.mode == "3d" and round(args.tp ** (1 / 3)) ** 3 != args.tp:
        raise ValueError(f"--mode 3d needs a cube --tp (1, 8, 27, ...), got {args.tp}")
    if args.ulysses_size < 0:
        raise ValueError(f"--ulysses-size must be >= 1, got {args.ulysses_size}")
    if args.ulysses_size and args.attention != "hybrid":
        raise ValueError("--ulysses-size goes with --attention hybrid")
    if args.attention == "hybrid" and args.cp % ulysses_size(args):
        raise ValueError(f"--ulysses-size {args.ulysses_size} does not divide --cp {args.cp}")
    if args.precision != "fp32" and args.dtype != "float32":
        raise ValueError(f"--precision {args.precision} keeps float32 master weights: "
                         f"it does not go with --dtype {args.dtype}")
    if args.precision == "bf16" and backend.bfloat16 is None:
        raise ValueError("--precision bf16 needs the ml_dtypes package (pip install ml_dtypes)")


def ulysses_size(args: argparse.Namespace) -> int:
    """Context ranks per Ulysses group of ``--attention hybrid``: ``--ulysses-size``, or else
    the largest divisor ``u`` of ``--cp`` with ``u * u <= cp`` (2 at CP = 4 or 8)."""
    if args.ulysses_size:
        return args.ulysses_size
    return max(u for u in range(1, args.cp + 1) if args.cp % u == 0 and u * u <= args.cp)


def compute_dtype(args: argparse.Namespace) -> np.dtype:
    """The parameters' and activations' dtype: ``--dtype``, or half with ``--precision``."""
    return np.dtype({"fp32": args.dtype, "bf16": backend.bfloat16,
                     "fp16": np.float16}[args.precision])


def make_optimizer(args: argparse.Namespace, model: Module, reduce_group):
    """AdamW; sharded over ``reduce_group`` with ``--zero``; float32 masters in half precision."""
    kw = dict(lr=args.lr, weight_decay=0.0)
    if args.zero:
        return ZeroRedundancyOptimizer(model, AdamW, group=reduce_group, **kw)
    if args.precision != "fp32":
        return master_weights_optimizer(model, AdamW, **kw)
    return AdamW(model.parameters(), **kw)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def train(args: argparse.Namespace, comm: MPI.Intracomm = MPI.COMM_WORLD) -> dict:
    """Generate data, train, validate; return the metrics (the same dict on every rank)."""
    check_launcher(comm)  # the wrong srun --mpi plugin first: every layout would fail
    check_layout(args, comm.Get_size())
    state = manager.initialize_parallel(args.tp, args.cp, args.order, comm, args.mode)
    # From here on a stop signal only sets a flag (it would otherwise end the process).
    stop = Preemption(comm) if args.checkpoint_dir is not None else None
    groups = None
    try:
        if args.attention == "hybrid":  # one pair of groups for every block, freed at the end
            groups = split_context_group(state.context, ulysses_size(args))
        return _train(args, comm, state, stop, groups)
    finally:
        if stop is not None:
            stop.close()
        for group in groups or ():
            group.free()
        manager.destroy_parallel()


def _train(args, comm, state, stop, groups) -> dict:
    dtype = compute_dtype(args)
    rank = comm.Get_rank()
    dp, cp = state.data.size, state.context.size
    reduce_group = state.data_context
    grid_slice = block_slice(args.grid, cp, state.context.rank)
    u_train, v_train = make_pairs(args.seed, args.trajectories, args.frames, args.grid, args.dt, args.nu)
    u_val, v_val = make_pairs(args.seed + 1, max(args.trajectories // 4, 2), args.frames,
                              args.grid, args.dt, args.nu)
    scale = float(np.std(v_train - u_train))  # learn the increment in units of its spread
    count = args.batch * args.grid  # points in one global batch: the loss is their mean

    model = BurgersTransformer(args.hidden, args.heads, args.layers, args.mode, dtype, args.seed,
                               args.attention, groups, args.recompute)
    optimizer = make_optimizer(args, model, reduce_group)
    scaler = GradScaler() if args.precision == "fp16" else None
    # ZeRO averages the gradients over the group: scale the loss gradient up to keep the sum.
    grad_factor = dtype.type(2.0 * (reduce_group.size if args.zero else 1) / count)
    shuffle = np.random.default_rng(args.seed + 2)
    losses, show = [], rank == 0 and not args.quiet
    start_step, saved_step = 0, None
    if args.resume:
        found = comm.bcast(checkpoint.latest(args.checkpoint_dir) if rank == 0 else None)
        if found is not None:
            start_step, extra = checkpoint.load(found, model, optimizer, comm=comm)
            shuffle.bit_generator.state = extra["rng"]
            if scaler is not None and "scaler" in extra:
                scaler.load_state_dict(extra["scaler"])
            losses, saved_step = list(extra["losses"]), start_step
            if show:
                print(f"resumed from {found} (step {start_step})")
        elif show:
            print(f"no complete checkpoint in {args.checkpoint_dir}: starting afresh")

    def save(step: int) -> None:
        path = os.path.join(args.checkpoint_dir, f"step_{step:08d}")
        began = time.perf_counter()
        checkpoint.save(path, model, optimizer, step=step, keep=3, comm=comm,
                        extra={"rng": shuffle.bit_generator.state, "losses": losses,
                               **({"scaler": scaler.state_dict()} if scaler else {})})
        if show:  # the save time tells how much lead time a stop signal needs
            print(f"saved {path} in {time.perf_counter() - began:.2f} s", flush=True)

    bar = None
    if show:
        print(f"layout  {state.mesh!r}  mode {state.tensor_parallel_mode}  "
              f"dp={dp} cp={cp} tp={state.tensor.size}")
        print(f"groups  {state.tensor.name}  {state.context.name}  {state.data.name}")
        print(f"data    {len(u_train)} training pairs, {len(u_val)} validation pairs, "
              f"grid {args.grid}, nu {args.nu}, dt {args.dt}")
        if sys.stdout.isatty():  # no carriage-return updates in batch logs
            try:
                from tqdm import tqdm
                bar = tqdm(total=args.steps, initial=start_step, desc="train", unit="step",
                           file=sys.stdout, mininterval=1.0)
            except ImportError:
                pass
    peak = [0]

    def probe() -> None:
        peak[0] = max(peak[0], activation_bytes(model))

    step_seconds: list[float] = []
    preempted = None
    comm.Barrier()
    start = time.perf_counter()
    try:
        for step in range(start_step, args.steps):
            # Before the step: the first check also sees a stop asked for before the start.
            if stop is not None and stop.should_stop():
                preempted = step
                break
            # cosine decay to a tenth of the initial rate
            optimizer.lr = args.lr * (0.55 + 0.45 * np.cos(np.pi * step / args.steps))
            batch = shuffle.choice(len(u_train), args.batch, replace=False)
            mine = batch[block_slice(args.batch, dp, state.data.rank)]
            x = tokens(u_train[mine], grid_slice, dtype)
            target = ((v_train[mine] - u_train[mine])[:, grid_slice].T / scale).astype(dtype)
            began = time.perf_counter()
            model.zero_grad()
            err = model.forward(x) - target
            if step == start_step:
                probe()  # the activations cached after the forward
            flat = err.ravel() if err.dtype.itemsize >= 4 else err.ravel().astype(np.float32)
            local = np.array([np.dot(flat, flat)], dtype=np.float64)
            loss = float(reduce_group.all_reduce(local)[0]) / count
            err *= grad_factor  # the loss gradient, in place
            model.watch(probe if step == start_step else None)
            if scaler is None:
                model.backward(err)
            else:  # an overflow is expected now and then: the scaler skips that step
                with np.errstate(over="ignore", invalid="ignore"):
                    model.backward(scaler.scale(err))
            if not args.zero:
                allreduce_gradients(model, reduce_group, average=False)
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)  # skipped on every rank when any gradient overflowed
                scaler.update()
            losses.append(loss)
            step_seconds.append(time.perf_counter() - began)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
                bar.update()
            elif show and (step % max(args.steps // 10, 1) == 0 or step == args.steps - 1):
                print(f"step {step:5d}  loss {loss:.5g}", flush=True)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                save(step + 1)
                saved_step = step + 1
    finally:
        if bar is not None:
            bar.close()
    done = args.steps if preempted is None else preempted
    if args.checkpoint_dir is not None and saved_step != done:
        save(done)
    comm.Barrier()
    seconds = time.perf_counter() - start
    if preempted is not None:
        if show:
            print(f"asked to stop: step {preempted} saved in {args.checkpoint_dir}; exiting "
                  f"with status {REQUEUE_STATUS} (requeue me)", flush=True)
        return {"preempted_at": preempted, "losses": losses, "steps": args.steps}

    # Validation: one-step prediction against the solver, and doing nothing as a baseline.
    sums = np.zeros(3)
    for part in np.array_split(np.arange(len(u_val)), max(len(u_val) // args.batch, 1)):
        mine = part[block_slice(len(part), dp, state.data.rank)]
        du = model.forward(tokens(u_val[mine], grid_slice, dtype)).T.astype(np.float64) * scale
        truth = v_val[mine][:, grid_slice]
        now = u_val[mine][:, grid_slice]
        sums += [((now + du - truth) ** 2).sum(), ((now - truth) ** 2).sum(), (truth ** 2).sum()]
    sums = reduce_group.all_reduce(sums)
    metrics = {
        "layout": {"dp": dp, "cp": cp, "tp": state.tensor.size, "mode": state.tensor_parallel_mode,
                   "order": args.order, "ranks": comm.Get_size()},
        "steps": args.steps, "dtype": dtype.name,
        "final_loss": losses[-1], "initial_loss": losses[0], "losses": losses,
        "val_rel_l2": float(np.sqrt(sums[0] / sums[2])),
        "val_rel_l2_of_change": float(np.sqrt(sums[0] / sums[1])),
        "persistence_rel_l2": float(np.sqrt(sums[1] / sums[2])),
        "seconds": seconds,
        "samples_per_second": (args.steps - start_step) * args.batch / max(seconds, 1e-9),
        "median_step_seconds": float(np.median(step_seconds)) if step_seconds else None,
        "flags": {"attention": args.attention, "zero": args.zero, "recompute": args.recompute,
                  "precision": args.precision},
        "memory": memory_per_rank(model, optimizer, peak[0], comm),
    }
    if show:
        print(f"validation  one-step relative L2 error {metrics['val_rel_l2']:.3e} "
              f"(persistence baseline {metrics['persistence_rel_l2']:.3e}; "
              f"{metrics['val_rel_l2_of_change']:.3f} of the true change)")
        print(f"throughput  {metrics['samples_per_second']:.1f} samples/s "
              f"({seconds:.1f} s for {args.steps - start_step} steps on {comm.Get_size()} ranks)")
        print_memory(metrics["memory"])
    return metrics


def memory_per_rank(model: Module, optimizer, peak_activations: int, comm) -> list[dict]:
    """Every rank's bytes by kind (:func:`pympar.memory.memory_report`, the activations being
    the peak cached during a training step) and peak RSS, gathered on every rank."""
    report = memory_report(model, optimizer)
    report["activations"] = peak_activations
    report["total"] = sum(report[k] for k in ("parameters", "gradients", "optimizer",
                                               "workspace", "activations"))
    report["peak_rss"] = peak_rss_bytes()
    return comm.allgather(report)


def print_memory(reports: list[dict]) -> None:
    """One line per rank, in KiB (RSS in MiB)."""
    kinds = ("parameters", "gradients", "optimizer", "workspace", "activations")
    print("memory  per rank, KiB: " + " ".join(f"{k:>11}" for k in kinds) + "   peak RSS")
    for rank, report in enumerate(reports):
        cells = " ".join(f"{report[k] / 1024:11.1f}" for k in kinds)
        print(f"        rank {rank:3d}:      {cells}   {report['peak_rss'] / 2**20:.0f} MiB")


def write_outputs(metrics: dict, out: Path) -> None:
    """Write ``metrics.json`` and, where matplotlib exists, ``loss.png``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.semilogy(metrics["losses"], lw=1.2)
    lay = metrics["layout"]
    ax.set(xlabel="step", ylabel="training loss (MSE of scaled du)",
           title=f"Burgers one-step map, dp={lay['dp']} cp={lay['cp']} tp={lay['tp']} ({lay['mode']})")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png")
    plt.close(fig)
    print(f"wrote {out / 'loss.png'} and {out / 'metrics.json'}")


def parse_args(argv=None) -> argparse.Namespace:
    """The example's flags."""
    p = RankZeroParser(description=__doc__.split("\n\n")[0], command=COMMAND)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (a cube in 3d mode)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (splits grid points)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: the rest)")
    p.add_argument("--mode", choices=["1d", "3d"], default="1d", help="tensor-parallel mode")
    p.add_argument("--attention", choices=["ulysses", "ring", "hybrid"], default="ulysses",
                   help="context-parallel attention scheme")
    p.add_argument("--ulysses-size", type=int, default=0,
                   help="hybrid: context ranks per Ulysses group (must divide --cp; default: "
                   "the largest divisor u of --cp with u*u <= cp)")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state over the data x context group (ZeRO-1)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute every transformer block's activations in backward")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="parameters and compute in half precision with float32 masters "
                   "(fp16 adds a loss scaler); fp32 means --dtype")
    p.add_argument("--order", default="tp-cp-dp", help="mesh order, innermost first")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16, help="global batch (fields per step)")
    p.add_argument("--grid", type=int, default=64, help="grid points = sequence length")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--trajectories", type=int, default=48)
    p.add_argument("--frames", type=int, default=20, help="solver frames per trajectory")
    p.add_argument("--dt", type=float, default=0.05, help="time step of the learned map")
    p.add_argument("--nu", type=float, default=0.1, help="viscosity")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/burgers"))
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here (and when asked to stop: SIGUSR1, SIGTERM or "
                   "$PYMPAR_STOP_FILE; then exit 75)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every N steps (0: only at the end or on a signal)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the example; returns the exit status (2 for flags that do not fit, 75 when it
    stopped early and saved: :data:`pympar.preemption.REQUEUE_STATUS`)."""
    comm = MPI.COMM_WORLD
    args = parse_args(argv)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(int(os.environ.get("PYMPAR_BLAS_THREADS", "1")))
    except ImportError:
        pass
    try:
        metrics = train(args, comm)
    except (ValueError, LauncherMismatchError) as err:
        return report_error("burgers.py", str(err))
    if "preempted_at" in metrics:
        return REQUEUE_STATUS
    if comm.Get_rank() == 0:
        write_outputs(metrics, args.out)
    return 0


if __name__ == "__main__":
    finalize_and_exit(main())  # MPI finalized first: the status (75: requeue me) reaches srun
