"""Checkpoints in the serial layout: save from any layout, load under any other.

A checkpoint is a directory of plain ``.npy`` files, one per logical tensor (the full serial
array of each parameter and optimizer moment), and ``manifest.json`` written last; a serial
NumPy program can read it with ``numpy.load(f, allow_pickle=False, mmap_mode="r")``. See
:func:`save`, :func:`load` and :func:`latest`, and the format in
:mod:`pympar.checkpoint.format`.
"""

from . import api
from .api import latest, load, save
from .format import FORMAT, MANIFEST, VERSION, CheckpointError

# Named here, not only re-exported, so that the API reference shows this docstring
# instead of int's.
#: Bytes of the host staging buffer each rank uses for a save or a load (8 MiB).
BUFFER_BYTES = api.BUFFER_BYTES

__all__ = ["save", "load", "latest", "CheckpointError", "BUFFER_BYTES", "FORMAT", "VERSION",
           "MANIFEST"]
