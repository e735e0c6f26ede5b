"""Running the CuPy tests without a GPU: the stand-in in ``tests/fakecupy`` (see its docstring).

``PYMPAR_FAKE_CUPY=1`` or ``pytest --fake-cupy`` puts the stand-in first on ``sys.path``, so
``import cupy`` finds it; ``make test`` does so. Without it the CuPy tests use the real CuPy
and skip where there is none. Every CuPy test runs staged (``PYMPAR_CUDA_AWARE=0``: device
buffers must go through host staging) and CUDA-aware (``1``: device buffers to MPI); the
summary line says how many ran on the stand-in.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
from mpi4py import MPI

from pympar import backend

FAKE_CUPY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecupy")
_AWARE_AT_START = os.environ.get("PYMPAR_CUDA_AWARE")
_ran: dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0, "deselected": 0}


def activate() -> None:
    """Make ``import cupy`` find the stand-in (before anything imported a real one)."""
    if "cupy" in sys.modules and not is_stand_in(sys.modules["cupy"]):
        raise RuntimeError("the CuPy stand-in was asked for after the real CuPy was imported")
    if FAKE_CUPY_DIR not in sys.path:
        sys.path.insert(0, FAKE_CUPY_DIR)
    backend.cupy_available.cache_clear()


def is_stand_in(module: ModuleType | None = None) -> bool:
    """Whether ``module`` (the loaded ``cupy`` by default) is the stand-in."""
    module = module if module is not None else sys.modules.get("cupy")
    return bool(getattr(module, "IS_STAND_IN", False))


def cupy_in_mode(mode: str) -> ModuleType:
    """CuPy with device buffers staged (``"staged"``) or given to MPI (``"aware"``).

    Sets ``PYMPAR_CUDA_AWARE`` for the test (restored after it); skips without CuPy and a
    device, and the aware mode on a real GPU whose MPI does not report CUDA support (device
    pointers given to it would crash the job) unless ``PYMPAR_TEST_CUPY_MANAGED=1`` emulates
    one: CuPy arrays are then allocated in managed memory, which a host MPI can move (the
    stand-in models managed memory too, so ``make gpu-rehearsal`` takes that path). The
    stand-in plays a CUDA-aware MPI.
    """
    if not backend.cupy_available():
        pytest.skip("CuPy with a CUDA device is not available (make test uses the stand-in)")
    import cupy

    real = not is_stand_in(cupy)
    if os.environ.get("PYMPAR_TEST_CUPY_MANAGED", "") == "1":
        _use_managed_memory(cupy)
    elif mode == "aware" and real and not backend.mpi_library_cuda_support():
        pytest.skip("needs a CUDA-aware MPI: the MPI library does not report CUDA support "
                    "(PYMPAR_TEST_CUPY_MANAGED=1 emulates one with managed memory)")
    os.environ["PYMPAR_CUDA_AWARE"] = "1" if mode == "aware" else "0"
    return cupy


_MANAGED: list = []


def _use_managed_memory(cupy: ModuleType) -> None:
    """Allocate every CuPy array in managed memory, which a host MPI can read and write: the
    CUDA-aware path emulated with a host MPI. Both modes use it, since buffers cached by
    one test (a group's scratch) may serve the next in the other mode."""
    if not _MANAGED:
        _MANAGED.append(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed))
        cupy.cuda.set_allocator(_MANAGED[0].malloc)


def needs_real_device() -> None:
    """Skip, saying why, a test that only a real GPU can answer."""
    if is_stand_in() or not backend.cupy_available():
        pytest.skip("needs a real CUDA device (the CuPy stand-in cannot answer this)")


def add_option(parser: pytest.Parser) -> None:
    """``--fake-cupy`` (called from the conftest's pytest_addoption)."""
    parser.addoption("--fake-cupy", action="store_true", default=False,
                     help="run the CuPy tests on the strict CuPy stand-in (tests/fakecupy)")


def configure(config: pytest.Config) -> None:
    """Activate the stand-in when asked (called from the conftest's pytest_configure)."""
    if config.getoption("fake_cupy") or os.environ.get("PYMPAR_FAKE_CUPY", "") == "1":
        activate()
        os.environ["PYMPAR_FAKE_CUPY"] = "1"  # the tests' own MPI jobs use it too
    config.pluginmanager.register(sys.modules[__name__], "gpu_stand_in")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On the stand-in, the CuPy tests run where they add something: on 2 and 4 ranks in
    both modes; alone in one mode (one rank never calls MPI, so both modes take one path);
    on 8 ranks only those that need 8 (the 3D cube). ``PYMPAR_CUPY_EVERYWHERE=1`` runs them
    all everywhere. The deselected are counted in the summary line."""
    size = MPI.COMM_WORLD.Get_size()
    if FAKE_CUPY_DIR not in sys.path:
        return
    if size in (2, 4) or os.environ.get("PYMPAR_CUPY_EVERYWHERE", "") == "1":
        return
    keep, dropped = [], []
    for item in items:
        cupy = "cupy" in item.nodeid
        if cupy and ((size == 1 and "cupy-aware" in item.nodeid)
                     or (size > 4 and "cube" not in getattr(item, "fixturenames", ()))):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        _ran["deselected"] = len(dropped)
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _AWARE_AT_START is None:
        os.environ.pop("PYMPAR_CUDA_AWARE", None)
    else:
        os.environ["PYMPAR_CUDA_AWARE"] = _AWARE_AT_START
    cupy = sys.modules.get("cupy")
    if is_stand_in(cupy):
        cupy.synchronize()  # one test's pending kernels are not the next one's


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if ("cupy" not in report.nodeid and "gpu_stand_in" not in report.nodeid) or not is_stand_in():
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _ran[report.outcome] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if is_stand_in():
        size = MPI.COMM_WORLD.Get_size()
        left_out = (f"; {_ran['deselected']} left to the 2- and 4-rank runs" if
                    _ran["deselected"] else "")
        terminalreporter.write_line(
            f"CuPy stand-in: {_ran['passed']} CuPy tests passed on it on {size} rank(s), "
            f"{_ran['failed']} failed, {_ran['skipped']} skipped (each says why){left_out}")
