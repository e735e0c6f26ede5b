"""``docs/howto/scaling.rst`` says what the planner says: its tables, output and error line.

The operation tables are regenerated whole; the examples' tables at 64 and 1,024 ranks too
(every layout ranked again); at 16,384 ranks the layout the page names is priced again and
must fit, with the page's figures (ranking every layout there takes half a minute).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpi_helpers import WORLD
from pympar import __main__ as cli
from pympar.plan import scaling
from pympar.plan.machines import PRESETS
from pympar.plan.ranking import predict

pytestmark = pytest.mark.skipif(WORLD.size > 1, reason="arithmetic; one rank is enough")
PAGE = Path(__file__).resolve().parent.parent / "docs" / "howto" / "scaling.rst"


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def tables_after(page: str, title: str) -> list[list[list[str]]]:
    """The simple tables that follow ``title``, each as rows of cells (split on the rules)."""
    lines = page[page.index(title):].splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) <= {"=", " "}]
    tables = []
    for top in range(0, len(rules) - 2, 3):
        first, header_end, bottom = rules[top:top + 3]
        spans = [m.span() for m in re.finditer("=+", lines[first])]
        tables.append([[line[a:b if k < len(spans) - 1 else None].strip()
                        for k, (a, b) in enumerate(spans)]
                       for line in lines[header_end + 1:bottom]])
    return tables


def test_the_shown_output_is_the_commands(page, capsys):
    assert cli.main(["plan", "--model", "fno", "--ranks", "8", "--machine", "hdr"]) == 0
    out = capsys.readouterr().out
    assert "\n".join("   " + line for line in out.splitlines()) in page
    assert cli.main(["plan", "--model", "fno", "--ranks", "1000", "--machine", "hdr"]) == 2
    err = capsys.readouterr().err.strip()
    shown = page[page.index("python -m pympar plan: error:"):].split("\n\n")[0]
    assert " ".join(shown.split()) == err


@pytest.mark.parametrize("machine, title", [("hdr", "InfiniBand HDR:"),
                                            ("25gbe", "25 Gb Ethernet:")])
def test_the_operation_tables_are_the_costs(page, machine, title):
    header = ["operation", "used by", *(f"{p:,} ranks" for p in scaling.COUNTS)]
    assert scaling.rst_table(header, scaling.operation_rows(PRESETS[machine])) in page
    assert title in page


@pytest.mark.parametrize("flags", list(scaling.MODELS))
def test_the_examples_tables_are_the_planners(page, flags):
    model = scaling.MODELS[flags]
    shown = tables_after(page, f"``examples/{flags.split()[0]}.py {flags.split(' ', 1)[1]}``")[0]
    assert [r[:2] for r in shown] == [[f"{p:,}", m] for p in scaling.COUNTS
                                      for m in ("hdr", "25gbe", "gpu")]
    small = scaling.example_rows(model, scaling.COUNTS[:2])
    assert shown[:len(small)] == small
    for row in shown[len(small):]:
        pred = predict(model, scaling.layout_from_text(row[2]), PRESETS[row[1]])
        assert pred.fits and scaling.example_row(pred, scaling.COUNTS[2], row[1]) == row


@pytest.mark.parametrize("flags", list(scaling.MODELS))
def test_the_breakdowns_are_the_planners(page, flags):
    model = scaling.MODELS[flags]
    shown = tables_after(page, "(``--only breakdown``)")[list(scaling.MODELS).index(flags)]
    small = scaling.breakdown_rows(model, "gpu", scaling.COUNTS[:2])
    assert shown[:len(small)] == small
    last = shown[len(small)]
    pred = predict(model, scaling.layout_from_text(last[1]), PRESETS["gpu"])
    assert scaling.breakdown_row(pred, scaling.COUNTS[2]) == last
