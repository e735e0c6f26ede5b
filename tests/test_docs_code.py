"""Every code block of the documentation and the README runs as written, at the rank count
it states, or is marked on the page as what it is (tests/docs_blocks.py says how).

The blocks run once, in the pass of the suite without a launcher: each program and each
command starts its own job, as a reader's shell would.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mpi4py import MPI

import docs_blocks
from docs_blocks import ROOT, all_blocks, fragment_problems, rst_blocks, run_block, scratch

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.kind in ("program", "doctest", "commands", "openmpi")]
#: Blocks that run longer than this suite may spend, with where they are tested instead.
LONG = {"python -m pympar bench --quick --out bench-results":
        "every benchmark, about two minutes on two cores (tests/test_bench*.py test its "
        "parts)"}
SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                            reason="starts jobs of its own: runs in the pass without a "
                                   "launcher")


@pytest.fixture(scope="module")
def page_directories(tmp_path_factory):
    """One scratch directory per page, shared by its blocks in page order."""
    made: dict[Path, Path] = {}

    def directory(page: Path) -> Path:
        if page not in made:
            made[page] = scratch(tmp_path_factory.mktemp(page.stem))
        return made[page]
    return directory


@SINGLE
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_block_runs_as_written(block, page_directories):
    long = [LONG[c] for c in block.commands() if c in LONG]
    if long:
        pytest.skip(f"{block.name}: {long[0]}")
    venv = None
    if block.kind == "openmpi":
        venv = ROOT / ".venv-openmpi"
        if not (venv / "bin" / "mpirun").exists():
            pytest.skip("needs Open MPI's launcher: make install MPI=openmpi makes "
                        ".venv-openmpi")
    began = time.monotonic()
    ok, printed = run_block(block, page_directories(block.page), venv=venv)
    assert ok, f"{block.name} ({block.kind}, {time.monotonic() - began:.0f} s):\n{printed}"


def test_fragments_are_lines_of_the_program_they_link_to():
    fragments = [b for b in BLOCKS if b.kind == "fragment"]
    problems = [p for b in fragments for p in fragment_problems(b, BLOCKS)]
    assert fragments and not problems, "\n".join(problems)


def test_excerpts_of_a_program_are_marked_as_fragments():
    """A literalinclude of part of a Python file says so, and links to the whole."""
    partial = (":pyobject:", ":lines:", ":start-after:", ":start-at:", ":end-before:")
    unmarked = []
    for page in docs_blocks.PAGES:
        if page.suffix != ".rst":
            continue
        text = page.read_text(encoding="utf-8")
        for block in rst_blocks(page):
            body = "\n".join(text.splitlines()[block.line - 1:block.line + 6])
            if block.include.endswith(".py") and any(o in body for o in partial) \
                    and block.kind != "fragment":
                unmarked.append(block.name)
    assert not unmarked, unmarked


def test_every_python_block_and_launch_line_is_accounted_for():
    """Nothing Python or MPI is left unchecked: each block is run, or marked on its page."""
    kinds = {b.name: b.kind for b in BLOCKS}
    python = [b for b in BLOCKS if b.language in ("python", "default", "py")]
    launches = [b for b in BLOCKS if b.language in ("console", "bash")
                and any(word in b.code for word in ("mpiexec ", "mpirun ", "srun "))]
    # (a whole example file shown is a program tested by its own test file)
    unchecked = [b.name for b in python + launches
                 if b.kind not in ("program", "doctest", "commands", "openmpi", "fragment",
                                   "remote") and not b.include.startswith("../../examples/")]
    assert not unchecked, (
        f"{unchecked}: make each run as written here, or caption it on its page "
        f"(':caption: Fragment of :ref:`...`', or one starting {docs_blocks.REMOTE})")
    assert sum(k == "program" for k in kinds.values()) >= 16, kinds  # the programs today


@SINGLE
def test_a_block_edited_not_to_run_fails(tmp_path):
    """The harness on a temporary copy of the quickstart with one name misspelt."""
    page = ROOT / "docs" / "quickstart.rst"
    text = page.read_text(encoding="utf-8")
    assert "manager.get_tensor_parallel_rank()" in text
    copy = tmp_path / "quickstart.rst"
    copy.write_text(text.replace("manager.get_tensor_parallel_rank()",
                                 "manager.get_tensor_rank()", 1), encoding="utf-8")
    edited = [b for b in rst_blocks(copy) if "get_tensor_rank" in b.code]
    assert len(edited) == 1 and edited[0].kind == "program"
    ok, printed = run_block(edited[0], scratch(tmp_path / "run"))
    assert not ok and "AttributeError" in printed and "get_tensor_rank" in printed, printed


@SINGLE
def test_an_unmarked_cluster_command_and_a_wrong_flag_fail(tmp_path):
    page = tmp_path / "page.rst"
    page.write_text("""Title
=====

.. code-block:: console

   $ srun --mpi=pmix python -m pympar info

.. code-block:: console

   $ mpiexec -n 2 python -m pympar info --tp 3
""", encoding="utf-8")
    srun, wrong = rst_blocks(page)
    assert srun.kind == wrong.kind == "commands"
    for block in (srun, wrong):
        ok, printed = run_block(block, scratch(tmp_path / "run"), timeout=60)
        assert not ok, printed
    assert "world size 2 is not divisible" in printed, printed


def test_a_fragment_that_drifted_from_its_program_is_caught(tmp_path):
    page = tmp_path / "page.rst"
    page.write_text("""Title
=====

.. _whole:

.. code-block:: python

   # whole.py: mpiexec -n 2 python whole.py
   total = sum(range(10))
   print(total)

.. code-block:: python
   :caption: Fragment of :ref:`the whole program <whole>`

   total = sum(range(11))       # edited here, not in the program
   ...
   print(total)
""", encoding="utf-8")
    blocks = rst_blocks(page)
    problems = fragment_problems(blocks[1], blocks)
    assert problems == [f"{blocks[1].name}: 'total = sum(range(11))' is not a line of "
                        f"{blocks[0].name}"], problems
    assert blocks[0].stated_command() == ("whole.py", "mpiexec -n 2 python whole.py")


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted((ROOT / "pympar").rglob("*.py")):
        if ">>> " in path.read_text(encoding="utf-8"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@SINGLE
@pytest.mark.parametrize("module", _modules_with_examples())
def test_docstring_examples_of_the_api_pages_run(module):
    """The API pages show the docstrings' examples: they run (one rank) as shown."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS,
                             verbose=False, report=True)
    if not result.attempted:
        pytest.skip(f"{module}: every example is marked '# doctest: +SKIP' (a sketch)")
    assert not result.failed, result
