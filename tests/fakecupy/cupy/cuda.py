"""``cupy.cuda`` of the stand-in: one stream, a device count of one, a runtime to ask.

Every "kernel" of the stand-in runs on the one stream and leaves the memory it touched
pending (see :mod:`cupy`); any synchronize completes them all.
"""

from __future__ import annotations

import types
from typing import Any

#: Root NumPy arrays (by id) that a kernel touched since the last synchronize.
_PENDING: dict[int, Any] = {}

#: How many times device memory was handed to MPI (``__cuda_array_interface__`` read).
mpi_exports = 0


def _complete() -> None:
    """Every queued kernel has finished: nothing is pending any more."""
    _PENDING.clear()


class Stream:
    """A CUDA stream; the stand-in has one queue, so synchronizing any stream completes all."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int = 0) -> None:
        self.ptr = 0 if null else 1

    def synchronize(self) -> None:
        _complete()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


Stream.null = Stream(null=True)
_CURRENT = Stream.null


def get_current_stream(device_id: int = -1) -> Stream:
    return _CURRENT


class Device:
    """The one device."""

    def __init__(self, device: int = 0) -> None:
        if device not in (0, None):
            raise ValueError(f"the CuPy stand-in has one device, not device {device}")
        self.id = 0

    def synchronize(self) -> None:
        _complete()

    def use(self) -> None:
        pass

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class MemoryPointer:
    """``ndarray.data``: the address of the first element (``ptr``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.device = Device()


def is_available() -> bool:
    return True


def _device_synchronize() -> None:
    _complete()


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    deviceSynchronize=_device_synchronize,
    runtimeGetVersion=lambda: 12080,
    getDevice=lambda: 0,
    getDeviceProperties=lambda device: {"name": b"CuPy stand-in (NumPy memory)"},
    is_hip=False,
)
