"""What travels between pipeline stages, byte for byte (private to :mod:`.transfer`).

Every array goes as two messages: a fixed-size *header* (what the sender is doing, which
micro-batch, the array's dtype and shape), then the *payload* (the array's bytes). A stage
ending its call sends a header too (kind ``DONE``), on the same tag as its data, so that a
neighbour still waiting for data meets it in order. A stage that raises sends each neighbour
an *abort* (kind and text) on a tag of its own, which every wait listens for.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

from .. import backend

#: Message tags on the transfer's own communicator: headers and payloads of each direction
#: (a header's payload is the next message on its payload tag), and the aborts.
FORWARD_HEADER, FORWARD_DATA, BACKWARD_HEADER, BACKWARD_DATA, ABORT = 61, 62, 63, 64, 65
TAGS = {"forward": (FORWARD_HEADER, FORWARD_DATA), "backward": (BACKWARD_HEADER, BACKWARD_DATA)}

#: Header kinds: an array follows; the sender ended its call.
DATA, DONE = 1, 2
#: Abort kinds: the neighbours' calls differ (CollectiveMismatchError everywhere); a stage
#: ended by an error, a timeout or the end of its program (PeerEndedError).
MISMATCH, ENDED = 1, 2

MAX_DIMS = 8
_MAGIC = 0x5050_4950  # "PPIP": a header of this protocol
# 512 bytes: 5 + MAX_DIMS numbers (magic, kind, signature, micro-batch, ndim, the shape),
# then the dtype's name (24 bytes) and the call in words.
_WORDS = 64
_DTYPE_AT, _TEXT_AT = 8 * (5 + MAX_DIMS), 128
ABORT_BYTES = 1024


def signature(*parts: Any) -> int:
    """A 32-bit signature of ``parts`` (what two neighbours must agree on)."""
    return zlib.crc32(repr(parts).encode())


def header(kind: int, sig: int, micro_batch: int, shown: str, x: Any = None) -> np.ndarray:
    """The header of a message: ``kind``, the call's ``sig`` and ``shown`` (in words), the
    micro-batch, and with ``x`` its dtype and shape."""
    words = np.zeros(_WORDS, np.int64)
    words[:4] = (_MAGIC, kind, sig, micro_batch)
    raw = words.view(np.uint8)
    if x is not None:
        words[4] = x.ndim
        words[5:5 + x.ndim] = x.shape
        name = dtype_name(x.dtype)
        raw[_DTYPE_AT:_DTYPE_AT + len(name)] = np.frombuffer(name.encode(), np.uint8)
    text = shown.encode("utf-8", "replace")[:raw.size - _TEXT_AT]
    raw[_TEXT_AT:_TEXT_AT + len(text)] = np.frombuffer(text, np.uint8)
    return words


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: Any) -> str:
    """The name of ``dtype`` in a header, from which the receiver makes the same dtype.

    Raises
    ------
    TypeError
        For a dtype that its name does not make again (structured, subarray, void).
    """
    if backend.is_bfloat16(dtype):
        return "bfloat16"
    name = np.dtype(dtype).str
    if np.dtype(name) != dtype or len(name) > _TEXT_AT - _DTYPE_AT:
        raise TypeError(f"a pipeline transfer moves arrays of plain dtypes, not {dtype}")
    return name


def empty_header() -> np.ndarray:
    """A buffer to receive a header into."""
    return np.zeros(_WORDS, np.int64)


def read_header(words: np.ndarray) -> dict[str, Any]:
    """A received header's fields: ``kind``, ``sig``, ``micro_batch``, ``shown``, and for
    data ``dtype`` and ``shape`` (kind 0 when it is not a header of this protocol)."""
    if int(words[0]) != _MAGIC:
        return {"kind": 0, "sig": 0, "micro_batch": -1, "shown": "a message of another kind"}
    raw = words.view(np.uint8)
    fields = {"kind": int(words[1]), "sig": int(words[2]), "micro_batch": int(words[3]),
              "shown": _text(raw[_TEXT_AT:])}
    if fields["kind"] == DATA:
        ndim = int(words[4])
        fields["shape"] = tuple(int(n) for n in words[5:5 + ndim])
        name = _text(raw[_DTYPE_AT:_TEXT_AT])
        fields["dtype"] = backend.bfloat16 if name == "bfloat16" else np.dtype(name)
    return fields


class Headers:
    """The headers one transfer makes and reads, remembered whole but for the micro-batch.

    A pipeline sends the same few headers over and over (one direction, one shape), and
    building or parsing one in Python takes tens of microseconds on a core just back from
    compute: on the critical path of 1F1B's steady state, twice a micro-batch. Each header
    made is a copy of a template (a send may still be pending), and a header read is looked
    up by its bytes. At most ``limit`` of each are remembered (uneven micro-batches make a
    few shapes, not many); past that they are made and read as :func:`header` and
    :func:`read_header` do.
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._made: dict[tuple, np.ndarray] = {}
        self._read: dict[bytes, dict[str, Any]] = {}

    def make(self, kind: int, sig: int, micro_batch: int, shown: str,
             x: Any = None) -> np.ndarray:
        """As :func:`header`."""
        key = (kind, sig, shown) if x is None else (kind, sig, shown, x.shape, x.dtype)
        template = self._made.get(key)
        if template is None:
            template = header(kind, sig, 0, shown, x)
            if len(self._made) < self.limit:
                self._made[key] = template
        words = template.copy()
        words[3] = micro_batch
        return words

    def read(self, words: np.ndarray) -> dict[str, Any]:
        """As :func:`read_header` (``words`` is left with its micro-batch zeroed)."""
        if int(words[0]) != _MAGIC:
            return read_header(words)
        micro_batch = int(words[3])
        words[3] = 0
        key = words.tobytes()
        fields = self._read.get(key)
        if fields is None:
            fields = read_header(words)
            if len(self._read) < self.limit:
                self._read[key] = fields
        return {**fields, "micro_batch": micro_batch}


