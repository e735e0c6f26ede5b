"""The tables of ``docs/howto/scaling.rst``: operation costs and the examples, on paper.

``python -m pympar.plan.scaling`` prints them as reStructuredText (the page holds this output;
``tests/test_plan_docs.py`` checks that it still does). Each figure is the planner's:
:func:`operation_rows` prices one call of each family of operations with
:mod:`pympar.plan.costs`; :func:`example_rows` ranks the examples' layouts with
:func:`pympar.plan.ranking.rank` and keeps the fastest.
"""

from __future__ import annotations

import sys
from typing import Callable

from . import costs
from .machines import PRESETS, Machine
from .models import Layout, Model
from .presets import BurgersModel, FNOModel
from .ranking import Prediction, rank

__all__ = ["COUNTS", "MODELS", "operation_rows", "example_rows", "breakdown_rows", "rst_table",
           "layout_from_text", "main"]

#: The rank counts of the page.
COUNTS = (64, 1024, 16384)
MIB = 2.0**20


def _models() -> dict[str, Model]:
    return {"burgers --hidden 512 --heads 8 --layers 4 --grid 4096 --batch 256":
            BurgersModel(hidden=512, heads=8, layers=4, grid=4096, batch=256),
            "fno --width 32 --modes 32 --layers 4 --grid 1024 --batch 256":
            FNOModel(width=32, modes=32, layers=4, grid=1024, batch=256)}


#: The examples at the sizes the page plans them at (their flags).
MODELS = _models()


def _collective(primitive: str, nbytes: float, name: str | None = None) -> Callable:
    def price(p: int, q: int, m: Machine) -> float:
        t = costs.traffic(primitive, p, q, nbytes, name)
        reduced = nbytes if primitive in ("all_reduce", "reduce_scatter") else 0.0
        return costs.seconds(t, m, reduced) + costs.check_seconds("board", p, q, m)
    return price


def _zero(nbytes: float) -> Callable:
    def price(p: int, q: int, m: Machine) -> float:
        return (_collective("reduce_scatter", nbytes)(p, q, m)
                + _collective("all_gather", nbytes)(p, q, m))
    return price


def _neighbours(faces: int, across: int, nbytes: float) -> Callable:
    """``faces`` messages to neighbours, ``across`` of them on other nodes once the ranks
    span nodes, and the check with the neighbours."""
    def price(p: int, q: int, m: Machine) -> float:
        far = across if p > q else 0
        near, remote = (costs.seconds(costs.traffic("halo", 2, q_, nbytes), m) for q_ in (2, 1))
        return (faces - far) * near + far * remote + costs.check_seconds("neighbours", p, q, m)
    return price


#: (family, what pympar calls it for, its price on p ranks, q a node, a machine).
FAMILIES: list[tuple[str, str, Callable]] = [
    ("all-reduce 8 B", "the loss; a check's leaders", _collective("all_reduce", 8)),
    ("all-reduce 64 MiB", "DP gradients (allreduce_gradients)", _collective("all_reduce",
                                                                             64 * MIB)),
    ("reduce-scatter + all-gather 64 MiB", "ZeRO's step", _zero(64 * MIB)),
    ("all-gather 1 MiB", "sequence-parallel and 3D gathers", _collective("all_gather", MIB)),
    ("all-to-all 1 MiB", "Ulysses, FFT transposes, spectral layers",
     _collective("all_to_all", MIB)),
    ("ring transfer 1 MiB", "one ring-attention step", _neighbours(1, 1, MIB)),
    ("halo exchange, 4 faces of 64 KiB", "a 2-D block's halo (2 faces across nodes)",
     _neighbours(4, 2, 64 * 2**10)),
    ("agreement check", "every collective and parallel layer",
     lambda p, q, m: costs.check_seconds("board", p, q, m)),
    ("checkpoint of 64 GiB", "checkpoint.save, every rank its part",
     lambda p, q, m: costs.checkpoint_seconds(64 * 2**30, p, q, m)),
]


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def operation_rows(machine: Machine, counts: tuple[int, ...] = COUNTS) -> list[list[str]]:
    """One call of each family over all ``counts`` ranks, ``machine.node_size`` a node."""
    q = machine.node_size or 1
    return [[name, use, *(_time(price(p, min(q, p), machine)) for p in counts)]
            for name, use, price in FAMILIES]


