"""Communication accounting: calls, bytes and seconds per (group, operation).

Collectives report to every active :class:`Recorder` (with none, a collective pays one
branch). Recorders nest: an inner one and every outer one see the calls::

    with pympar.stats.record() as rec:
        y = group.all_reduce(x)
    print(rec.table())
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["Recorder", "record", "add", "is_recording"]

#: Recorders currently collecting, innermost last.
_active: list["Recorder"] = []

_FIELDS = ("calls", "bytes_in", "bytes_out", "seconds")


def is_recording() -> bool:
    """Return whether at least one :class:`Recorder` is active."""
    return bool(_active)


def add(group: str, operation: str, bytes_in: int, bytes_out: int, seconds: float) -> None:
    """Account one call to every active recorder: group name (``"tp-0-1"``), operation
    (``"all_reduce"``), bytes of its input and result on this rank, and wall-clock seconds."""
    for recorder in _active:
        recorder.add(group, operation, bytes_in, bytes_out, seconds)


class Recorder:
    """Totals of calls, bytes in, bytes out and seconds per (group, operation).

    A recorder collects while it is active, inside ``with recorder:`` (again later: the
    same totals go on; :meth:`reset` clears them). Totals are this rank's own.

    Attributes
    ----------
    rows : dict of (str, str) to list
        ``(group, operation) -> [calls, bytes_in, bytes_out, seconds]``.
    """

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[Any]] = {}

    def __enter__(self) -> "Recorder":
        _active.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        # This exact object's last entry, even if recorders were exited out of order.
        del _active[len(_active) - 1 - _active[::-1].index(self)]

    def add(self, group: str, operation: str, bytes_in: int, bytes_out: int,
            seconds: float) -> None:
        """Account one call (see :func:`add`)."""
        row = self.rows.setdefault((group, operation), [0, 0, 0, 0.0])
        row[:] = (row[0] + 1, row[1] + int(bytes_in), row[2] + int(bytes_out),
                  row[3] + float(seconds))

    def reset(self) -> None:
        """Forget every total."""
        self.rows.clear()

    def totals(self) -> dict[str, float]:
        """Return the sums of every column over all rows."""
        return dict(zip(_FIELDS, (sum(column) for column in zip(*self.rows.values(),
                                                                 (0, 0, 0, 0.0)))))

    def as_dict(self) -> dict[str, Any]:
        """Return ``{"rows": [{"group", "operation", "calls", "bytes_in", "bytes_out",
        "seconds"}, ...], "totals": {...}}``, rows sorted by group then operation."""
        rows = [{"group": g, "operation": op, **dict(zip(_FIELDS, values))}
                for (g, op), values in sorted(self.rows.items())]
        return {"rows": rows, "totals": self.totals()}

    def to_json(self, indent: int | None = None) -> str:
        """Return :meth:`as_dict` as a JSON string."""
        return json.dumps(self.as_dict(), indent=indent)

    def table(self) -> str:
        """Return the totals as an aligned text table (group, operation, calls, bytes in,
        bytes out, seconds) with a totals line."""
        header = ("group", "operation", "calls", "bytes in", "bytes out", "seconds")
        rows = [*sorted(self.rows.items()), (("total", ""), tuple(self.totals().values()))]
        body = [(g, op, str(c), str(bi), str(bo), f"{s:.6f}") for (g, op), (c, bi, bo, s) in rows]
        widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
        # Names left-aligned, numbers right-aligned.
        lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
                 for line in (header, *body)]
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([lines[0], rule, *lines[1:-1], rule, lines[-1]])

    def __repr__(self) -> str:
        return f"Recorder({len(self.rows)} rows, {self.totals()['calls']} calls)"


def record() -> Recorder:
    """Return a new :class:`Recorder`, active inside ``with pympar.stats.record() as rec:``."""
    return Recorder()

