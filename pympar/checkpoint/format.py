"""The on-disk format of a checkpoint: the manifest, the ``.npy`` headers, stored dtypes.

A checkpoint is a directory with one C-order ``.npy`` file per logical tensor (the full
serial-layout array) and ``manifest.json``, written last::

    {"format": "pympar-checkpoint", "version": 2, "step": 100, "extra": {...},
     "optimizer": {"type": "AdamW", "hyperparameters": {...}, "steps": {name: int}} or null,
     "tensors": {name: {"file": "t00000.npy", "shape": [...], "dtype": "float32",
                        "chunk_bytes": 262144, "xxh3_64": ["0123456789abcdef", ...]}}}

``xxh3_64`` lists the xxHash3-64 digest of each ``chunk_bytes``-long chunk of the file's data
(everything after the header; the last chunk may be shorter; none for an empty array).
Version 1 (still read) had one ``"checksum": "adler32:0a1b2c3d"`` per tensor instead: Adler-32
of the whole data.

Nothing here trusts the manifest: every file name, dtype and shape is checked before a byte
of tensor data is read, and every header is compared with its manifest entry.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

import numpy as np
from numpy.lib import format as npformat

from .. import backend
from ..backend import is_bfloat16

__all__ = ["FORMAT", "VERSION", "MANIFEST", "CHUNK_BYTES", "CheckpointError", "stored_dtype",
           "logical_dtype", "npy_header", "parse_manifest", "check_header", "chunk_count",
           "hex_digests"]

FORMAT = "pympar-checkpoint"
#: The version :func:`~pympar.checkpoint.save` writes; :func:`~pympar.checkpoint.load` also
#: reads version 1 (Adler-32 checksums).
VERSION = 2
MANIFEST = "manifest.json"
#: Bytes of data per xxHash3-64 digest in a checkpoint of version 2.
CHUNK_BYTES = 256 * 1024
#: The largest ``chunk_bytes`` a manifest may declare (a chunk's tail is read in one piece).
_CHUNK_LIMIT = 64 * 2**20
_HEX = re.compile(r"[0-9a-f]*")
_ENTRY_KEYS = {1: {"file", "shape", "dtype", "checksum"},
               2: {"file", "shape", "dtype", "chunk_bytes", "xxh3_64"}}

#: Logical dtypes a checkpoint may hold (bool, integers, floats, complex, bfloat16).
_KINDS = "biufc"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; raised on every rank with the same message."""


def logical_name(dtype: Any) -> str:
    """The manifest's name of a dtype (``"bfloat16"`` for ml_dtypes' bfloat16)."""
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return "bfloat16"
    return dtype.name


def stored_dtype(dtype: Any) -> np.dtype:
    """The dtype written to the file: bfloat16 travels as little-endian uint16."""
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return np.dtype("<u2")
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"dtype {dtype} cannot be checkpointed (need bool, integer, "
                              "float, complex or bfloat16)")
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def logical_dtype(name: Any, what: str) -> np.dtype:
    """The dtype a manifest names, refused unless plain numeric (or ``"bfloat16"``)."""
    if name == "bfloat16":
        if backend.bfloat16 is None:  # ml_dtypes is imported here, on first need
            raise CheckpointError(f"tensor {what!r} is bfloat16 and ml_dtypes is not installed")
        return backend.bfloat16
    try:
        if not isinstance(name, str):
            raise TypeError
        dtype = np.dtype(name)
    except TypeError:
        raise CheckpointError(f"tensor {what!r}: dtype {name!r} is not a dtype name") from None
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.name != name:
        raise CheckpointError(f"tensor {what!r}: dtype {name!r} is refused (object, structured "
                              "or unknown dtypes are never loaded)")
    return dtype


