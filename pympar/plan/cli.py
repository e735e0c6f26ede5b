"""``python -m pympar plan``: the layouts of a model that fit, ranked by predicted step time.

Pure arithmetic (no launcher, no communication): run it anywhere, for any rank count::

    python -m pympar plan --model burgers --ranks 8 --machine this
    python -m pympar plan --model fno --ranks 1024 --machine hdr --node-size 128 --json
    python -m pympar plan --calibrate      # measure this machine first (about a minute)

A table for people (or ``--json`` for scripts), the layouts that do not fit with the reason,
and with ``--plot FILE`` the predicted step time against the rank count of the best layouts.
An impossible request (an unknown model, a rank count no layout takes, too little memory)
ends in one line that names what would fit, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import fields
from typing import Any

from .machines import PRESETS, machine as find_machine

__all__ = ["add_arguments", "run", "parse_bytes", "make_model", "table", "PROG", "MODELS"]

PROG = "python -m pympar plan"
#: The models ``--model`` names (:data:`pympar.plan.presets.PRESETS`; the options need no
#: more than their names, so ``python -m pympar --help`` imports nothing heavier).
MODELS = ("burgers", "fno")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_bytes(text: str) -> float:
    """``"512MiB"``, ``"2GiB"``, ``"1.5e9"`` as bytes.

    Raises
    ------
    ValueError
        For text that is not a positive amount with a known unit.
    """
    found = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"--memory {text!r}: give an amount such as 512MiB, 2GiB or 4e9")
    return float(found.group(1)) * _UNITS[unit]


def make_model(name: str, config: list[str] | None = None) -> Any:
    """The preset ``name`` with its example's flags changed by ``KEY=VALUE`` items.

    Raises
    ------
    ValueError
        For an unknown model or flag (the message lists the known ones).
    """
    from .presets import PRESETS as classes
    if name not in classes:
        raise ValueError(f"unknown model {name!r}: choose {' or '.join(classes)} (or plan any "
                         f"chain of pympar layers with pympar.plan.ChainModel)")
    cls = classes[name]
    known = [f.name for f in fields(cls) if f.name not in ("name", "spatial_axis")]
    values: dict[str, Any] = {}
    for item in (part for entry in config or [] for part in entry.split(",") if part):
        key, _, value = item.partition("=")
        if key not in known or not value.strip().isdigit():
            raise ValueError(f"--config {item!r}: give KEY=INTEGER with KEY one of "
                             f"{', '.join(known)}")
        values[key] = int(value)
    return cls(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m pympar plan``."""
    parser.add_argument("--model", default="burgers",
                        help=f"the model: {' or '.join(MODELS)} (the examples' defaults)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="change a flag of the example model, e.g. hidden=1024,layers=8 "
                             "(repeatable)")
    parser.add_argument("--ranks", type=int, default=None, help="ranks of the job")
    parser.add_argument("--machine", default="this",
                        help=f"this (measured here by --calibrate), vm (the machine of "
                             f"pympar's own figures), {', '.join(PRESETS)}, or a calibration "
                             f"JSON")
    parser.add_argument("--node-size", type=int, default=None, metavar="RANKS",
                        help="ranks per node (default: the machine's; this: all on one)")
    parser.add_argument("--memory", default=None, metavar="BYTES",
                        help="memory per rank, e.g. 2GiB (default: the node's, shared)")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="show only the N fastest layouts")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="plot predicted step time against ranks for the 3 best layouts "
                             "(needs matplotlib)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine (about a minute) and store it as 'this' "
                             "(in the user's cache, or $PYMPAR_PLAN_MACHINE)")


def _show_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def table(fitting: list[Any], unfit: list[Any]) -> str:
    """The ranking as aligned text: one line per layout that fits (step and compute in
    milliseconds, the shares of communication and of checks, bytes sent and messages per
    step, memory per rank), then the layouts that do not fit under their reasons."""
    head = ("#", "layout", "step ms", "compute", "comm", "checks", "sent", "msgs", "memory")
    body = [(str(i), p.text, f"{p.step * 1e3:.3f}", f"{p.seconds['compute'] * 1e3:.3f}",
             f"{100 * p.communication_share:.0f}%",
             f"{100 * p.seconds['checks'] / p.step:.1f}%", _show_bytes(p.bytes_sent),
             str(p.messages), _show_bytes(p.memory["total"])) for i, p in enumerate(fitting, 1)]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if unfit:
        lines.append(f"{len(unfit)} do not fit:")
        reasons: dict[str, list[str]] = {}
        for p in unfit:
            reasons.setdefault(p.reason or "", []).append(p.text)
        for reason, texts in reasons.items():
            lines += [f"  {reason}:", *(f"    {text}" for text in texts)]
    return "\n".join(lines)


