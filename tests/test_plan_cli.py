"""``python -m pympar plan``: the table, JSON, the plot, and one line for impossible requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_helpers import WORLD
from pympar import __main__ as cli
from pympar.plan.cli import parse_bytes
from pympar.plan.presets import BurgersModel

pytestmark = pytest.mark.skipif(WORLD.size > 1, reason="arithmetic; one rank is enough")
REPO = Path(__file__).resolve().parent.parent


def ranked_rows(out: str) -> list[str]:
    """The table's lines of layouts that fit: after its rule, before what does not fit."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line and not line.strip("- ")) + 1
    return [line for line in lines[start:] if line.split()[0].isdigit() and "do not" not in line]


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_command_line_ranks_every_layout_that_fits_on_8_ranks(tmp_path):
    """On 'this' machine, calibrated (here: the calibration of pympar's own figures, put
    where $PYMPAR_PLAN_MACHINE says)."""
    from pympar.plan.machines import REFERENCE_FILE
    calibrated = tmp_path / "calibrated.json"
    calibrated.write_text(REFERENCE_FILE.read_text())
    found = subprocess.run([sys.executable, "-m", "pympar", "plan", "--model", "burgers",
                            "--ranks", "8", "--machine", "this"], capture_output=True,
                           text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "PYMPAR_PLAN_MACHINE": str(calibrated)})
    assert found.returncode == 0, found.stderr
    lines = found.stdout.splitlines()
    model = BurgersModel()
    fit = sum(model.unfit(layout) is None for layout in model.layouts(8))
    assert lines[0].startswith("burgers on 8 ranks, machine vm: ")
    assert lines[1].startswith(f"{fit} layouts fit, fastest first")
    ranked = ranked_rows(found.stdout)
    assert [int(line.split()[0]) for line in ranked] == list(range(1, fit + 1))
    steps = [float(line.split()[-9]) for line in ranked]  # the step column, from the right
    assert steps == sorted(steps)


def test_json_lists_predictions_and_the_layouts_that_do_not_fit(capsys):
    status, out, _ = plan(capsys, "--model", "fno", "--ranks", "64", "--machine", "hdr",
                          "--json")
    data = json.loads(out)
    assert status == 0 and data["model"] == "fno" and data["node_size"] == 128
    steps = [p["seconds"]["step"] for p in data["fitting"]]
    assert steps == sorted(steps) and all(p["fits"] for p in data["fitting"])
    assert {p["reason"] for p in data["unfit"]} == {"batch 8 is smaller than dp 64",
                                                    "batch 8 is smaller than dp 32",
                                                    "batch 8 is smaller than dp 16",
                                                    "grid 32 has fewer rows than spatial 64"}
    first = data["fitting"][0]
    assert 0 < first["communication_share"] < 1 and first["memory"]["total"] > 0


def test_top_config_and_memory(capsys):
    status, out, _ = plan(capsys, "--ranks", "4", "--machine", "gpu", "--top", "2",
                          "--config", "hidden=128,layers=3", "--memory", "64MiB")
    assert status == 0 and len(ranked_rows(out)) == 2


@pytest.mark.parametrize("argv, words", [
    (["--model", "gpt"], "unknown model 'gpt': choose burgers or fno"),
    (["--model", "fno", "--ranks", "1000"], "no layout of fno takes 1000 ranks"),
    (["--ranks", "8", "--memory", "1KiB"], "the smallest, tp="),
    (["--ranks", "0"], "--ranks must be a rank count >= 1"),
    (["--ranks", "2", "--memory", "lots"], "--memory 'lots': give an amount such as 512MiB"),
    (["--ranks", "2", "--config", "depth=3"], "--config 'depth=3': give KEY=INTEGER"),
    (["--ranks", "2", "--machine", "cray"], "unknown machine 'cray'"),
])
def test_impossible_requests_end_in_one_line_naming_what_would_fit(capsys, argv, words):
    status, out, err = plan(capsys, "--machine", "hdr", *argv)
    assert status == 2 and out == "" and len(err.splitlines()) == 1, err
    assert words in err
    if "1000" in argv:  # at most 8 fields of 32 rows: 256 ranks
        assert err.rstrip().endswith(": 256 ranks would")
    if "1KiB" in argv:
        assert "give --memory" in err


def test_plot_draws_the_best_layouts_against_ranks(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.png"
    status, _, _ = plan(capsys, "--ranks", "8", "--machine", "hdr", "--plot", str(target))
    assert status == 0 and target.stat().st_size > 1000


def test_amounts_of_memory():
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2 GiB") == 2 * 2**30
    assert parse_bytes("4e9") == 4e9 and parse_bytes("1kb") == 1000


def test_this_machine_lives_in_the_users_cache_and_must_be_calibrated(capsys, tmp_path,
                                                                      monkeypatch):
    """'this' is read from (and --calibrate writes to) the user's cache, or
    $PYMPAR_PLAN_MACHINE, never the package; not calibrated, it is refused in one line that
    names the command; 'vm' is the machine of pympar's own figures."""
    from pympar.plan import machines
    monkeypatch.delenv("PYMPAR_PLAN_MACHINE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert machines.this_file() == tmp_path / "cache" / "pympar" / "this_machine.json"
    status, out, err = plan(capsys, "--ranks", "2")
    assert status == 2 and not out and len(err.splitlines()) == 1
    assert "machine 'this' is not calibrated" in err and "plan --calibrate" in err
    monkeypatch.setenv("PYMPAR_PLAN_MACHINE", str(tmp_path / "mine.json"))
    assert machines.this_file() == tmp_path / "mine.json"
    (tmp_path / "mine.json").write_text(machines.REFERENCE_FILE.read_text())
    assert machines.machine("this") == machines.machine("vm")
    package = Path(machines.__file__).resolve().parent
    assert machines.machine("vm").name == "vm" and machines.REFERENCE_FILE.parent == package
