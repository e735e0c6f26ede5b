"""The pages say what the code and the packaging do, render offline, and fit the column.

- installing: every extra of setup.cfg with its packages, and every dependency;
- gpus and installing: the ``CUDA-aware MPI`` line in the words ``python -m pympar info``
  prints;
- the API reference: a page for every public module, the mappings' documented
  parameters those of their call signature, defaults as written;
- the build's own checks (docs/_ext): maths converted without a script or network, and
  pages that load something from another host or hold a code line wider than the column
  flagged (a warning, so an error under ``make docs``'s ``-W``).
"""

from __future__ import annotations

import configparser
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import docs_blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                            reason="checks of files and of one-rank runs: in the pass "
                                   "without a launcher")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package_name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0]


def test_installing_lists_every_extra_and_dependency():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    page = (DOCS / "installing.rst").read_text(encoding="utf-8")
    table = page[page.index("extra          installs"):page.index("MPI from PyPI wheels")]
    rows = re.split(r"\n(?=``\w+``)", table)
    problems = []
    for extra, packages in setup["options.extras_require"].items():
        row = next((r for r in rows if r.startswith(f"``{extra}``")), None)
        if row is None:
            problems.append(f"extra {extra} is not in the table")
            continue
        problems += [f"extra {extra}: {p} not in its row" for p in
                     map(_package_name, filter(str.strip, packages.splitlines()))
                     if f"``{p}``" not in row]
    needs = " ".join(page[:page.index("What differs")].split())
    names = {"numpy": "NumPy", "mpi4py": "mpi4py", "xxhash": "xxhash"}
    for requirement in filter(str.strip, setup["options"]["install_requires"].splitlines()):
        name, version = _package_name(requirement), requirement.split(">=")[1].strip()
        shown = f"{names.get(name, name)} {version} or newer"
        if shown not in needs:
            problems.append(f"'{shown}' is not in the needs: {needs[:200]}")
    assert not problems, problems


