"""``cupy.cuda`` of the stand-in: one stream, a device count of one, a runtime to ask, and
CuPy's allocator interface (memory pools, managed memory).

Every "kernel" of the stand-in runs on the one stream and leaves the memory it touched
pending (see :mod:`cupy`); any synchronize completes them all. Arrays allocated while the
current allocator hands out managed memory (``set_allocator(MemoryPool(malloc_managed).malloc)``)
are managed: a host MPI may read and write them, as it may CUDA's managed memory.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

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


def malloc(size: int) -> MemoryPointer:
    """Device memory (the stand-in's arrays hold their own NumPy memory: a token pointer)."""
    return MemoryPointer(0)


def malloc_managed(size: int) -> MemoryPointer:
    """Managed (unified) memory, which the host and a host MPI can reach."""
    return MemoryPointer(0)


class MemoryPool:
    """A pool over ``allocator`` (device memory by default); counts ``free_all_blocks``."""

    def __init__(self, allocator: Callable[[int], MemoryPointer] | None = None) -> None:
        self.allocator = allocator if allocator is not None else malloc
        self.freed_all = 0

    def malloc(self, size: int) -> MemoryPointer:
        return self.allocator(size)

    def free_all_blocks(self, stream: Any = None) -> None:
        self.freed_all += 1

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def n_free_blocks(self) -> int:
        return 0


class PinnedMemoryPool(MemoryPool):
    """The pinned host memory pool (``cupyx.empty_pinned`` gives plain NumPy arrays)."""


_allocator: Callable[[int], MemoryPointer] | None = None
#: Whether arrays allocated now are managed memory (follows ``set_allocator``).
allocating_managed = False
#: Root NumPy arrays (by id) allocated as managed memory and still alive.
_MANAGED: dict[int, Any] = {}


def set_allocator(allocator: Callable[[int], MemoryPointer] | None = None) -> None:
    """Allocate device arrays through ``allocator`` (``None``: the default pool)."""
    global _allocator, allocating_managed
    _allocator = allocator
    owner = getattr(allocator, "__self__", None)
    allocating_managed = allocator is malloc_managed or (
        isinstance(owner, MemoryPool) and owner.allocator is malloc_managed)


def get_allocator() -> Callable[[int], MemoryPointer]:
    from . import get_default_memory_pool
    return _allocator if _allocator is not None else get_default_memory_pool().malloc


def _allocated(root: Any) -> None:
    """``root`` was just allocated: remember it as managed while the allocator is managed."""
    key = id(root)
    _MANAGED[key] = weakref.ref(root)
    weakref.finalize(root, _MANAGED.pop, key, None)


def is_managed(root: Any) -> bool:
    """Whether the root NumPy array ``root`` is managed memory."""
    return id(root) in _MANAGED


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