def chunk_count(total: int, chunk: int = CHUNK_BYTES) -> int:
    """The number of digests of ``total`` data bytes in chunks of ``chunk`` bytes."""
    return -(-int(total) // int(chunk))


def hex_digests(digests: np.ndarray) -> list[str]:
    """The manifest's form of a file's digests: one 16-digit lowercase hex string each."""
    return [f"{int(d):016x}" for d in digests]


def _parse_digests(value: Any, count: int, what: str) -> np.ndarray:
    """A manifest's digest list as uint64, refused unless ``count`` 16-digit hex strings."""
    try:  # join, map and one flat match run in C: a GiB of data has 4096 digests
        text = "".join(value) if isinstance(value, list) and len(value) == count else None
        lengths = set(map(len, value)) if text is not None else None
    except TypeError:  # an entry that is not a string
        text = None
    if text is None or lengths - {16}:
        raise CheckpointError(f"tensor {what!r}: 'xxh3_64' must be a list of {count} 16-digit "
                              "hex strings (one per chunk)")
    if not _HEX.fullmatch(text):  # every entry is 16 characters long (checked above)
        raise CheckpointError(f"tensor {what!r}: 'xxh3_64' holds a value that is not lowercase "
                              "hex")
    return np.frombuffer(bytes.fromhex(text), dtype=">u8").astype(np.uint64)


def _parse_checksum(entry: dict[str, Any], version: int, name: str) -> None:
    """Check an entry's checksum fields; set ``adler32`` (version 1) or ``chunk_bytes`` and
    ``digests`` (version 2)."""
    if version == 1:
        checksum = entry["checksum"]
        if not (isinstance(checksum, str) and re.fullmatch("adler32:[0-9a-f]{8}", checksum)):
            raise CheckpointError(f"tensor {name!r}: checksum {checksum!r} is not adler32:<8 hex>")
        entry["adler32"] = int(checksum[8:], 16)
        return
    chunk = entry["chunk_bytes"]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 < chunk <= _CHUNK_LIMIT:
        raise CheckpointError(f"tensor {name!r}: chunk_bytes {chunk!r} is not a size between 1 "
                              f"and {_CHUNK_LIMIT}")
    total = math.prod(entry["shape"]) * entry["stored"].itemsize
    entry["digests"] = _parse_digests(entry["xxh3_64"], chunk_count(total, chunk), name)


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The complete ``.npy`` header (magic, length, dict, padding) for a C-order array.

    Version 1.0 of the format (2.0 when the dict needs more than 65535 bytes); the data that
    follows starts at a multiple of 64 bytes, as NumPy writes it.
    """
    shape = tuple(int(n) for n in shape)
    text = (f"{{'descr': {npformat.dtype_to_descr(dtype)!r}, 'fortran_order': False, "
            f"'shape': {shape!r}, }}")
    for major, length_bytes in ((1, 2), (2, 4)):
        fixed = len(npformat.MAGIC_PREFIX) + 2 + length_bytes
        pad = -(fixed + len(text) + 1) % 64
        body = (text + " " * pad + "\n").encode("latin1")
        if len(body) < 256 ** length_bytes:
            return (npformat.MAGIC_PREFIX + bytes([major, 0])
                    + len(body).to_bytes(length_bytes, "little") + body)
    raise CheckpointError(f"shape {shape} is too long for a .npy header")


def _check_name(directory: str, name: str, what: str) -> str:
    """The path of a manifest file entry, refused unless a plain ``.npy`` inside ``directory``."""
    if (not isinstance(name, str) or not name.endswith(".npy") or os.sep in name
            or (os.altsep and os.altsep in name) or name in (".", "..") or name.startswith(".")
            or os.path.isabs(name) or "\0" in name):
        raise CheckpointError(f"tensor {what!r}: file {name!r} is refused (must be a plain .npy "
                              "name inside the checkpoint directory)")
    path = os.path.join(directory, name)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"tensor {what!r}: file {name!r} is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"tensor {what!r}: file {name!r} is not a regular file (links are "
                              "refused)")
    return path


def parse_manifest(directory: str, text: bytes) -> dict[str, Any]:
    """Check a manifest's structure; return it with ``path``/``dtype``/``shape`` resolved.

    Raises
    ------
    CheckpointError
        On anything but a well-formed manifest of this format's version whose files are plain
        ``.npy`` files inside ``directory``.
    """
    try:
        manifest = json.loads(text)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{MANIFEST} is not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{MANIFEST} is not a {FORMAT} manifest")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in _ENTRY_KEYS:
        raise CheckpointError(f"checkpoint format version {version!r} is not supported (this "
                              f"pympar reads versions {', '.join(map(str, _ENTRY_KEYS))})")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{MANIFEST}: 'tensors' must be an object")
    step = manifest.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointError(f"{MANIFEST}: 'step' must be an integer or null, got {step!r}")
    files = set()
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS[version]:
            raise CheckpointError(f"tensor {name!r}: a version {version} manifest entry must "
                                  f"have exactly {', '.join(sorted(_ENTRY_KEYS[version]))}")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise CheckpointError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if entry["file"] in files:
            raise CheckpointError(f"tensor {name!r}: file {entry['file']!r} is named twice")
        files.add(entry["file"])
        entry["path"] = _check_name(directory, entry["file"], name)
        entry["logical"] = logical_dtype(entry["dtype"], name)
        entry["stored"] = stored_dtype(entry["logical"])
        entry["shape"] = tuple(shape)
        _parse_checksum(entry, version, name)
    return manifest


def check_header(entry: dict[str, Any], name: str) -> int:
    """Compare a ``.npy`` file's header with its manifest entry; return the data offset.

    A header byte for byte equal to the one :func:`npy_header` writes for the entry is
    accepted as it is; any other is parsed with NumPy's own reader (a literal, never
    evaluated code) and compared. The file must hold exactly the data its shape and dtype
    need (a truncated file is refused).
    """
    path = entry["path"]
    expected = npy_header(entry["shape"], entry["stored"])
    need = len(expected) + math.prod(entry["shape"]) * entry["stored"].itemsize
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == need and f.read(len(expected)) == expected:
                return len(expected)
            f.seek(0)
            version = npformat.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npformat.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = npformat.read_array_header_2_0(f)
            else:
                raise ValueError(f"npy version {version}")
            offset = f.tell()
            size = os.fstat(f.fileno()).st_size
    except (ValueError, OSError) as err:
        raise CheckpointError(f"tensor {name!r}: {entry['file']} is not a plain .npy file "
                              f"({err})") from None
    if fortran or tuple(shape) != entry["shape"] or dtype != entry["stored"]:
        raise CheckpointError(f"tensor {name!r}: the header of {entry['file']} (shape "
                              f"{tuple(shape)}, dtype {dtype}, fortran_order {fortran}) disagrees "
                              f"with the manifest (shape {entry['shape']}, dtype "
                              f"{entry['stored']})")
    need = offset + math.prod(entry["shape"]) * entry["stored"].itemsize
    if size != need:
        raise CheckpointError(f"tensor {name!r}: {entry['file']} holds {size} bytes, its header "
                              f"needs {need} (truncated or padded file)")
    return offset
