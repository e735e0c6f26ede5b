"""Checks of the built pages, run at the end of every HTML build (a warning each, so an
error under ``-W``): nothing is loaded from another host, no code line is wider than the
column, and no signature shows a default's repr (a path of the machine that built them).

A page that loads a script or a style sheet from the network shows raw TeX, or nothing, on
a cluster's node that cannot reach it. A code line wider than the column scrolls, and the
comments at its end are the first thing cut.
"""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

__all__ = ["CODE_COLUMNS", "external_assets", "wide_code_lines", "reprs_in_signatures",
           "check_pages", "setup"]

#: The widest code line the column shows whole: the theme's page is 1160 px wide
#: (conf.py), which leaves 856 px of code text; 88 characters of the 0.9 em monospace
#: (DejaVu Sans Mono, Menlo; Consolas is narrower) take 810 px.
CODE_COLUMNS = 88

_LOADING_TAG = re.compile(r"<(script|link|img|iframe|source)\b[^>]*>", re.I)
_ADDRESS = re.compile(r"""\b(src|href)\s*=\s*["']?([^"'\s>]+)""", re.I)
_LOADED_LINK = re.compile(r"""\brel\s*=\s*["']?[^"'>]*\b(stylesheet|preload|icon)""", re.I)
_PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
_SIGNATURE = re.compile(r"<dt class=\"sig[^\"]*\"[^>]*>(.*?)</dt>", re.S)
# A default shown as its repr: a module with its path on the machine that built the pages,
# a class, or an object's address.
_REPR = re.compile(r"<(module|class|function) '|object at 0x")
# The pages of the package's own source (viewcode) are listings of whole files, not the
# column of a page.
_NOT_CHECKED_FOR_WIDTH = ("_modules/",)


def external_assets(html: str) -> list[str]:
    """The addresses of scripts, style sheets, icons, images and frames a page loads from
    another host (``http:``, ``https:`` or ``//``); a link to follow is not a load."""
    found = []
    for match in _LOADING_TAG.finditer(html):
        tag, name = match.group(0), match.group(1).lower()
        if name == "link" and not _LOADED_LINK.search(tag):
            continue
        for _, address in _ADDRESS.findall(tag):
            if re.match(r"(https?:)?//", address, re.I):
                found.append(f"<{name}> {address}")
    return found


def wide_code_lines(html: str, columns: int = CODE_COLUMNS) -> list[str]:
    """The lines of the page's code blocks (``<pre>``) wider than ``columns`` characters."""
    lines = []
    for block in _PRE.findall(html):
        for line in unescape(_TAG.sub("", block)).splitlines():
            if len(line.rstrip()) > columns:
                lines.append(line.rstrip())
    return lines


def reprs_in_signatures(html: str) -> list[str]:
    """The API signatures of a page that show a default as its repr (``<module 'numpy'
    from '/home/...'>``) instead of as written."""
    shown = [" ".join(unescape(_TAG.sub("", sig)).split()) for sig in _SIGNATURE.findall(html)]
    return [sig for sig in shown if _REPR.search(sig)]


def check_pages(outdir: Path, columns: int = CODE_COLUMNS) -> list[str]:
    """Every problem of every HTML page under ``outdir``, one line each."""
    problems = []
    for page in sorted(Path(outdir).rglob("*.html")):
        name = page.relative_to(outdir).as_posix()
        html = page.read_text(encoding="utf-8")
        problems += [f"{name}: loads {asset} from another host (the pages must work "
                     f"offline)" for asset in external_assets(html)]
        problems += [f"{name}: a signature shows a default's repr: {sig[:80]}"
                     for sig in reprs_in_signatures(html)]
        if not name.startswith(_NOT_CHECKED_FOR_WIDTH):
            problems += [f"{name}: a code line of {len(line)} characters is wider than the "
                         f"column ({columns}): {line[:60]}..." for line in wide_code_lines(
                             html, columns)]
    return problems


def _after_build(app, error) -> None:
    if error is not None or app.builder.format != "html":
        return
    from sphinx.util import logging
    logger = logging.getLogger(__name__)
    for problem in check_pages(Path(app.outdir)):
        logger.warning(problem)


def setup(app) -> dict:
    """Run :func:`check_pages` when an HTML build has finished."""
    app.connect("build-finished", _after_build)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
