"""Every constant in the API reference has a docstring of its own (a ``#:`` comment where it
is documented), not the docstring of its type (``int``'s, for a re-exported number)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from mpi4py import MPI

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api"
_PLAIN = (int, float, str, bytes, tuple, frozenset, bool)


def _documented_data() -> list[str]:
    names = []
    for page in sorted(DOCS.glob("*.rst")):
        names += re.findall(r"^\.\. autodata:: (\S+)", page.read_text(), re.M)
        for module, members in re.findall(r"^\.\. automodule:: (\S+)\n((?:   :\S+:.*\n)*)",
                                          page.read_text(), re.M):
            listed = re.search(r":members:(.*)", members)
            if listed and listed.group(1).strip():
                names += [f"{module}.{m.strip()}" for m in listed.group(1).split(",")]
            elif listed:  # its __all__ (autodoc leaves out __dunder__ names)
                public = getattr(importlib.import_module(module), "__all__", [])
                names += [f"{module}.{m}" for m in public if not m.startswith("__")]
    return names


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="a static check of the sources: "
                    "runs in the pass without a launcher")
@pytest.mark.mpi(min_size=1)
def test_every_documented_constant_has_its_own_docstring():
    analyzer = pytest.importorskip("sphinx.pycode").ModuleAnalyzer
    checked = []
    for name in _documented_data():
        module_name, attr = name.rsplit(".", 1)
        value = getattr(importlib.import_module(module_name), attr)
        if not isinstance(value, _PLAIN):
            continue  # objects (mappings, functions) carry their own __doc__
        docs = analyzer.for_module(module_name).find_attr_docs()
        checked.append(name)
        assert ("", attr) in docs, f"{name} has no #: comment in {module_name}"
    assert "pympar.checkpoint.BUFFER_BYTES" in checked, checked
