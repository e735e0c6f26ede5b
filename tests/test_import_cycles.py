"""No pympar module imports another that imports it back (read from the sources).

Every ``import`` and ``from ... import`` anywhere in a module counts, inside functions too;
a package's ``__init__`` importing its own submodules is how it re-exports them, not a
cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mpi_helpers import WORLD

ROOT = Path(__file__).resolve().parent.parent / "pympar"

pytestmark = pytest.mark.skipif(WORLD.Get_size() > 1, reason="reads files; one rank is enough")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pympar modules ``name`` imports (a name imported from a package counts as its
    submodule when there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif source in modules:
                    found.add(source)
    return found - {name}


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["pympar.halo"] >= {"pympar._halo_plan", "pympar.decomposition"}  # it reads
    both_ways = sorted((a, b) for a in graph for b in graph[a]
                       if a < b and a in graph[b] and not b.startswith(a + "."))
    assert both_ways == [], f"modules that import each other: {both_ways}"