def example_rows(model: Model, counts: tuple[int, ...] = COUNTS,
                 machines: tuple[str, ...] = ("hdr", "25gbe", "gpu")) -> list[list[str]]:
    """The fastest layout of ``model`` per rank count and machine, and its figures."""
    rows = []
    for p in counts:
        for name in machines:
            fitting, unfit = rank(model, p, PRESETS[name])
            if not fitting:
                sized = [u for u in unfit if u.memory]
                reason = (f"none fits: {_show_mib(min(u.memory['total'] for u in sized))} "
                          f"a rank at least" if sized else "none fits")
                rows.append([f"{p:,}", name, reason, "", "", "", "", ""])
                continue
            rows.append(example_row(fitting[0], p, name))
    return rows


def example_row(best: Prediction, ranks: int, machine: str) -> list[str]:
    """One row of :func:`example_rows`: a prediction's figures."""
    s = best.seconds
    return [f"{ranks:,}", machine, best.text, _time(s["step"]), _time(s["compute"]),
            f"{100 * s['communication'] / s['step']:.1f} %",
            f"{100 * s['checks'] / s['step']:.2f} %", _show_mib(best.memory["total"])]


def breakdown_row(best: Prediction, ranks: int, top: int = 3) -> list[str]:
    """One row of :func:`breakdown_rows`: a prediction's largest communication terms."""
    parts = sorted(best.by_operation.items(), key=lambda kv: -kv[1])[:top]
    return [f"{ranks:,}", best.text, _time(best.step),
            ", ".join(f"{name.replace('_', '-')} {_time(sec)}" for name, sec in parts)]


def breakdown_rows(model: Model, machine: str, counts: tuple[int, ...] = COUNTS,
                   top: int = 3) -> list[list[str]]:
    """Where the fastest layout's communication goes, per rank count: its ``top`` terms
    (group role and kind of call, or its checks) by seconds per step."""
    rows = []
    for p in counts:
        fitting, _ = rank(model, p, PRESETS[machine])
        if not fitting:
            continue
        rows.append(breakdown_row(fitting[0], p, top))
    return rows


def layout_from_text(text: str) -> Layout:
    """The layout :func:`pympar.plan.models.describe` put in words (``"tp=1 cp=64 dp=256
    hybrid(u=8) zero"``, ``"spatial=64 dp=256"``)."""
    sizes, fields = {}, {}
    for word in text.replace(" (3d)", ",3d").split():
        name, _, value = word.partition("=")
        if word.startswith(("ulysses", "ring", "hybrid")):
            fields["attention"] = word.split("(")[0]
            if "(u=" in word:
                fields["ulysses"] = int(word.split("(u=")[1].rstrip(")"))
        elif value:
            value, _, mode = value.partition(",")
            sizes["cp" if name == "spatial" else name] = int(value)
            if mode:
                fields["mode"] = mode
        else:
            fields[word] = True
    return Layout(**sizes, **fields)


def _show_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.0f} MiB"


def rst_table(header: list[str], rows: list[list[str]]) -> str:
    """A reStructuredText simple table."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa
    return "\n".join([rule, line(header), rule, *map(line, rows), rule])


def main(argv: list[str] | None = None) -> int:
    """Print the page's tables (``--only operations``, ``examples`` or ``breakdown``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    if only in (None, "operations"):
        for name in ("hdr", "25gbe"):
            print(f"{name}:\n")
            print(rst_table(["operation", "used by", *(f"{p:,} ranks" for p in COUNTS)],
                            operation_rows(PRESETS[name])) + "\n")
    if only in (None, "examples"):
        for flags, model in MODELS.items():
            print(f"{flags}:\n")
            print(rst_table(["ranks", "machine", "fastest layout", "step", "compute",
                             "communication", "checks", "memory/rank"],
                            example_rows(model)) + "\n")
    if only in (None, "breakdown"):
        for flags, model in MODELS.items():
            print(f"{flags}, gpu:\n")
            print(rst_table(["ranks", "fastest layout", "step", "its largest communication terms"],
                            breakdown_rows(model, "gpu")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
