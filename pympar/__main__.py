"""Command line of pympar.

``mpiexec -n N python -m pympar info [--tp --cp --order --mode]`` prints the MPI
setup and the parallel layout; ``python -m pympar bench [--quick] [--out DIR]``
(without a launcher: it starts its own ``mpiexec`` runs) runs the benchmarks of
a repository checkout and writes JSON, PNG plots and a markdown table.

Under a launcher every rank parses the same command line: usage, help and
errors are printed once, by rank 0, and every rank exits with the same status.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType

from mpi4py import MPI

from . import __version__, backend, manager
from .launch import RankZeroParser, report_error


#: The most characters of the library's own words that ``info`` shows on its line.
_LIBRARY_WIDTH = 66


def _library_name(version: str | None = None, width: int = _LIBRARY_WIDTH) -> str:
    """The MPI library as the first line of its version text names it, spaces collapsed, in
    its leading comma-separated fields that fit ``width`` characters: Open MPI's line runs to
    140 (``Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: ...``), wider
    than the pages that show this tool's output.

    Parameters
    ----------
    version : str, optional
        The text of ``MPI.Get_library_version()`` (the loaded library's by default).
    width : int
        The most characters (the first field is kept whole).

    Returns
    -------
    str
        E.g. ``"MPICH Version: 5.0.2"``, ``"Open MPI v4.1.4, package: Debian OpenMPI, ident:
        4.1.4"``.
    """
    text = MPI.Get_library_version() if version is None else version
    fields = " ".join(text.splitlines()[0].split()).split(", ")
    shown = fields[0]
    for field in fields[1:]:
        if len(shown) + 2 + len(field) > width:
            break
        shown += ", " + field
    return shown


def _info(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    state = manager.initialize_parallel(args.tp, args.cp, args.order, comm, args.mode)
    try:
        # Every rank reads the settings, so a bad PYMPAR_CUDA_AWARE raises on all of them
        # (and the job ends) instead of on rank 0 alone while the others wait.
        staging = "device buffers to MPI" if backend.cuda_aware() else "host staging"
        row = (comm.Get_rank(), socket.gethostname(), state.mesh.coords,
               [g.name for g in state.all_groups()])
        rows = comm.gather(row, root=0)
        if comm.Get_rank() == 0:
            aware = backend.mpi_library_cuda_support()
            print(f"pympar {__version__}")
            print(f"world size        {comm.Get_size()}")
            print(f"MPI library       {_library_name()}")
            print(f"MPI standard      {'.'.join(map(str, MPI.Get_version()))}, "
                  f"mpi4py {__import__('mpi4py').__version__}")
            library = {None: "unknown", True: "yes", False: "no"}[aware]
            print(f"CUDA-aware MPI    library says {library}; CuPy arrays use {staging} "
                  f"(PYMPAR_CUDA_AWARE={os.environ.get('PYMPAR_CUDA_AWARE', 'auto')})")
            print(f"layout            {state.mesh!r}, mode {state.tensor_parallel_mode}")
            names = ["tensor", "context", "data", "data_context", *[m.value for m in state.groups_3d]]
            print(layout_table(names, rows))
            sys.stdout.flush()
    finally:
        manager.destroy_parallel()
    return 0


def layout_table(group_kinds: list[str], rows: list[tuple]) -> str:
    """The rank -> host -> coordinates -> groups table, each column as wide as its widest cell.

    Parameters
    ----------
    group_kinds : list of str
        The header of each group column.
    rows : list of tuple
        ``(world rank, host, coordinates dict, group names)`` per rank.
    """
    cells = [["rank", "host", "coords", *group_kinds]]
    for rank, host, coords, groups in rows:
        cells.append([str(rank), host, ",".join(f"{a}={c}" for a, c in coords.items()), *groups])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i == 0 else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in cells)


def _benchmarks_driver(repo: Path | None = None) -> ModuleType:
    """Import ``benchmarks/run.py`` of the checkout this package lives in.

    Parameters
    ----------
    repo : Path, optional
        The repository root; by default the folder above this package.

    Raises
    ------
    RuntimeError
        When the package does not sit in a repository checkout with a
        ``benchmarks/`` folder (e.g. a wheel install).
    """
    repo = Path(__file__).resolve().parent.parent if repo is None else Path(repo)
    driver = repo / "benchmarks" / "run.py"
    if not driver.is_file():
        raise RuntimeError(
            f"the benchmarks are not installed with the package: {driver} does not exist. "
            "Run `python -m pympar bench` from an editable install of a pympar repository "
            "checkout (pip install -e .), or run the scripts in its benchmarks/ folder")
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    spec = importlib.util.spec_from_file_location("benchmarks.run", driver)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _bench(args: argparse.Namespace) -> int:
    if MPI.COMM_WORLD.Get_size() > 1:
        raise RuntimeError("`python -m pympar bench` starts its own mpiexec runs: run it "
                           "without a launcher, e.g. `python -m pympar bench --quick`")
    return _benchmarks_driver().run(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench options; the driver's own when the checkout has one."""
    try:
        _benchmarks_driver().add_arguments(parser)
    except Exception:  # noqa: BLE001 - `info` must work whatever state benchmarks/ is in
        # Keep --help working; running `bench` reports the problem.
        parser.add_argument("--quick", action="store_true")
        parser.add_argument("--out", default="bench-results")


def _plan_cli() -> ModuleType:
    """The planner's command line (imported when used)."""
    from .plan import cli
    return cli


def _plan(args: argparse.Namespace) -> int:
    if MPI.COMM_WORLD.Get_rank() == 0:  # arithmetic: rank 0 says it, every rank returns alike
        return _plan_cli().run(args)
    with open(os.devnull, "w") as quiet:
        saved, sys.stdout, sys.stderr = (sys.stdout, sys.stderr), quiet, quiet
        try:
            return _plan_cli().run(args)
        finally:
            sys.stdout, sys.stderr = saved


DESCRIPTION = ("pympar's command line: `info` prints the MPI setup and the parallel layout "
               "(under your launcher, e.g. `mpiexec -n 4 python -m pympar info --tp 2`); "
               "`bench` runs the benchmarks of a repository checkout (without a launcher); "
               "`plan` ranks the layouts of a model by predicted step time (no launcher).")
REFERENCE_WIDTH = 88


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``python -m pympar`` (also used to write the CLI reference)."""
    parser = RankZeroParser(prog="python -m pympar", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pympar {__version__}")
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{info,bench,plan}")
    info = commands.add_parser("info", help="print the MPI setup and the parallel layout",
                               description="Print the MPI library, CUDA-awareness and the "
                                           "rank -> host -> coordinates -> groups table. Run it "
                                           "under the launcher of your job.")
    info.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    info.add_argument("--cp", type=int, default=1, help="context-parallel size")
    info.add_argument("--order", default="tp-cp-dp", help="axes innermost first")
    info.add_argument("--mode", default="1d", choices=manager.TENSOR_PARALLEL_MODES,
                      help="tensor-parallel mode")
    info.set_defaults(run=_info, parser=info)
    bench = commands.add_parser(
        "bench", help="run the benchmarks (spawns mpiexec itself; from a repository checkout)",
        description="Run pympar's benchmarks under mpiexec and write JSON, PNG plots and "
                    "results.md. --quick takes under two minutes on two cores.")
    _bench_arguments(bench)
    bench.set_defaults(run=_bench, parser=bench)
    plan = commands.add_parser(
        "plan", help="rank the layouts of a model by predicted step time (no launcher)",
        description="List the layouts of a model that fit a rank count, fastest first by "
                    "predicted step time, with memory per rank, bytes sent per step and "
                    "the share of communication; say why the others do not fit. Arithmetic "
                    "only: no launcher, no communication.")
    _plan_cli().add_arguments(plan)
    plan.set_defaults(run=_plan, parser=plan)
    return parser


def reference_text(width: int = REFERENCE_WIDTH) -> str:
    """The help of ``python -m pympar`` and of each subcommand, as the CLI prints it.

    Parameters
    ----------
    width : int
        Line width of the help text.
    """
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # argparse wraps to the terminal's width
    try:
        parser = build_parser()
        sections = [("python -m pympar", parser)]
        for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
            sections += [(f"python -m pympar {name}", sub) for name, sub in action.choices.items()]
        return "\n".join(f"$ {title} --help\n{sub.format_help()}" for title, sub in sections)
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def main(argv: list[str] | None = None) -> int:
    """Run the pympar command line; returns the exit status.

    Parameters
    ----------
    argv : list of str, optional
        The arguments; ``sys.argv[1:]`` by default.

    Returns
    -------
    int
        0, or 2 after an error (printed once, by rank 0, with the subcommand's usage).
    """
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # argparse would blame the top-level command; show the subcommand's usage
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as err:
        # pympar raises these on every rank alike (initialize_parallel agrees first):
        # one copy of the message, not one per rank.
        args.parser.print_usage(sys.stderr)  # rank 0 alone prints
        return report_error(args.parser.prog, str(err))


if __name__ == "__main__":
    sys.exit(main())
