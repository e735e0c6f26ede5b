"""``python -m pympar``: the layout table printed by rank 0; errors, usage and version
printed once, by rank 0, with the subcommand's usage; the CLI reference covers every option."""

import argparse

import pytest

from mpi_helpers import WORLD, agree
import pympar
from pympar import __main__ as cli
from pympar import manager
from pympar.mesh import group_ranks


@pytest.mark.mpi(min_size=1)
def test_info_prints_every_rank_with_its_groups(capsys):
    tp = 2 if WORLD.size % 2 == 0 else 1
    status = cli.main(["info", "--tp", str(tp)])
    out = capsys.readouterr().out
    agree(status == 0 and not manager.is_initialized(), f"status {status}")
    if WORLD.rank == 0:
        sizes = {"tp": tp, "cp": 1, "dp": WORLD.size // tp}
        lines = {int(line.split()[0]): line for line in out.splitlines()
                 if line.split() and line.split()[0].isdigit()}
        ok = (f"world size        {WORLD.size}" in out and "MPI library" in out
              and "CUDA-aware MPI" in out and sorted(lines) == list(range(WORLD.size)))
        for rank, line in lines.items():
            tp_row = [r for r in group_ranks(sizes, "tp-cp-dp", "tp").tolist() if rank in r][0]
            ok = ok and ("tp-" + "-".join(map(str, tp_row))) in line.split()
        # The header's words start where their columns' cells start.
        header = next(line for line in out.splitlines() if line.startswith("rank"))
        starts = [header.index(" " + word) + 1 for word in header.split()[1:]]
        for line in lines.values():
            ok = ok and all(line[i - 1] == " " and line[i] != " " for i in starts)
        agree(ok, out)
    else:
        agree(out == "", f"rank {WORLD.rank} printed {out!r}")


@pytest.mark.mpi(min_size=1)
def test_info_bad_cuda_setting_exits_2_on_every_rank(capsys, monkeypatch):
    monkeypatch.setenv("PYMPAR_CUDA_AWARE", "maybe")
    status = cli.main(["info"])  # rank 0 alone reading the setting left the others waiting
    err = capsys.readouterr().err
    ok = err.count("PYMPAR_CUDA_AWARE must be auto, 0 or 1, not 'maybe'") == (WORLD.rank == 0)
    agree(status == 2 and ok and not manager.is_initialized(), f"status {status}: {err!r}")


@pytest.mark.mpi(min_size=1)
def test_info_bad_layout_exits_2_on_every_rank_and_rank_0_says_why_once(capsys):
    status = cli.main(["info", "--tp", str(WORLD.size + 1)])
    err = capsys.readouterr().err
    if WORLD.rank == 0:
        ok = (err.startswith("usage: python -m pympar info ") and err.count("error:") == 1
              and f"python -m pympar info: error: world size {WORLD.size} is not divisible by "
                  f"tensor_parallel_size {WORLD.size + 1}" in err)
    else:
        ok = err == ""
    agree(status == 2 and ok and not manager.is_initialized(), f"status {status}: {err!r}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("argv,expected", [
    (["info", "--bogus"], "python -m pympar info: error: unrecognized arguments: --bogus"),
    (["info", "--tp", "x"], "python -m pympar info: error: argument --tp: invalid int value"),
    (["bench", "--bogus"], "python -m pympar bench: error: unrecognized arguments: --bogus"),
    (["nope"], "python -m pympar: error: argument {info,bench,plan}: invalid choice: 'nope'"),
])
def test_flag_errors_show_the_subcommands_usage_once(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    usage = "usage: " + expected.split(": error")[0]
    ok = exit_info.value.code == 2 and (
        (err.startswith(usage) and err.count(expected) == 1) if WORLD.rank == 0 else err == "")
    agree(ok, f"exit {exit_info.value.code}: {err!r}")


@pytest.mark.mpi(min_size=1)
def test_version_is_printed_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    out = capsys.readouterr().out
    expected = f"pympar {pympar.__version__}\n" if WORLD.rank == 0 else ""
    agree(exit_info.value.code in (0, None) and out == expected, repr(out))


def test_reference_shows_every_option_of_every_command():
    text = cli.reference_text()
    parser = cli.build_parser()
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0]
    parsers = {"python -m pympar": parser,
               **{f"python -m pympar {n}": p for n, p in subcommands.choices.items()}}
    for title, sub in parsers.items():
        assert f"$ {title} --help\nusage: {title} " in text, title
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in text, f"{title}: {flag} missing from the CLI reference"
    assert "``" not in text and ":func:" not in text  # no reST markup in --help
    assert max(map(len, text.splitlines())) <= cli.REFERENCE_WIDTH
