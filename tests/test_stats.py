"""Communication statistics: recorders, nesting, table and JSON, and what collectives report."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from mpi_helpers import WORLD, agree
from pympar import mappings, stats
from pympar.mesh import Mesh


@pytest.fixture(scope="module")
def world():
    group = Mesh(WORLD, {"w": WORLD.size}).group("w")
    yield group
    group.free()


@pytest.mark.mpi(min_size=1)
def test_recorder_totals_table_and_json():
    with stats.record() as rec:
        stats.add("tp-0-1", "all_reduce", 1024, 1024, 0.5)
        stats.add("tp-0-1", "all_reduce", 1024, 1024, 0.25)
        stats.add("dp-0-2", "all_gather", 10, 20, 0.125)
    stats.add("tp-0-1", "all_reduce", 1, 1, 1.0)  # nobody records this one
    assert rec.rows[("tp-0-1", "all_reduce")] == [2, 2048, 2048, 0.75]
    assert rec.totals() == {"calls": 3, "bytes_in": 2058, "bytes_out": 2068, "seconds": 0.875}
    data = json.loads(rec.to_json())
    assert data == rec.as_dict()
    assert [(row["group"], row["operation"]) for row in data["rows"]] == [
        ("dp-0-2", "all_gather"), ("tp-0-1", "all_reduce")]
    lines = rec.table().splitlines()
    assert lines[0].split() == ["group", "operation", "calls", "bytes", "in", "bytes", "out",
                                "seconds"]
    assert lines[-1].split() == ["total", "3", "2058", "2068", "0.875000"]
    # Aligned: every line that holds numbers ends its columns at the same places.
    number_lines = [line for line in lines if line[:1] not in ("-", "")]
    assert len({len(line) for line in number_lines}) == 1
    rec.reset()
    assert rec.totals()["calls"] == 0


@pytest.mark.mpi(min_size=1)
def test_nested_and_reentered_recorders():
    outer = stats.record()
    with outer:
        stats.add("g", "op", 1, 1, 0.0)
        with stats.record() as inner:
            stats.add("g", "op", 1, 1, 0.0)
            assert stats.is_recording()
        stats.add("g", "op", 1, 1, 0.0)
    assert not stats.is_recording()
    assert outer.rows[("g", "op")][0] == 3 and inner.rows[("g", "op")][0] == 1
    with outer:
        stats.add("g", "op", 1, 1, 0.0)
    assert outer.rows[("g", "op")][0] == 4


@pytest.mark.mpi(min_size=1)
def test_collectives_and_mappings_report_calls_bytes_and_time(world):
    p = world.size
    x = np.ones((2 * p, 3), np.float32)
    with stats.record() as rec:
        world.all_reduce(x)
        world.all_reduce(x)
        world.all_gather(x, axis=1)
        mappings.gather_from_sequence(x, world, global_size=2 * p * p)
    world.all_reduce(x)  # not recorded
    rows = rec.rows
    ok = (rows[(world.name, "all_reduce")][:3] == [2, 2 * x.nbytes, 2 * x.nbytes]
          and rows[(world.name, "all_gather")][:3] == [1, x.nbytes, p * x.nbytes]
          and all(row[3] >= 0 for row in rows.values()))
    # A size-1 group communicates nothing, so a mapping on it records nothing.
    if p > 1:
        ok = ok and rows[(world.name, "gather_from_sequence.forward")][:3] == [
            1, x.nbytes, p * x.nbytes]
    agree(ok, f"recorded {rows}")


@pytest.mark.mpi(min_size=1)
def test_stats_imports_nothing_above_backend():
    source = Path(stats.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    pympar_imports = {m for m in imported if m.startswith(".") or m.startswith("pympar")}
    assert pympar_imports <= {".backend", "pympar.backend"}, pympar_imports
