"""Comparing checkpoints on disk, for the examples' resume tests."""

from __future__ import annotations

import json
import os

import numpy as np


def differing_tensors(a: str, b: str) -> list[str]:
    """Names of the tensors whose bytes differ between checkpoint directories ``a`` and ``b``
    (``a``'s manifest names them)."""
    manifest = json.load(open(os.path.join(a, "manifest.json")))
    return [name for name, e in manifest["tensors"].items()
            if np.load(os.path.join(a, e["file"])).tobytes()
            != np.load(os.path.join(b, e["file"])).tobytes()]
