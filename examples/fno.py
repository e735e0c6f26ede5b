"""Train a distributed Fourier neural operator on 2-D Navier-Stokes vorticity (DP x spatial).

A NumPy pseudo-spectral solver makes the data: random smooth vorticity fields on the periodic
unit square, advanced under FNO's benchmark forcing ``0.1 (sin 2pi(x+y) + cos 2pi(x+y))`` and
viscosity ``--nu`` (semi-implicit: viscosity exact, advection explicit, 2/3 de-aliasing).
An FNO learns the map ``w(t) -> w(t + T)``:

* the grid's first axis is split over the **spatial** group (``--spatial`` ranks): every
  :class:`~pympar.modules.fno.SpectralBlock` transforms its rows, keeps the kept modes,
  and exchanges only those (one all-to-all each way); the spectral weights are split by
  mode over the spatial group, the lifting, pointwise and projection layers replicated;
* **data** parallelism (the remaining ranks) splits every batch;
* gradients: the replicated parameters' are summed over data x spatial, the mode-split
  spectral weights' over data only (:func:`pympar.modules.fno.split_parameters`).

Run ``mpiexec -n 4 python -m mpi4py examples/fno.py --spatial 2`` (or serially). Rank 0
prints the layout, the loss, the validation error against the solver and the throughput,
and writes ``loss.png`` and ``metrics.json`` into ``--out``.

With ``--checkpoint-dir DIR`` the run saves a checkpoint every ``--checkpoint-every`` steps
and at the end (the last three kept), and on SIGUSR1 or SIGTERM saves at the next step
boundary and exits 0; ``--resume`` continues from the newest complete checkpoint in DIR,
under any ``--spatial``/``--dp`` layout (the checkpoint holds the serial weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from pympar import checkpoint, manager
from pympar.launch import RankZeroParser, launcher_hint, report_error
from pympar.mesh import Mesh
from pympar.modules import GELU, Linear, Module
from pympar.modules.fno import SpectralBlock, split_parameters
from pympar.optim import AdamW, allreduce_gradients
from pympar.partition import block_slice
from pympar.preemption import Preemption

#: How to run this example (said when it is started as one process without a launcher).
COMMAND = "examples/fno.py ..."

# ---------------------------------------------------------------- the solver


def wavenumbers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kx, ky)`` of an ``n x n`` grid on the unit square, for ``rfft2`` over the last two
    axes (``ky`` the half axis), in radians per unit length."""
    k = 2.0 * np.pi * np.fft.fftfreq(n, 1.0 / n)
    return k[:, None], (2.0 * np.pi * np.arange(n // 2 + 1))[None, :]


def solve_vorticity(w0: np.ndarray, t: float, steps: int, nu: float) -> np.ndarray:
    """Advance vorticity fields ``w0`` (batch, n, n) by time ``t`` in ``steps`` steps."""
    n = w0.shape[-1]
    kx, ky = wavenumbers(n)
    k2 = kx * kx + ky * ky
    inv_k2 = np.where(k2 > 0, 1.0 / np.where(k2 > 0, k2, 1.0), 0.0)
    keep = (np.abs(kx) < (2.0 / 3.0) * np.pi * n) & (ky < (2.0 / 3.0) * np.pi * n)
    x = np.arange(n) / n
    forcing = 0.1 * (np.sin(2 * np.pi * (x[:, None] + x[None, :]))
                     + np.cos(2 * np.pi * (x[:, None] + x[None, :])))
    f_hat = np.fft.rfft2(forcing)
    dt = t / steps
    decay = 1.0 / (1.0 + dt * nu * k2)
    w_hat = np.fft.rfft2(w0)
    for _ in range(steps):
        psi = w_hat * inv_k2  # -lap psi = w
        u = np.fft.irfft2(1j * ky * psi, s=(n, n))
        v = np.fft.irfft2(-1j * kx * psi, s=(n, n))
        wx = np.fft.irfft2(1j * kx * w_hat, s=(n, n))
        wy = np.fft.irfft2(1j * ky * w_hat, s=(n, n))
        advection = np.fft.rfft2(u * wx + v * wy) * keep
        w_hat = (w_hat + dt * (f_hat - advection)) * decay
    return np.fft.irfft2(w_hat, s=(n, n))


def random_vorticity(rng: np.random.Generator, count: int, n: int) -> np.ndarray:
    """Smooth random fields: Gaussian with spectrum ``(|k|^2 + 49)^-2.5`` (FNO's), unit RMS."""
    kx, ky = wavenumbers(n)
    amplitude = ((kx * kx + ky * ky) / (4 * np.pi ** 2) + 49.0) ** -1.25
    amplitude[0, 0] = 0.0
    noise = rng.standard_normal((count, n, n // 2 + 1)) + 1j * rng.standard_normal(
        (count, n, n // 2 + 1))
    w = np.fft.irfft2(noise * amplitude, s=(n, n))
    return w / w.std(axis=(1, 2), keepdims=True)


def make_pairs(seed: int, count: int, n: int, t: float, steps: int, nu: float):
    """``(w(0), w(t))`` pairs, each ``(count, n, n)``."""
    w0 = random_vorticity(np.random.default_rng(seed), count, n)
    return w0, solve_vorticity(w0, t, steps, nu)


# ---------------------------------------------------------------- the model


class FNO2d(Module):
    """Lift ``(w, x, y) -> width``, ``layers`` spectral blocks (the last without GELU),
    project ``width -> 4 width -> 1``. Input ``(batch, x1 block, n, 3)``."""

    def __init__(self, width: int, modes: int, layers: int, group, dtype, seed: int = 0):
        super().__init__()
        self.lift = Linear(3, width, dtype=dtype, seed=seed, input_grad=False)
        self.blocks = [SpectralBlock(width, modes, group, activation=i < layers - 1,
                                     dtype=dtype, seed=seed + 10 * (i + 1))
                       for i in range(layers)]
        for i, block in enumerate(self.blocks):
            setattr(self, f"block{i}", block)
        self.proj1 = Linear(width, 4 * width, dtype=dtype, seed=seed + 1)
        self.act = GELU()
        self.proj2 = Linear(4 * width, 1, init_method="zeros", dtype=dtype, seed=seed + 2)

    def forward(self, x):
        h = self.lift.forward(x)
        for block in self.blocks:
            h = block.forward(h)
        return self.proj2.forward(self.act.forward(self.proj1.forward(h)))[..., 0]

    def backward(self, dy):
        dh = self.proj1.backward(self.act.backward(self.proj2.backward(dy[..., None])))
        for block in reversed(self.blocks):
            dh = block.backward(dh)
        return self.lift.backward(dh)  # None: input_grad=False


# ---------------------------------------------------------------- training


def inputs(w: np.ndarray, rows: slice, dtype) -> np.ndarray:
    """Model input ``(batch, rows, n, (w, x, y))`` for fields ``w`` (batch, n, n)."""
    n = w.shape[-1]
    grid = np.arange(n) / n
    out = np.empty((w.shape[0], rows.stop - rows.start, n, 3), dtype=dtype)
    out[..., 0] = w[:, rows]
    out[..., 1] = grid[rows, None]
    out[..., 2] = grid[None, :]
    return out


def check_layout(args: argparse.Namespace, world: int) -> None:
    """Reject flags that cannot fit the world size or the model (ValueError, one line)."""
    if args.spatial < 1 or world % args.spatial:
        raise ValueError(f"--spatial {args.spatial} does not divide {world} ranks"
                         + (f": {manager.rank_counts_that_fit(args.spatial, world)}"
                            if args.spatial >= 1 else "") + launcher_hint(COMMAND))
    if args.dp and args.dp * args.spatial != world:
        raise ValueError(f"--spatial {args.spatial} x --dp {args.dp} != {world} ranks"
                         + launcher_hint(COMMAND))
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
    if args.batch < world // args.spatial:
        raise ValueError(f"--batch {args.batch} is smaller than the data-parallel size "
                         f"{world // args.spatial}")
    if args.grid < args.spatial:
        raise ValueError(f"--grid {args.grid} has fewer rows than --spatial {args.spatial}")
    if 2 * args.modes > args.grid:
        raise ValueError(f"--modes {args.modes} needs a grid of at least {2 * args.modes}")


def train(args: argparse.Namespace, comm: MPI.Intracomm = MPI.COMM_WORLD) -> dict:
    """Generate data, train, validate; return the metrics (the same dict on every rank)."""
    check_layout(args, comm.Get_size())
    mesh = Mesh(comm, {"x": args.spatial, "dp": comm.Get_size() // args.spatial})
    spatial, data, both = mesh.group("x"), mesh.group("dp"), mesh.group("x", "dp")
    stop = Preemption(comm) if args.checkpoint_dir is not None else None
    try:
        return _train(args, comm, spatial, data, both, stop)
    finally:
        if stop is not None:
            stop.close()
        for group in (spatial, data, both):
            group.free()


def _train(args, comm, spatial, data, both, stop) -> dict:
    dtype = np.dtype(args.dtype)
    rank = comm.Get_rank()
    rows = block_slice(args.grid, spatial.size, spatial.rank)
    w_train, v_train = make_pairs(args.seed, args.samples, args.grid, args.T, args.solver_steps,
                                  args.nu)
    w_val, v_val = make_pairs(args.seed + 1, max(args.samples // 4, 2), args.grid, args.T,
                              args.solver_steps, args.nu)
    scale = float(np.std(v_train - w_train))  # learn the change in units of its spread
    count = args.batch * args.grid * args.grid  # points in one global batch

    model = FNO2d(args.width, args.modes, args.layers, spatial, dtype, args.seed)
    replicated, split = split_parameters(model)
    optimizer = AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    shuffle = np.random.default_rng(args.seed + 2)
    losses, show = [], rank == 0 and not args.quiet
    start_step, saved_step = 0, None
    if args.resume:
        found = comm.bcast(checkpoint.latest(args.checkpoint_dir) if rank == 0 else None)
        if found is not None:
            start_step, extra = checkpoint.load(found, model, optimizer, comm=comm)
            shuffle.bit_generator.state = extra["rng"]
            losses, saved_step = list(extra["losses"]), start_step
            if show:
                print(f"resumed from {found} (step {start_step})")
        elif show:
            print(f"no complete checkpoint in {args.checkpoint_dir}: starting afresh")

    def save(step: int) -> None:
        path = os.path.join(args.checkpoint_dir, f"step_{step:08d}")
        checkpoint.save(path, model, optimizer, step=step, keep=3, comm=comm,
                        extra={"rng": shuffle.bit_generator.state, "losses": losses})
        if show:
            print(f"saved {path}", flush=True)

    if show:
        print(f"layout  spatial={spatial.size} dp={data.size}  groups {spatial.name} "
              f"{data.name}")
        print(f"data    {len(w_train)} training pairs, {len(w_val)} validation pairs, grid "
              f"{args.grid}x{args.grid}, nu {args.nu}, T {args.T}")
    step_seconds: list[float] = []
    preempted = None
    comm.Barrier()
    start = time.perf_counter()
    for step in range(start_step, args.steps):
        optimizer.lr = args.lr * (0.55 + 0.45 * np.cos(np.pi * step / args.steps))
        batch = shuffle.choice(len(w_train), args.batch, replace=False)
        mine = batch[block_slice(args.batch, data.size, data.rank)]
        x = inputs(w_train[mine], rows, dtype)
        target = ((v_train[mine] - w_train[mine])[:, rows] / scale).astype(dtype)
        began = time.perf_counter()
        model.zero_grad()
        err = model.forward(x) - target
        local = np.array([np.dot(err.ravel(), err.ravel())], dtype=np.float64)
        loss = float(both.all_reduce(local)[0]) / count
        err *= dtype.type(2.0 / count)
        model.backward(err)
        allreduce_gradients(replicated, both, average=False)  # partial sums over points, batch
        allreduce_gradients(split, data, average=False)  # complete over points already
        optimizer.step()
        losses.append(loss)
        step_seconds.append(time.perf_counter() - began)
        if show and (step % max(args.steps // 10, 1) == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {loss:.5g}", flush=True)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
            saved_step = step + 1
        if stop is not None and stop.should_stop():
            preempted = step + 1
            break
    done = preempted or args.steps
    if args.checkpoint_dir is not None and saved_step != done:
        save(done)
    comm.Barrier()
    seconds = time.perf_counter() - start
    if preempted is not None:
        if show:
            print(f"stopped by a signal: saved step {preempted} in {args.checkpoint_dir}",
                  flush=True)
        if stop.requeue() and show:
            print("asked Slurm to requeue the job")
        return {"preempted_at": preempted, "losses": losses, "steps": args.steps}

    # Validation: the predicted w(T) against the solver's, and doing nothing as a baseline.
    sums = np.zeros(3)
    for part in np.array_split(np.arange(len(w_val)), max(len(w_val) // args.batch, 1)):
        mine = part[block_slice(len(part), data.size, data.rank)]
        dw = model.forward(inputs(w_val[mine], rows, dtype)).astype(np.float64) * scale
        truth, now = v_val[mine][:, rows], w_val[mine][:, rows]
        sums += [((now + dw - truth) ** 2).sum(), ((now - truth) ** 2).sum(),
                 (truth ** 2).sum()]
    sums = both.all_reduce(sums)
    metrics = {
        "layout": {"spatial": spatial.size, "dp": data.size, "ranks": comm.Get_size()},
        "steps": args.steps, "dtype": dtype.name, "losses": losses,
        "initial_loss": losses[0], "final_loss": losses[-1],
        "val_rel_l2": float(np.sqrt(sums[0] / sums[2])),
        "persistence_rel_l2": float(np.sqrt(sums[1] / sums[2])),
        "seconds": seconds,
        "median_step_seconds": float(np.median(step_seconds)) if step_seconds else None,
    }
    if show:
        print(f"validation  relative L2 error {metrics['val_rel_l2']:.3e} (persistence "
              f"baseline {metrics['persistence_rel_l2']:.3e})")
        print(f"throughput  {seconds:.1f} s for {args.steps - start_step} steps on "
              f"{comm.Get_size()} ranks")
    return metrics


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
    ax.set(xlabel="step", ylabel="training loss (MSE of scaled change)",
           title=f"FNO, 2-D Navier-Stokes, spatial={lay['spatial']} dp={lay['dp']}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png")
    plt.close(fig)
    print(f"wrote {out / 'loss.png'} and {out / 'metrics.json'}")


def parse_args(argv=None) -> argparse.Namespace:
    """The example's flags."""
    p = RankZeroParser(description=__doc__.split("\n\n")[0], command=COMMAND)
    p.add_argument("--spatial", type=int, default=1, help="ranks that split the grid's rows")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: the rest)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="global batch (fields per step)")
    p.add_argument("--grid", type=int, default=32, help="grid points per axis")
    p.add_argument("--width", type=int, default=16, help="channels of the spectral blocks")
    p.add_argument("--modes", type=int, default=8, help="Fourier modes kept per axis")
    p.add_argument("--layers", type=int, default=3, help="spectral blocks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--samples", type=int, default=64, help="training pairs")
    p.add_argument("--T", type=float, default=1.0, help="time of the learned map")
    p.add_argument("--solver-steps", type=int, default=100, help="solver steps per pair")
    p.add_argument("--nu", type=float, default=1e-3, help="viscosity")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/fno"))
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here (and on SIGUSR1/SIGTERM, then exit 0)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every N steps (0: only at the end or on a signal)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the example; returns the exit status (2 for flags that do not fit)."""
    comm = MPI.COMM_WORLD
    args = parse_args(argv)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(int(os.environ.get("PYMPAR_BLAS_THREADS", "1")))
    except ImportError:
        pass
    try:
        metrics = train(args, comm)
    except ValueError as err:
        return report_error("fno.py", str(err))
    if comm.Get_rank() == 0 and "preempted_at" not in metrics:
        write_outputs(metrics, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
