"""Which JSON each benchmark plot is drawn from, recorded in the PNG and checked against it.

:func:`metadata` gives the PNG text entry that :mod:`benchmarks.report` writes into every
plot (``savefig(metadata=...)`` stores it as a ``tEXt`` chunk): the SHA-256 of the bytes of
each JSON file the plot was drawn from. :func:`stale_plots` reads it back with a small
standard-library PNG reader and names every plot whose JSON has changed since, or that
records none, so that a plot committed beside newer JSON fails the test suite.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

__all__ = ["KEY", "PLOT_SOURCES", "metadata", "png_text", "recorded_sources", "stale_plots"]

#: The PNG text keyword holding ``{json file name: sha256 hex digest}`` as JSON.
KEY = "pympar-sources"
#: Per plot, the JSON files (in the results folder) that it is drawn from.
PLOT_SOURCES: dict[str, tuple[str, ...]] = {
    "mappings.png": ("mappings.json",),
    "torch_comm.png": ("torch_comm.json",),
    "mlp.png": ("mlp.json",),
    "comm_volume.png": ("comm_volume_8.json", "comm_volume_27.json"),
    "attention_memory.png": ("attention.json",),
    "checkpoint.png": ("checkpoint.json",),
}

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _digests(folder: Path, names: tuple[str, ...]) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in names if (folder / name).is_file()}


def metadata(folder: Path, plot: str) -> dict[str, str]:
    """The ``savefig(metadata=...)`` entries of ``plot``: the digests of its JSON sources.

    Parameters
    ----------
    folder : Path
        The results folder holding the JSON files.
    plot : str
        The PNG's file name, a key of :data:`PLOT_SOURCES`; another plot records no
        sources (and :func:`stale_plots` reports it until it is added there).
    """
    sources = PLOT_SOURCES.get(plot, ())
    return {KEY: json.dumps(_digests(Path(folder), sources), sort_keys=True),
            "Software": None}


def png_text(path: Path) -> dict[str, str]:
    """The text chunks (``tEXt``, ``zTXt``, ``iTXt``) of a PNG file, keyword -> text.

    Raises
    ------
    ValueError
        When the file is not a PNG or a chunk is cut short.
    """
    data = Path(path).read_bytes()
    if not data.startswith(_SIGNATURE):
        raise ValueError(f"{path}: not a PNG file")
    out, pos = {}, len(_SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if len(body) != length:
            raise ValueError(f"{path}: chunk {kind!r} is cut short")
        pos += 12 + length  # length, type, data, CRC
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            out[key.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")  # language tag
            _, _, text = rest.partition(b"\0")  # translated keyword
            out[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode()
        elif kind == b"IEND":
            break
    return out


def recorded_sources(path: Path) -> dict[str, str] | None:
    """``{json file name: sha256}`` recorded in a plot, or None when it records nothing."""
    text = png_text(path).get(KEY)
    return None if text is None else json.loads(text)


def stale_plots(folder: Path) -> list[str]:
    """Every PNG of ``folder`` not drawn from the JSON beside it, each with the reason.

    A plot is stale when it records no sources, records none of the files that
    :data:`PLOT_SOURCES` names for it, or records a digest that the file no longer has
    (or a file that is gone); a plot :data:`PLOT_SOURCES` does not know is reported too.
    """
    folder, out = Path(folder), []
    for png in sorted(folder.glob("*.png")):
        if png.name not in PLOT_SOURCES:
            out.append(f"{png.name}: no JSON is known to draw it (benchmarks.plot_sources)")
            continue
        recorded = recorded_sources(png)
        if not recorded:
            out.append(f"{png.name}: records no JSON digest (drawn by an older report)")
            continue
        now = _digests(folder, PLOT_SOURCES[png.name])
        if recorded != now:
            changed = sorted(n for n in set(recorded) | set(now) if recorded.get(n) != now.get(n))
            out.append(f"{png.name}: drawn from other contents of {', '.join(changed)}")
    return out
