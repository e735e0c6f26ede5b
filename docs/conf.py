"""Sphinx configuration of the pympar documentation.

Build with ``make docs`` or, from the repository root,
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from urllib.parse import urlparse

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(DOCS, "_ext"))  # mathml, pagechecks

import pympar  # noqa: E402

project = "pympar"
author = "the pympar developers"
copyright = "the pympar developers, MIT license"
release = pympar.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "mathml",       # maths as MathML, drawn by the browser: no script, no network
    "pagechecks",   # the built pages load nothing from another host; code fits the column
]
html_math_renderer = "mathml"

# Links into the Python, NumPy and mpi4py docs. Their inventories are fetched when the
# sites can be reached; offline, a copy saved as _inventories/<name>.inv is used
# instead, and without one that mapping is left out (an unfetchable inventory is a
# warning, and -W makes warnings errors: the build must pass without network).
INTERSPHINX = {
    "python": "https://docs.python.org/3",
    "numpy": "https://numpy.org/doc/stable",
    "mpi4py": "https://mpi4py.readthedocs.io/en/stable",
}
INVENTORIES = os.path.join(DOCS, "_inventories")


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the URL's host can be opened (DNS and route)."""
    try:
        socket.create_connection((urlparse(url).hostname, 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def intersphinx_for(reachable=_reachable) -> dict[str, tuple[str, str | None]]:
    """The intersphinx mapping this build can honour: fetched, local copy, or left out."""
    mapping: dict[str, tuple[str, str | None]] = {}
    for name, url in INTERSPHINX.items():
        local = os.path.join(INVENTORIES, f"{name}.inv")
        # PYMPAR_DOCS_OFFLINE=1 builds as if there were no network (the tests do).
        if os.environ.get("PYMPAR_DOCS_OFFLINE") != "1" and reachable(url):
            mapping[name] = (url, None)
        elif os.path.isfile(local):
            mapping[name] = (url, local)
    return mapping


intersphinx_mapping = intersphinx_for()
intersphinx_timeout = 10

autodoc_member_order = "bysource"
# Defaults as written in the source (``xp=np``), not their repr (a module's path on the
# machine that built the pages).
autodoc_preserve_defaults = True
# With automodule :members:, numpydoc's own member tables would describe every
# method a second time.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

exclude_patterns = ["_build", "_generated", "_inventories"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_title = f"pympar {release}"
html_theme_options = {
    "description": "MPI-native DP, CP, TP and 3D tensor parallelism for NumPy and CuPy",
    "fixed_sidebar": True,
    # 880 px of text, 856 of it code: lines of pagechecks.CODE_COLUMNS (88) characters
    # fit whole (measured in Chromium: 88 characters of DejaVu Sans Mono take 810 px).
    # The basic theme caps the body at 800 px otherwise.
    "page_width": "1160px",
    "body_max_width": "none",
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


def _without_launcher() -> dict[str, str]:
    """The environment minus a launcher's variables, so a child starts a job of its own."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_COMM_WORLD", "OMPI_MCA_ess",
                "OMPI_MCA_orte", "OMPI_MCA_pmix", "OMPI_FILE_LOCATION", "PRTE_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(mpiexec):
        env.setdefault("MPIEXEC", mpiexec)
    env.setdefault("PYMPAR_LAUNCH_TIMEOUT", "120")
    return env


def _generate() -> None:
    """Write the pages' tool output into _generated/: what the tool prints today.

    ``cli.txt`` is the help of every command; ``info.txt`` is ``python -m
    pympar info --tp 2`` run on 4 ranks (on 1 rank when no launcher works).
    """
    from pympar.__main__ import reference_text

    out = os.path.join(DOCS, "_generated")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cli.txt"), "w", encoding="utf-8") as f:
        f.write(reference_text())
    tool = [sys.executable, "-m", "pympar", "info"]
    attempts = [("$ mpiexec -n 4 python -m pympar info --tp 2",
                 [os.path.join(ROOT, "scripts", "mpirun.sh"), "4", *tool, "--tp", "2"]),
                ("$ python -m pympar info", tool)]
    for shown, command in attempts:
        done = subprocess.run(command, cwd=ROOT, env=_without_launcher(), capture_output=True,
                              text=True, timeout=180)
        if done.returncode == 0:
            break
    else:
        raise RuntimeError(f"python -m pympar info failed:\n{done.stdout}\n{done.stderr}")
    with open(os.path.join(out, "info.txt"), "w", encoding="utf-8") as f:
        f.write(f"{shown}\n{done.stdout}")


def mapping_signature(app, what, name, obj, options, signature, return_annotation):
    """The call signature of a layout mapping, from the keywords its forward step takes
    (a mapping is an object whose ``__call__`` takes ``**options``)."""
    import inspect

    from pympar.mappings import Mapping

    if not isinstance(obj, Mapping):
        return None
    step = obj._step
    keywords = inspect.signature(step).parameters
    shown = ["x", "group=None", "*", "out=None"]
    if step.gathered is not None:
        shown.append("global_size=None")
    shown += [f"{name}={keywords[name].default!r}" for name in keywords
              if name in step.options]
    return f"({', '.join(shown)})", None


def setup(app) -> None:
    """Sphinx hook: draw the pictures and run the tools before the pages are read."""
    app.connect("autodoc-process-signature", mapping_signature)
    _draw_layouts()
    _generate()
