"""The 2-D heat equation on a grid split over any number of ranks, checked with NumPy.

    mpiexec -n 4 python -m mpi4py examples/heat.py                    # 2 x 2 blocks
    mpiexec -n 3 python -m mpi4py examples/heat.py --method spectral  # 3 row slabs

Solves ``u_t = nu (u_xx + u_yy)`` on the unit square, ``--grid NX NY`` cells, with the
5-point Laplacian, from a warm spot and a hot bar:

* ``--method explicit`` (the default): forward Euler. The grid is cut into blocks over
  a ``px x py`` grid of ranks (``MPI.Compute_dims``: any rank count; the balanced rule
  of :mod:`pympar.partition` gives uneven blocks where the extents do not divide), and
  every rank refreshes a halo of one cell (:class:`pympar.halo.HaloExchange`) before
  each step.
  Walls along x (the field is 0 beyond the first and the last row: Dirichlet), periodic
  along y. Stable only for ``dt <= h**2 / (2 nu (1 + (h_x/h_y)**2))``.
* ``--method spectral``: backward Euler, periodic along both axes. Each step solves
  ``(1 - dt nu L) u_new = u`` in Fourier space, ``L`` the same 5-point Laplacian (its
  symbol ``-(2/h_x sin(pi k_x / NX))**2 - ...``), with the distributed FFT of
  :mod:`pympar.fft` on row slabs; stable for any ``--dt``.

At the end rank 0 gathers the field, runs the same scheme on the whole grid with NumPy
alone, prints the largest difference and exits 1 when it exceeds ``--tolerance`` (times
the largest initial value); it writes ``heat.png`` into ``--out`` where matplotlib is
installed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from pympar import fft
from pympar.decomposition import Decomposition
from pympar.halo import HaloExchange
from pympar.launch import RankZeroParser, finalize_and_exit, launcher_hint, report_error
from pympar.mesh import Mesh

#: How to run this example (said when it is started as one process without a launcher).
COMMAND = "examples/heat.py"

# ---------------------------------------------------------------- the problem


def initial_field(rows: slice, cols: slice, shape: tuple[int, int]) -> np.ndarray:
    """The initial temperature on cells ``[rows, cols]`` of a grid of ``shape`` cells.

    Every rank computes its own block; the serial run computes the whole grid.
    """
    x = (np.arange(rows.start, rows.stop) + 0.5)[:, None] / shape[0]
    y = (np.arange(cols.start, cols.stop) + 0.5)[None, :] / shape[1]
    spot = np.exp(-((x - 0.3) ** 2 + (y - 0.35) ** 2) / 0.005)
    bar = 0.6 * ((np.abs(x - 0.65) < 0.06) & (np.abs(y - 0.6) < 0.25))
    return spot + bar


def default_dt(args: argparse.Namespace) -> float:
    """0.9 of the explicit scheme's stability limit."""
    return 0.9 * stability_limit(args)


def stability_limit(args: argparse.Namespace) -> float:
    """The largest stable ``dt`` of forward Euler with the 5-point Laplacian."""
    nx, ny = args.grid
    return 1.0 / (2.0 * args.nu * (nx ** 2 + ny ** 2))


# ---------------------------------------------------------------- explicit, with halos


def euler_step(padded: np.ndarray, rx: float, ry: float) -> None:
    """One forward Euler step of the cells inside ``padded``'s one-cell ghost frame.

    ``rx = nu dt / h_x**2`` and ``ry = nu dt / h_y**2``. The right-hand side is
    evaluated in full before ``+=`` writes, so every cell is updated from the previous
    step's values.
    """
    c = padded[1:-1, 1:-1]
    c += (rx * (padded[:-2, 1:-1] - 2 * c + padded[2:, 1:-1])
          + ry * (padded[1:-1, :-2] - 2 * c + padded[1:-1, 2:]))


def explicit(args: argparse.Namespace, comm: MPI.Intracomm) -> tuple:
    """Forward Euler on this rank's block; returns ``(block, where it sits)``."""
    nx, ny = args.grid
    px, py = MPI.Compute_dims(comm.Get_size(), 2)   # e.g. 3 ranks: 3 x 1
    mesh = Mesh(comm, {"x": px, "y": py})
    groups = {0: mesh.group("x"), 1: mesh.group("y")}   # axis 0 over x, axis 1 over y
    d = Decomposition((nx, ny), groups, periodic=(False, True))   # walls along x
    halo = HaloExchange(d, 1)                       # one ghost cell a side
    u = halo.empty()                                # zeros: the walls' ghosts stay 0
    halo.inner(u)[...] = initial_field(*d.blocks, (nx, ny))
    rx, ry = args.nu * args.dt * nx ** 2, args.nu * args.dt * ny ** 2
    for _ in range(args.steps):
        halo.exchange(u)                            # neighbours' edge cells to ghosts
        euler_step(u, rx, ry)
    block = halo.inner(u).copy()
    halo.free()                                     # its MPI datatypes
    for group in groups.values():
        group.free()                                # the groups' communicators
    return block, d.blocks


