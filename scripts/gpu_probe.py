"""Probe, on a real GPU, the CuPy behaviour that pympar and its CuPy stand-in assume.

Run by ``scripts/gpu_check.sh``; prints one line per premise (``holds`` or ``DOES NOT HOLD``)
and exits 1 when one does not hold: then the stand-in in ``tests/fakecupy`` (or pympar)
models CuPy wrongly and must follow what this CuPy does.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import numpy as np


def _raises(error: type, text: str, fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except error as err:
        return None if text in str(err) else f"raised {error.__name__} {err!r}"
    except Exception as err:  # noqa: BLE001 - reported
        return f"raised {type(err).__name__}: {err}"
    return "did not raise"


def premises(cupy: Any) -> list[tuple[str, Callable[[], str | None]]]:
    import cupyx
    from mpi4py import MPI

    def assign() -> None:
        cupy.zeros(2)[...] = np.ones(2)

    def setitem_check() -> str | None:
        return _raises(ValueError, "non-scalar numpy.ndarray cannot be used for fill", assign)

    def contiguous_0d() -> str | None:
        shape = cupy.ascontiguousarray(cupy.asarray(1.0)).shape
        return None if shape == (1,) else f"shape {shape}"

    def bfloat16() -> str | None:
        import ml_dtypes

        major = int(cupy.__version__.split(".")[0])
        try:
            a = cupy.ones((4, 4), ml_dtypes.bfloat16)
            b = (a @ a + 1).astype(np.float32).get()
        except Exception as err:  # noqa: BLE001 - reported
            return None if major < 14 else f"CuPy {cupy.__version__}: {err!r}"
        if major < 14:
            return f"CuPy {cupy.__version__} < 14 holds bfloat16 (pympar refuses it there)"
        return None if np.all(b == 5.0) else f"wrong values {b}"

    def get_checks() -> str | None:
        a = cupy.zeros(3)
        return (_raises(TypeError, "cannot be obtained", lambda: a.get(out=np.zeros(3, "f4")))
                or _raises(ValueError, "Shape mismatch", lambda: a.get(out=np.zeros(4)))
                or _raises(TypeError, "cannot be set", lambda: a.set(np.zeros(3, "f4")))
                or _raises(ValueError, "Shape mismatch", lambda: a.set(np.zeros(4))))

    def managed_memory_reaches_host_mpi() -> str | None:
        pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)
        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(pool.malloc)
        try:
            a = cupy.arange(4, dtype=cupy.float64)
            cupy.cuda.get_current_stream().synchronize()
            MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, [a, MPI.DOUBLE])
            got = a.get()
        finally:
            cupy.cuda.set_allocator(previous)
        return None if got.tolist() == [0.0, 1.0, 2.0, 3.0] else f"read back {got}"

    def cai() -> str | None:
        a = cupy.zeros(3)
        cupy.cuda.get_current_stream().synchronize()
        # Reading the interface is what a CUDA-aware MPI does: the stand-in allows it only
        # while it plays one (real CuPy ignores both variables).
        saved = {k: os.environ.pop(k, None) for k in ("PYMPAR_CUDA_AWARE",
                                                      "PYMPAR_TEST_CUPY_MANAGED")}
        os.environ["PYMPAR_CUDA_AWARE"] = "1"
        try:
            desc = a.__cuda_array_interface__
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None)
                if value is not None:
                    os.environ[key] = value
        return None if desc.get("version", 0) >= 2 and "data" in desc else f"{desc}"

    def overlap() -> str | None:
        b = cupy.zeros(5)
        ok = cupy.may_share_memory(b[:4], b[1:]) and not cupy.may_share_memory(b[:2], b[3:])
        return None if ok else "cupy.may_share_memory misjudges slices"

    def pinned() -> str | None:
        a = cupyx.empty_pinned((3,), np.float32)
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        return None if type(a) is np.ndarray else f"empty_pinned gave {type(a)}"

    # A refusal this CuPy does not make leaves the stand-in stricter than CuPy (allowed);
    # the other premises must hold, or the stand-in and pympar model CuPy wrongly.
    return [
        ("numpy.asarray(device array) raises CuPy's TypeError",
         lambda: _raises(TypeError, "Implicit conversion to a NumPy array is not allowed",
                         lambda: np.asarray(cupy.zeros(2)))),
        ("refusal: device[...] = numpy array raises ValueError", setitem_check),
        ("refusal: device + numpy array raises TypeError",
         lambda: _raises(TypeError, "", lambda: cupy.zeros(2) + np.ones(2))),
        ("refusal: cupy.ascontiguousarray of a 0-d array is 1-d", contiguous_0d),
        ("refusal: get/set check dtype and shape", get_checks),
        ("refusal: device0d[...] = device array of shape (1,) raises (strict broadcast)",
         lambda: _raises(ValueError, "", lambda: cupy.zeros(()).__setitem__(
             Ellipsis, cupy.ones(1)))),
        ("bfloat16 (ml_dtypes) works from CuPy 14 on", bfloat16),
        ("__cuda_array_interface__ exports the pointer", cai),
        ("cupy.may_share_memory sees overlapping slices", overlap),
        ("cupyx.empty_pinned gives NumPy arrays; the pinned pool frees", pinned),
        ("a host MPI reads and writes CuPy managed memory (the aware-path emulation)",
         managed_memory_reaches_host_mpi),
    ]


def main() -> int:
    import cupy

    print(f"probe: CuPy {cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} device(s)")
    failed = 0
    for name, check in premises(cupy):
        try:
            problem = check()
        except Exception as err:  # noqa: BLE001 - a premise that cannot even be checked
            problem = f"{type(err).__name__}: {err}"
        stricter = problem is not None and name.startswith("refusal: ")
        failed += problem is not None and not stricter
        verdict = ("holds" if problem is None else
                   f"differs ({problem}; the stand-in is stricter here: fine)" if stricter else
                   f"DOES NOT HOLD ({problem})")
        print(f"premise: {name}: {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
