"""Small text helpers shared by the report modules: sizes, markdown tables, verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(folder: Path, name: str) -> dict[str, Any] | None:
    """The JSON document ``folder / name``, or None when the job did not write it.

    Parameters
    ----------
    folder : Path
        The results folder.
    name : str
        The file name, e.g. ``"memory.json"``.
    """
    path = folder / name
    if not path.exists():
        return None
    return json.loads(path.read_text())


def show_size(nbytes: float) -> str:
    """``1048576`` -> ``"1 MiB"``; non-round sizes get two decimals.

    Parameters
    ----------
    nbytes : float
        A byte count.
    """
    for unit, factor in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= factor:
            value = nbytes / factor
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes:.0f} B"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table: the first column left-aligned, the others right-aligned.

    Parameters
    ----------
    header : list of str
        Column titles.
    rows : list of list
        Cells, turned into text with ``str``.
    """
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def verdict(ok: bool) -> str:
    """``"met"`` or ``"missed"``: the word every target line ends with.

    Parameters
    ----------
    ok : bool
        Whether the figure meets its target.
    """
    return "met" if ok else "missed"