def serial_explicit(args: argparse.Namespace) -> np.ndarray:
    """The explicit scheme on the whole grid with NumPy alone."""
    nx, ny = args.grid
    u = np.zeros((nx + 2, ny + 2))
    u[1:-1, 1:-1] = initial_field(slice(0, nx), slice(0, ny), (nx, ny))
    rx, ry = args.nu * args.dt * nx ** 2, args.nu * args.dt * ny ** 2
    for _ in range(args.steps):
        u[:, 0], u[:, -1] = u[:, -2], u[:, 1]    # periodic along y; rows 0, -1: walls
        euler_step(u, rx, ry)
    return u[1:-1, 1:-1].copy()


# ---------------------------------------------------------------- spectral, with FFTs


def symbol(k: np.ndarray, n: int) -> np.ndarray:
    """The eigenvalues of the periodic second difference ``(u[i-1] - 2u[i] + u[i+1])
    / h**2`` (``h = 1/n``) on the Fourier modes ``k``."""
    return -(2.0 * n * np.sin(np.pi * k / n)) ** 2


def implicit_factor(args: argparse.Namespace, kx: np.ndarray,
                    ky: np.ndarray) -> np.ndarray:
    """``1 / (1 - dt nu L)`` on the modes ``kx`` (column) by ``ky`` (row)."""
    nx, ny = args.grid
    laplacian = symbol(kx[:, None], nx) + symbol(ky[None, :], ny)
    return 1.0 / (1.0 - args.dt * args.nu * laplacian)


def spectral(args: argparse.Namespace, comm: MPI.Intracomm) -> tuple:
    """Backward Euler in Fourier space on this rank's row slab; returns ``(block, where
    it sits)``."""
    shape = tuple(args.grid)
    ranks, modes = comm.Get_size(), shape[1] // 2 + 1
    if min(shape[0], modes) < ranks:  # every rank holds a slab of each, here
        raise ValueError(f"--method spectral splits the {shape[0]} rows, then the "
                         f"{modes} columns of modes, over the ranks: {ranks} ranks "
                         f"need at least as many of each")
    rows = Mesh(comm, {"x": ranks}).group("x")
    field = fft.physical_placement(shape, rows)            # axis 0 split
    (where, _), = field.pieces()
    u = initial_field(*where, shape)
    modes = fft.spectral_placement(shape, rows, real=True)  # axis 1 split
    (kx, ky), _ = modes.pieces()[0]
    factor = implicit_factor(args, np.arange(kx.start, kx.stop),
                             np.arange(ky.start, ky.stop))
    for _ in range(args.steps):
        spectrum = fft.rfftn(u, rows, s=shape)   # this rank's columns of modes
        spectrum *= factor
        u = fft.irfftn(spectrum, rows, s=shape)  # back to this rank's rows
    rows.free()
    return u, where


