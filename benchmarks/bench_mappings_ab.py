"""A/B of the mappings benchmark: an earlier tree of pympar against this one, in one window.

Run from a repository checkout, without a launcher (it starts its own ``mpiexec`` jobs)::

    python benchmarks/bench_mappings_ab.py [--base a7a8f63] [--ranks 2] [--rounds 4] \\
        [--sizes 1KiB,1MiB] [--repeats 15] [--json PATH]

The tree of commit ``--base`` is written into a temporary folder (``git archive``). Each
round runs ``benchmarks/bench_mappings.py`` of both trees, each in its own ``mpiexec`` job
importing its own pympar (checked before the first round), in alternating order (AB, BA,
...), so that the machine's drift falls on both alike. Per operation and size the table
shows, for both, the median over rounds of each run's medians: pympar minus raw on the same
buffers (``extra``), pympar's time, the agreement check's cost (``check``: pympar with it
minus pympar without it, as each tree's benchmark measures it) and the bare handshake
(``floor``: the least any check made before the data call costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

sys.path.insert(0, str(REPO))

from benchmarks.report_format import show_size  # noqa: E402
from benchmarks.run import find_mpiexec, is_open_mpi, launch_command  # noqa: E402

#: The medians compared, per row of bench_mappings.py's JSON.
FIELDS = ("extra_us", "pympar_us", "raw_us", "check_us", "floor_us")


def materialize(commit: str, where: Path) -> Path:
    """Write the tree of ``commit`` (of this repository) into ``where``; return it."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def imported_from(tree: Path) -> str:
    """Where a Python started as the benchmark is finds ``pympar`` (must be inside ``tree``)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import pympar; "
            "print(pympar.__file__)")
    return subprocess.run([sys.executable, "-c", code, str(tree)], check=True,
                          capture_output=True, text=True, cwd=str(tree)).stdout.strip()


def run_tree(tree: Path, argv: list[str], target: Path, mpiexec: str, open_mpi: bool,
             ranks: int) -> dict[str, Any]:
    """One run of ``tree``'s mappings benchmark; its JSON document."""
    cmd, env = launch_command(mpiexec, ranks, [
        sys.executable, "-m", "mpi4py", str(tree / "benchmarks" / "bench_mappings.py"),
        *argv, "--json", str(target)], open_mpi)
    env["PYTHONPATH"] = str(tree)
    subprocess.run(cmd, env=env, cwd=str(tree), check=True, stdout=subprocess.DEVNULL)
    return json.loads(target.read_text())


def combine(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (operation, size): the median over rounds of each field, for each tree, and its
    spread (largest minus smallest round) as ``<side>_<field>_spread``."""
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    for side, docs in runs.items():
        for doc in docs:
            for row in doc["rows"]:
                cell = cells.setdefault((row["op"], row["bytes"]),
                                        {"communicates": row.get("communicates", True)})
                for name in FIELDS:
                    if row.get(name) is not None:
                        cell.setdefault(side, {}).setdefault(name, []).append(row[name])
    rows = []
    for (op, nbytes), cell in cells.items():
        row: dict[str, Any] = {"op": op, "bytes": nbytes, "communicates": cell["communicates"]}
        for side in runs:
            for name in FIELDS:
                values = cell.get(side, {}).get(name)
                row[f"{side}_{name}"] = statistics.median(values) if values else None
                row[f"{side}_{name}_spread"] = max(values) - min(values) if values else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="a7a8f63", help="the earlier commit (A)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sizes", default="1KiB,1MiB")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default="", help="the operations whose name contains this")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    bench = ["--sizes", args.sizes, "--repeats", str(args.repeats), "--warmup",
             str(args.warmup), "--only", args.only]
    mpiexec = find_mpiexec()
    open_mpi = is_open_mpi(mpiexec)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pympar-ab-") as scratch:
        before = Path(scratch, "before").resolve()
        before.mkdir()
        trees = {"before": materialize(args.base, before), "after": REPO}
        for side, tree in trees.items():
            found = Path(imported_from(tree)).resolve()
            if tree.resolve() not in found.parents:
                raise SystemExit(f"bench_mappings_ab: the {side} tree {tree} imports pympar "
                                 f"from {found}")
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(trees)[::-1]
            for side in order:
                target = Path(scratch, f"{side}-{i}.json")
                runs[side].append(run_tree(trees[side], bench, target, mpiexec, open_mpi,
                                           args.ranks))
                print(f"round {i + 1}/{args.rounds}: {side} done "
                      f"({time.monotonic() - start:.0f} s)", flush=True)
    rows = combine(runs)
    first = runs["after"][0]
    print(f"# {args.ranks} ranks, {first.get('dtype')}; before = {args.base}, after = this "
          f"tree; medians over {args.rounds} alternating rounds of medians of "
          f"{args.repeats}; {first.get('mpi')}")
    header = (f"{'op':40} {'size':>7} {'extra before':>12} {'extra after':>11} "
              f"{'check before':>12} {'check after':>11} {'floor before':>12} "
              f"{'floor after':>11}")
    print(header)
    print("-" * len(header))

    def us(value: float | None, width: int) -> str:
        return f"{'n/a':>{width}}" if value is None else f"{value:{width}.2f}"
    for row in rows:
        print(f"{row['op']:40} {show_size(row['bytes']):>7} " + " ".join(
            us(row[f"{side}_{name}"], w) for name in ("extra_us", "check_us", "floor_us")
            for side, w in (("before", 12), ("after", 11))))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"ranks": args.ranks, "base": args.base, "rounds": args.rounds,
             "repeats": args.repeats, "sizes": args.sizes, "dtype": first.get("dtype"),
             "mpi": first.get("mpi"), "seconds": round(time.monotonic() - start, 1),
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