#: Rank counts tried on each side of one that no layout takes (each costs a ranking).
_NEARBY_TRIES = 64


def _nearby(model: Any, ranks: int) -> str:
    """Rank counts near ``ranks`` that some layout of ``model`` takes: the nearest within
    :data:`_NEARBY_TRIES` on each side, then powers of two (a bounded search, whatever
    ``ranks``)."""
    def fits(n: int) -> bool:
        return n >= 1 and any(model.unfit(layout) is None for layout in model.layouts(n))
    powers = [2**k for k in range(ranks.bit_length() + 2)]
    below = next((n for n in [*range(ranks - 1, max(ranks - _NEARBY_TRIES, 0), -1),
                              *reversed([q for q in powers if q < ranks])] if fits(n)), None)
    above = next((n for n in [*range(ranks + 1, ranks + _NEARBY_TRIES),
                              *[q for q in powers if q > ranks]] if fits(n)), None)
    return " or ".join(str(n) for n in (below, above) if n is not None) or "none near"


def _no_fit(model: Any, ranks: int, unfit: list[Any]) -> str:
    """The one line said when nothing fits: what would."""
    memory = [p for p in unfit if p.memory]
    if memory:
        least = min(memory, key=lambda p: p.memory["total"])
        return (f"no layout of {model.name} fits on {ranks} ranks in the memory per rank: the "
                f"smallest, {least.text}, needs {_show_bytes(least.memory['total'])} "
                f"(give --memory {math.ceil(least.memory['total'] / 2**20)}MiB or more)")
    reasons = sorted({p.reason for p in unfit if p.reason})
    return (f"no layout of {model.name} takes {ranks} ranks ({'; '.join(reasons[:3])}): "
            f"{_nearby(model, ranks)} ranks would")


def _plot(model: Any, best: list[Any], ranks: int, machine: Any, node: int | None,
          memory: float | None, path: str) -> None:
    from .ranking import predict
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=120)
    for p in best:
        unit = p.layout.tp * p.layout.cp
        counts = [unit * 2**k for k in range(0, 40) if unit * 2**k <= 4 * ranks]
        points = [(n, predict(model, p.layout.with_ranks(n), machine, node, memory))
                  for n in counts]
        points = [(n, q.step * 1e3) for n, q in points if q.fits]
        if points:  # the model-parallel part stays, dp takes the rest of the ranks
            ax.loglog(*zip(*points), marker="o",
                      label=p.text.replace(f"dp={p.layout.dp}", "dp=rest"))
    ax.axvline(ranks, color="0.6", lw=0.8, ls=":")
    ax.set(xlabel="ranks", ylabel="predicted step time (ms)",
           title=f"{model.name} on {machine.name}: the best layouts at {ranks} ranks")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run ``python -m pympar plan``; returns the exit status (2, one line, for bad input)."""
    try:
        if args.calibrate:
            from .calibrate import main as calibrate
            return calibrate([])
        model = make_model(args.model, args.config)
        if args.ranks is None or args.ranks < 1:
            raise ValueError("--ranks must be a rank count >= 1")
        if args.node_size is not None and args.node_size < 1:
            raise ValueError("--node-size must be >= 1")
        where = find_machine(args.machine)
        memory = None if args.memory is None else parse_bytes(args.memory)
        from .ranking import rank
        fitting, unfit = rank(model, args.ranks, where, args.node_size, memory)
        if not fitting:
            raise ValueError(_no_fit(model, args.ranks, unfit))
        shown = fitting[:args.top] if args.top > 0 else fitting
        if args.json:
            print(json.dumps({"model": model.name, "ranks": args.ranks, "machine": where.name,
                              "node_size": args.node_size or where.node_size or args.ranks,
                              "fitting": [p.as_dict() for p in shown],
                              "unfit": [p.as_dict() for p in unfit]}, indent=1))
        else:
            print(f"{model.name} on {args.ranks} ranks, machine {where.name}: "
                  f"{where.description}")
            print(f"{len(fitting)} layouts fit, fastest first (times per step, shares of "
                  f"the step, per rank)")
            print(table(shown, unfit))
        if args.plot:
            _plot(model, fitting[:3], args.ranks, where, args.node_size, memory, args.plot)
    except (ValueError, OSError) as err:  # OSError: a calibration it cannot write
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0
