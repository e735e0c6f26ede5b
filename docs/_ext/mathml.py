"""Maths rendered at build time as MathML, which browsers draw themselves: no script, no
network (a cluster's login node often reaches neither a CDN nor anything else).

Converts the subset of TeX these pages use: letters, digits and operators; ``_`` and
``^``; ``{...}`` groups; ``\\frac``, ``\\text``, ``\\left ... \\right``; the spaces ``\\,``,
``\\ ``, ``\\quad``, ``\\qquad``; and the symbols of :data:`SYMBOLS`. Anything else is
refused with a build warning (an error under ``-W``) naming the command, so a formula is
never shown half converted: add the command here first.
"""

from __future__ import annotations

import re
from html import escape

from docutils import nodes

__all__ = ["to_mathml", "SYMBOLS", "setup"]

#: TeX commands drawn as one operator or identifier: name -> (MathML element, character).
SYMBOLS = {
    "cdot": ("mo", "\u22c5"), "times": ("mo", "\u00d7"), "approx": ("mo", "\u2248"),
    "le": ("mo", "\u2264"), "ge": ("mo", "\u2265"), "ne": ("mo", "\u2260"),
    "langle": ("mo", "\u27e8"), "rangle": ("mo", "\u27e9"), "sum": ("mo", "\u2211"),
    "pi": ("mi", "\u03c0"), "nu": ("mi", "\u03bd"), "Delta": ("mi", "\u0394"),
    "to": ("mo", "\u2192"),
}
#: Spaces: name -> width.
SPACES = {",": "0.1667em", " ": "0.25em", "quad": "1em", "qquad": "2em"}
_TOKEN = re.compile(r"\\([A-Za-z]+|.)|(\d+(?:\.\d+)?)|([A-Za-z])|(\s+)|(.)", re.S)


class _Parser:
    """A recursive descent over the tokens of one formula."""

    def __init__(self, tex: str) -> None:
        self.tex = tex
        # (text, kind: 1 command, 2 number, 3 letter, 5 other; value, start offset)
        self.tokens = [(m.group(0), m.lastindex, m.group(m.lastindex), m.start())
                       for m in _TOKEN.finditer(tex) if m.lastindex != 4]
        self.at = 0

    def peek(self) -> str | None:
        return self.tokens[self.at][0] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, int, str, int]:
        if self.at >= len(self.tokens):
            raise ValueError(f"the formula ends too early: {self.tex!r}")
        self.at += 1
        return self.tokens[self.at - 1]

    def sequence(self, closing: tuple[str, ...] = ()) -> str:
        """Atoms (with their scripts) up to a token of ``closing`` or the end."""
        parts = []
        while self.peek() is not None and self.peek() not in closing:
            parts.append(self.scripted())
        return "".join(parts)

    def scripted(self) -> str:
        base = self.atom()
        scripts = {}
        while self.peek() in ("_", "^"):
            mark = self.take()[0]
            if mark in scripts:
                raise ValueError(f"a double {mark} in {self.tex!r}")
            scripts[mark] = self.atom()
        if "_" in scripts and "^" in scripts:
            return f"<msubsup>{base}{scripts['_']}{scripts['^']}</msubsup>"
        if "_" in scripts:
            return f"<msub>{base}{scripts['_']}</msub>"
        if "^" in scripts:
            return f"<msup>{base}{scripts['^']}</msup>"
        return base

    def group(self) -> str:
        """A ``{...}`` group, as one row."""
        self.expect("{")
        inner = self.sequence(("}",))
        self.expect("}")
        return f"<mrow>{inner}</mrow>"

    def expect(self, token: str) -> None:
        if self.take()[0] != token:
            raise ValueError(f"expected {token!r} in {self.tex!r}")

    def raw_group(self) -> str:
        """The text of a ``{...}`` group as written, spaces kept (for ``\\text``)."""
        if self.peek() != "{":
            raise ValueError(f"expected {{ after \\text in {self.tex!r}")
        start = self.tokens[self.at][3]
        depth = 0
        for end in range(start, len(self.tex)):
            depth += {"{": 1, "}": -1}.get(self.tex[end], 0)
            if depth == 0:
                break
        while self.at < len(self.tokens) and self.tokens[self.at][3] <= end:
            self.at += 1
        return self.tex[start + 1:end]

    def atom(self) -> str:
        text, kind, value, _ = self.take()
        if text == "{":
            self.at -= 1
            return self.group()
        if kind == 1:
            return self.command(value)
        if kind == 2:
            return f"<mn>{value}</mn>"
        if kind == 3:
            return f"<mi>{value}</mi>"
        if text in "}^_":
            raise ValueError(f"unexpected {text!r} in {self.tex!r}")
        return f"<mo>{escape(text.replace('-', chr(0x2212)))}</mo>"  # a minus sign

    def command(self, name: str) -> str:
        if name == "frac":
            return f"<mfrac>{self.atom()}{self.atom()}</mfrac>"
        if name == "text":
            return f"<mtext>{escape(self.raw_group())}</mtext>"
        if name == "left":
            opening = self.take()[0]
            inner = self.sequence(("\\right",))
            self.expect("\\right")
            closing = self.take()[0]
            return (f'<mrow><mo stretchy="true">{escape(opening)}</mo>{inner}'
                    f'<mo stretchy="true">{escape(closing)}</mo></mrow>')
        if name in SPACES:
            return f'<mspace width="{SPACES[name]}"/>'
        if name in SYMBOLS:
            element, char = SYMBOLS[name]
            return f"<{element}>{char}</{element}>"
        raise ValueError(f"the TeX command \\{name} is not supported by docs/_ext/mathml.py "
                         f"(in {self.tex!r}): add it to SYMBOLS or SPACES there")