def _info(aware: str) -> str:
    env = docs_blocks.environment()
    env["PYMPAR_CUDA_AWARE"] = aware
    done = subprocess.run([sys.executable, "-m", "pympar", "info"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return next(line for line in done.stdout.splitlines() if line.startswith("CUDA-aware"))


@SINGLE
def test_pages_quote_the_cuda_aware_line_as_info_prints_it():
    lines = {aware: _info(aware) for aware in ("0", "1")}
    said = " ".join(lines.values())
    assert "CuPy arrays use host staging (PYMPAR_CUDA_AWARE=0)" in lines["0"], lines
    assert "CuPy arrays use device buffers to MPI (PYMPAR_CUDA_AWARE=1)" in lines["1"], lines
    answer = re.search(r"library says (\w+);", said).group(1)
    answers = {"yes", "no", "unknown"}
    assert answer in answers, said
    for page, start in (("howto/gpus.rst", "The ``CUDA-aware MPI`` line says"),
                        ("installing.rst", "``yes``, ``no`` or ``unknown``")):
        text = (DOCS / page).read_text(encoding="utf-8")
        paragraph = text[text.index(start):].split("\n\n")[0]
        quoted = [" ".join(q.split()) for q in re.findall(r"``([^`]+)``", paragraph)]
        # A quote of another answer than this library's stands for the same line.
        wrong = [q for q in quoted if q not in answers | {"CUDA-aware MPI"}
                 and re.sub(r"\b(yes|no|unknown)$", answer, q) not in said]
        assert quoted and not wrong, (page, wrong, lines)
        assert "``True``" not in text and "(``on``)" not in text, page


def _public_modules() -> list[str]:
    package = ROOT / "pympar"
    found = ["pympar"]
    for path in sorted(package.iterdir()):
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("_") or (path.is_dir() and not (path / "__init__.py").exists()):
            continue
        if path.suffix == ".py" or path.is_dir():
            found.append(f"pympar.{name}")
    return found


def test_every_public_module_has_an_api_page():
    pages = " ".join(p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.rst"))
    documented = set(re.findall(r"automodule:: (\S+)", pages))
    index = (DOCS / "api" / "index.rst").read_text(encoding="utf-8")
    missing = [m for m in _public_modules() if m not in documented]
    unlisted = [p.stem for p in (DOCS / "api").glob("*.rst")
                if p.stem != "index" and f"\n   {p.stem}\n" not in index]
    assert "pympar.partition" in _public_modules() and not missing and not unlisted, \
        (missing, unlisted)


@pytest.fixture(scope="module")
def conf():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYMPAR_DOCS_OFFLINE", "1")  # no reachability probe on load
        return _load(DOCS / "conf.py", "docs_conf_truth")


def test_mapping_docstrings_document_their_call_signatures(conf):
    from numpydoc.docscrape import FunctionDoc

    from pympar import mappings

    shown = {}
    for mapping in mappings.MAPPINGS:
        signature, _ = conf.mapping_signature(None, "function", mapping.name, mapping, {},
                                              None, None)
        names = [p.split("=")[0] for p in signature.strip("()").split(", ") if p != "*"]
        documented = [p.name for p in FunctionDoc(None, doc=mapping.__doc__)["Parameters"]]
        shown[mapping.name] = (names, documented)
    assert all(names == documented for names, documented in shown.values()), shown
    # The keywords a mapping takes come from its steps: the all-to-all pair's axes.
    assert shown["all_to_all_from_sequence_to_hidden"][0][-2:] == ["seq_axis", "head_axis"]
    assert "global_size" not in shown["copy_to_all"][0]
    assert conf.autodoc_preserve_defaults is True  # HaloExchange.empty(..., xp=np)


def _formulas() -> list[str]:
    found = []
    for page in DOCS.rglob("*.rst"):
        text = page.read_text(encoding="utf-8")
        found += re.findall(r":math:`([^`]+)`", text)
        for body in re.findall(r"^\.\. math::\n\n((?:   .*\n|\n)+)", text, re.M):
            found += [part.strip() for part in body.split("\n\n") if part.strip()]
    return found


def test_every_formula_becomes_mathml_and_others_are_refused():
    mathml = _load(DOCS / "_ext" / "mathml.py", "docs_mathml")
    formulas = _formulas()
    assert len(formulas) >= 15, formulas
    for tex in formulas:
        out = mathml.to_mathml(tex, display=True)
        assert out.startswith("<math") and "<mfrac>" in out or "\\frac" not in tex, tex
        assert "\\" not in re.sub(r"<annotation.*?</annotation>", "", out, flags=re.S), (tex, out)
    fraction = mathml.to_mathml(r"V_{\text{1D}} = 4\,\frac{t-1}{t}")
    assert ("<msub><mi>V</mi><mrow><mtext>1D</mtext></mrow></msub>" in fraction
            and "<mfrac><mrow><mi>t</mi><mo>\u2212</mo><mn>1</mn></mrow><mrow><mi>t</mi></mrow>"
            in fraction), fraction
    with pytest.raises(ValueError, match=r"\\oint is not supported"):
        mathml.to_mathml(r"\oint f")
    with pytest.raises(ValueError, match="ends too early"):
        mathml.to_mathml(r"\frac{1}")


def test_the_build_flags_remote_loads_and_wide_code(tmp_path):
    checks = _load(DOCS / "_ext" / "pagechecks.py", "docs_pagechecks")
    wide = "x = 1  # " + "y" * checks.CODE_COLUMNS
    (tmp_path / "bad.html").write_text(
        '<script src="https://cdn.example/mathjax/tex-chtml.js"></script>'
        '<link rel="stylesheet" href="//fonts.example/f.css">'
        f'<a href="https://example.org">a link to follow</a><pre>{wide}</pre>'
        '<dt class="sig sig-object py"><span>empty</span>(<em>xp=&lt;module &#39;numpy&#39; '
        'from &#39;/home/me/numpy/__init__.py&#39;&gt;</em>)</dt>')
    (tmp_path / "_modules").mkdir()
    (tmp_path / "_modules" / "source.html").write_text(f"<pre>{wide}</pre>")
    (tmp_path / "good.html").write_text(
        '<script src="_static/doctools.js"></script>'
        f'<pre>{"z" * checks.CODE_COLUMNS}</pre><dt class="sig sig-object py">'
        '<span>empty</span>(<em>xp=np</em>)</dt>')
    problems = checks.check_pages(tmp_path)
    assert len(problems) == 4 and all(p.startswith("bad.html: ") for p in problems), problems
    assert "https://cdn.example/mathjax/tex-chtml.js" in problems[0]
    assert "//fonts.example/f.css" in problems[1] and "repr: empty(xp=<module" in problems[2]
    assert "wider than the column" in problems[3]


def test_the_docs_build_uses_the_offline_maths_and_the_checks(conf):
    assert "sphinx.ext.mathjax" not in conf.extensions
    assert {"mathml", "pagechecks"} <= set(conf.extensions)
    assert conf.html_math_renderer == "mathml"
