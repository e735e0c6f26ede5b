"""Sphinx configuration of the pympar documentation.

Build with ``make docs`` or, from the repository root,
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)

import pympar  # noqa: E402

project = "pympar"
author = "the pympar developers"
copyright = "the pympar developers, MIT license"
release = pympar.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "numpydoc",
]

# The build machines have no network: intersphinx stays loaded but maps nothing.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

autodoc_member_order = "bysource"
# With automodule :members:, numpydoc's own member tables would describe every
# method a second time.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_title = f"pympar {release}"
html_theme_options = {
    "description": "MPI-native DP, CP, TP and 3D tensor parallelism for NumPy and CuPy",
    "fixed_sidebar": True,
}


def _draw_layouts() -> None:
    """Redraw the layout pictures from the rank math of the code (needs matplotlib).

    Without matplotlib the committed PNGs in ``_static`` are used as they are.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return
    path = os.path.join(ROOT, "scripts", "draw_layouts.py")
    spec = importlib.util.spec_from_file_location("draw_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(os.path.join(DOCS, "_static"))


_draw_layouts()