def to_mathml(tex: str, display: bool = False) -> str:
    """One formula of TeX as a ``<math>`` element.

    Parameters
    ----------
    tex : str
        The formula (the subset described in the module docstring).
    display : bool, default False
        A displayed formula (its own block) rather than one inside a line.

    Returns
    -------
    str
        The ``<math>`` element, with the TeX as its annotation.

    Raises
    ------
    ValueError
        For a command or construct outside the subset, naming it.
    """
    parser = _Parser(tex)
    body = parser.sequence()
    if parser.peek() is not None:
        raise ValueError(f"unbalanced {parser.peek()!r} in {tex!r}")
    mode = ' display="block"' if display else ""
    return (f'<math xmlns="http://www.w3.org/1998/Math/MathML"{mode}><semantics>'
            f"<mrow>{body}</mrow>"
            f'<annotation encoding="application/x-tex">{escape(tex)}</annotation>'
            f"</semantics></math>")


def _converted(translator, node: nodes.Node, tex: str, display: bool) -> str:
    try:
        return to_mathml(tex, display)
    except ValueError as err:
        from sphinx.util import logging
        logging.getLogger(__name__).warning(str(err), location=node)
        return f"<code>{escape(tex)}</code>"


def visit_math(translator, node: nodes.math) -> None:
    """An inline formula."""
    translator.body.append(translator.starttag(node, "span", "", CLASS="math"))
    translator.body.append(_converted(translator, node, node.astext(), False) + "</span>")
    raise nodes.SkipNode


def visit_displaymath(translator, node: nodes.math_block) -> None:
    """A displayed formula; blank lines separate several, one under the other."""
    translator.body.append(translator.starttag(node, "div", CLASS="math"))
    for part in (p for p in node.astext().split("\n\n") if p.strip()):
        translator.body.append(_converted(translator, node, part.strip(), True))
    translator.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app) -> dict:
    """Register the renderer as ``html_math_renderer = "mathml"``."""
    app.add_html_math_renderer("mathml", (visit_math, None), (visit_displaymath, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
