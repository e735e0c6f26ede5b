"""The CuPy stand-in's own rules (tests/fakecupy): each one catches what a GPU would."""

import os

import numpy as np
import pytest
from mpi4py import MPI

from gpu_stand_in import cupy_in_mode, is_stand_in
from pympar import backend


@pytest.fixture
def cp():
    xp = cupy_in_mode("aware")
    if not is_stand_in(xp):
        pytest.skip("tests the CuPy stand-in, which is not active (PYMPAR_FAKE_CUPY=1)")
    return xp


def _allreduce(x):
    MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, [x, backend.mpi_datatype(x.dtype)])


def test_a_numpy_call_on_a_device_array_raises(cp):
    x = cp.asarray(np.arange(4.0))
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(TypeError, match="NumPy ufunc numpy.exp was given a device array"):
        np.exp(x)
    with pytest.raises(TypeError, match="NumPy function numpy.concatenate"):
        np.concatenate([x, x])
    with pytest.raises(TypeError, match="ufunc numpy.add"):
        np.ones(4) + x
    assert not isinstance(x, np.ndarray) and not hasattr(x, "__array_interface__")


def test_host_arrays_do_not_mix_with_device_arrays(cp):
    x = cp.zeros((2, 3))
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        x[...] = np.ones((2, 3))
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(3)
    with pytest.raises(TypeError, match="Unsupported type"):
        cp.maximum(x, np.ones(3))
    with pytest.raises(ValueError, match="cannot broadcast a value of shape"):
        cp.zeros(())[...] = cp.ones(1)  # NumPy drops the leading 1; CuPy broadcasts strictly
    x[...] = np.float64(2.0)  # scalars (and 0-d arrays) are fine, as in CuPy
    x[0] = np.array(3.0)
    assert x.get().tolist() == [[3.0] * 3, [2.0] * 3]
    with pytest.raises(AttributeError, match="the CuPy stand-in has no 'frombuffer'"):
        cp.frombuffer  # NumPy-only: code calling it through xp fails here too


def test_get_and_set_check_dtype_shape_and_contiguity(cp):
    x = cp.asarray(np.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match="float32 array cannot be set to float64 array"):
        x.set(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="Shape mismatch"):
        x.set(np.zeros((3, 2)))
    with pytest.raises(RuntimeError, match="Cannot set to non-contiguous array"):
        x[:, ::2].set(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="cannot be obtained from"):
        x.get(out=np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="Shape mismatch"):
        x.get(out=np.zeros(6))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        x.get(out=np.zeros((2, 6))[:, ::2])
    out = np.zeros((2, 3))
    x.T.get(out=np.zeros((3, 2)))
    assert x.get(out=out) is out and out.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert cp.ascontiguousarray(cp.asarray(np.float64(1.0))).shape == (1,)  # CuPy's rule


def test_mpi_refuses_a_device_array_before_its_stream_is_synchronized(cp):
    x = cp.asarray(np.arange(4.0)) * 2.0  # a kernel: x is pending
    with pytest.raises(RuntimeError, match="while a kernel that reads or writes it may still"):
        _allreduce(x)
    cp.cuda.get_current_stream().synchronize()
    _allreduce(x)
    y = x + 1.0  # reading x is a kernel too: MPI must not write x while it may run
    with pytest.raises(RuntimeError, match="may still run"):
        _allreduce(x)
    y.get()  # a blocking copy completes the stream
    _allreduce(x)
    assert x.get().tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.fixture
def default_allocator(cp):
    """Device arrays from the default pool (not managed), whatever the run set; restored."""
    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(None)
    yield
    cp.cuda.set_allocator(previous)


def test_mpi_refuses_device_memory_when_staging_is_forced(cp, monkeypatch, default_allocator):
    x = cp.zeros(4)
    cp.cuda.Device().synchronize()
    for setting in ("0", "auto"):
        monkeypatch.setenv("PYMPAR_CUDA_AWARE", setting)
        with pytest.raises(RuntimeError, match="bypassed staging"):
            _allreduce(x)
    monkeypatch.setenv("PYMPAR_CUDA_AWARE", "1")
    _allreduce(x)


def test_a_host_mpi_reaches_managed_memory_and_only_that(cp, monkeypatch, default_allocator):
    """As with CUDA: arrays allocated from a managed pool (the emulation of a CUDA-aware MPI in
    scripts/gpu_check.sh) reach a host MPI, and their views too; others still raise."""
    monkeypatch.setenv("PYMPAR_CUDA_AWARE", "0")
    device = cp.arange(4, dtype=cp.float64)
    pool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)
    cp.cuda.set_allocator(pool.malloc)
    assert cp.cuda.get_allocator() == pool.malloc
    managed = cp.arange(4, dtype=cp.float64)
    summed = managed + managed  # a kernel's result is allocated by the pool too
    cp.cuda.set_allocator(None)
    cp.cuda.Device().synchronize()
    _allreduce(managed)
    _allreduce(summed[1:])
    assert managed.get().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert summed.get().tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(RuntimeError, match="bypassed staging"):
        _allreduce(device)
    with pytest.raises(RuntimeError, match="bypassed staging"):
        _allreduce(cp.arange(4, dtype=cp.float64))  # allocated after the pool was left


def test_the_managed_emulation_makes_the_stand_in_a_host_mpi(cp, monkeypatch,
                                                             default_allocator):
    """PYMPAR_TEST_CUPY_MANAGED=1 (a host MPI; the aware path runs on managed memory): device
    pointers that are not managed memory raise even with PYMPAR_CUDA_AWARE=1, as they would
    crash a host MPI on a GPU."""
    monkeypatch.setenv("PYMPAR_CUDA_AWARE", "1")
    monkeypatch.setenv("PYMPAR_TEST_CUPY_MANAGED", "1")
    x = cp.zeros(4)
    cp.cuda.Device().synchronize()
    with pytest.raises(RuntimeError, match="not allocated as managed memory"):
        _allreduce(x)
    cp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)
    y = cp.ones(4)
    cp.cuda.Device().synchronize()
    _allreduce(y)
    assert y.get().tolist() == [1.0] * 4


def test_pympar_stages_when_forced(cp, monkeypatch):
    """Through pympar the same device buffers travel staged: nothing reaches MPI."""
    from pympar.group import Group

    monkeypatch.setenv("PYMPAR_CUDA_AWARE", "0")
    group = Group(MPI.COMM_WORLD, "world", list(range(MPI.COMM_WORLD.size)), owns_comm=False)
    before = cp.cuda.mpi_exports
    y = group.all_reduce(cp.asarray(np.ones(3)))
    assert y.get().tolist() == [float(group.size)] * 3
    assert cp.cuda.mpi_exports == before
    assert os.environ["PYMPAR_CUDA_AWARE"] == "0"