def abort_message(kind: int, text: str, units: int) -> np.ndarray:
    """An abort: its kind, the ``units`` (arrays and ends of calls) its sender had sent to
    the neighbour it goes to, then the error in words."""
    message = np.zeros(ABORT_BYTES, np.uint8)
    message[0] = kind
    message[1:9] = np.frombuffer(np.uint64(units).tobytes(), np.uint8)
    data = text.encode("utf-8", "replace")[:ABORT_BYTES - 9]
    message[9:9 + len(data)] = np.frombuffer(data, np.uint8)
    return message


def read_abort(message: np.ndarray) -> tuple[int, str, int]:
    """An abort's kind, text and units sent before it."""
    return int(message[0]), _text(message[9:]), int(message[1:9].view(np.uint64)[0])


def _text(raw: np.ndarray) -> str:
    return raw.tobytes().rstrip(b"\0").decode("utf-8", "replace")


def outgoing(x: Any) -> Any:
    """The buffer MPI sends for ``x``: itself (C-contiguous NumPy, or a device array given to
    a CUDA-aware MPI after its stream is synchronized) or a contiguous host copy. Each send
    gets its own buffer: sends stay pending while the stage computes on."""
    if backend.is_cupy_array(x):
        xp = backend.array_module(x)
        x = xp.ascontiguousarray(x)
        backend.synchronize(x)
        return x if backend.cuda_aware() else x.get()  # get() blocks: the copy is complete
    return np.ascontiguousarray(x)


def incoming(shape: tuple[int, ...], dtype: Any, xp: Any) -> tuple[Any, Any]:
    """``(array, wire)``: the array to return and the buffer MPI receives into (the array
    itself, or a host buffer that :func:`arrived` copies to the device)."""
    if xp is np or xp is None:
        out = np.empty(shape, dtype)
        return out, out
    out = xp.empty(shape, dtype)
    backend.synchronize(out)
    return out, (out if backend.cuda_aware() else np.empty(shape, dtype))


def arrived(out: Any, wire: Any) -> Any:
    """``out`` holding what MPI wrote into ``wire``."""
    if wire is not out:
        out.set(wire)
        backend.synchronize(out)
    return out


def raw(a: Any) -> Any:
    """``a`` as MPI moves it: bfloat16 as its uint16 bit patterns (MPI cannot name it)."""
    return a.view(np.uint16) if backend.is_bfloat16(a.dtype) else a


def describe(shape: tuple[int, ...], dtype: Any) -> str:
    """An array's shape and dtype in words."""
    return f"{tuple(shape)} {'bfloat16' if backend.is_bfloat16(dtype) else np.dtype(dtype).name}"