def serial_spectral(args: argparse.Namespace) -> np.ndarray:
    """The spectral scheme on the whole grid with NumPy alone."""
    nx, ny = args.grid
    u = initial_field(slice(0, nx), slice(0, ny), (nx, ny))
    factor = implicit_factor(args, np.arange(nx), np.arange(ny // 2 + 1))
    for _ in range(args.steps):
        u = np.fft.irfft2(np.fft.rfft2(u) * factor, s=(nx, ny))
    return u


# ---------------------------------------------------------------- check and picture


def gather(block: np.ndarray, where: tuple, shape: tuple, comm: MPI.Intracomm):
    """The whole field on rank 0 (None elsewhere), from every rank's block."""
    pieces = comm.gather((where, block), root=0)
    if comm.Get_rank() != 0:
        return None
    full = np.empty(shape)
    for at, piece in pieces:
        full[at] = piece
    return full


def run(args: argparse.Namespace, comm: MPI.Intracomm) -> dict:
    """Solve in parallel and serially; rank 0's result has the field and the error."""
    solve, serial = {"explicit": (explicit, serial_explicit),
                     "spectral": (spectral, serial_spectral)}[args.method]
    block, where = solve(args, comm)
    full = gather(block, where, tuple(args.grid), comm)
    result = {"ranks": comm.Get_size(), "block": block, "where": where}
    if full is not None:
        reference = serial(args)
        scale = np.abs(initial_field(slice(0, args.grid[0]), slice(0, args.grid[1]),
                                     tuple(args.grid))).max()
        result.update(field=full, error=float(np.abs(full - reference).max() / scale))
    return result


def draw(result: dict, args: argparse.Namespace, blocks: list) -> str:
    """Write the initial and the final field with the ranks' blocks outlined; returns
    what was done."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no picture"
    nx, ny = args.grid
    start = initial_field(slice(0, nx), slice(0, ny), (nx, ny))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), dpi=100, sharey=True)
    for ax, field, title in ((axes[0], start, "initial"),
                             (axes[1], result["field"], f"after {args.steps} steps")):
        image = ax.imshow(field, origin="lower", cmap="inferno", extent=(0, ny, 0, nx))
        fig.colorbar(image, ax=ax, shrink=0.85, label="u")
        for rows, cols in blocks:     # every rank's block, outlined
            ax.add_patch(matplotlib.patches.Rectangle(
                (cols.start, rows.start), cols.stop - cols.start,
                rows.stop - rows.start, fill=False, edgecolor="white", lw=1, ls="--"))
        ax.set(xlabel="y (cells)", title=title)
    axes[0].set_ylabel("x (cells)")
    fig.suptitle(f"heat.py --method {args.method}: {nx} x {ny} cells on "
                 f"{result['ranks']} ranks (dashed: their blocks)\n"
                 f"largest difference from the serial run {result['error']:.1e}")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "heat.png"
    fig.savefig(path)
    plt.close(fig)
    return f"wrote {path}"


def parse_args(argv=None) -> argparse.Namespace:
    """The flags (``--dt`` defaults to 0.9 of the explicit stability limit)."""
    p = RankZeroParser(prog="heat.py", command=COMMAND,
                       description="2-D heat equation on a decomposed grid")
    p.add_argument("--method", choices=["explicit", "spectral"], default="explicit",
                   help="forward Euler with halos, or backward Euler with FFTs")
    p.add_argument("--grid", type=int, nargs=2, default=[101, 75], metavar=("NX", "NY"),
                   help="cells along x and y")
    p.add_argument("--steps", type=int, default=100, help="time steps")
    p.add_argument("--nu", type=float, default=1.0, help="diffusivity")
    p.add_argument("--dt", type=float, default=None,
                   help="time step (default: 0.9 of the explicit stability limit)")
    p.add_argument("--tolerance", type=float, default=1e-10,
                   help="largest difference from the serial run, relative")
    p.add_argument("--out", type=Path, default=Path("out/heat"),
                   help="where heat.png goes")
    args = p.parse_args(argv)
    if min(args.grid) < 1 or args.steps < 0 or args.nu <= 0:
        p.error("--grid needs extents >= 1, --steps >= 0 and --nu > 0")
    args.dt = default_dt(args) if args.dt is None else args.dt
    if args.method == "explicit" and args.dt > stability_limit(args):
        p.error(f"--dt {args.dt:.3g} is above the explicit scheme's stability limit "
                f"{stability_limit(args):.3g}; use a smaller --dt or --method spectral")
    return args


def main(argv=None) -> int:
    """Run the example; returns 0, 1 (off from the serial run) or 2 (bad flags)."""
    comm = MPI.COMM_WORLD
    args = parse_args(argv)
    try:
        result = run(args, comm)
    except ValueError as err:  # said on every rank alike (too few cells for the ranks)
        return report_error("heat.py", f"{err}{launcher_hint(COMMAND)}")
    blocks = comm.gather(result["where"], root=0)
    status = 0
    if comm.Get_rank() == 0:
        nx, ny = args.grid
        ranks = comm.Get_size()
        print(f"heat.py: {args.method}, {nx} x {ny} cells on {ranks} "
              f"rank{'s' * (ranks > 1)}, {args.steps} steps of dt {args.dt:.3g}")
        ok = result["error"] <= args.tolerance
        verdict = "ok" if ok else "TOO LARGE"
        print(f"largest difference from the serial NumPy run: {result['error']:.3e} "
              f"(relative; tolerance {args.tolerance:g}): {verdict}")
        print(draw(result, args, blocks))
        status = 0 if ok else 1
    return comm.bcast(status, root=0)


if __name__ == "__main__":
    finalize_and_exit(main())
