"""No pympar module imports another that imports it back, nor any longer cycle
(``scripts/import_cycles.py``, from the sources: every import, those inside functions too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpi_helpers import WORLD

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(WORLD.Get_size() > 1, reason="reads files; one rank is enough")


def cycles(package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "import_cycles.py"),
                           package.name], cwd=package.parent, capture_output=True, text=True,
                          timeout=120)


def test_pympar_has_no_import_cycle():
    found = cycles(REPO / "pympar")
    assert found.returncode == 0, found.stdout + found.stderr
    assert "mutual imports: none" in found.stdout


def test_a_module_importing_its_importer_back_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    found = cycles(package)
    assert found.returncode == 1
    assert "('pkg.a', 'pkg.b')" in found.stdout
