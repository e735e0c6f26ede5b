"""CuPy through the rest of pympar: state dicts, optimizers, ZeRO, GradScaler, checkpoints,
memory accounting, ``out=`` checks, timeouts and the staging pool.

Each test runs staged and CUDA-aware (``gpu_stand_in.cupy_in_mode``), on the stand-in in
``make test`` or on a real GPU, and compares with the same run on NumPy.
"""

import gc
import os
import sys

import numpy as np
import pytest

from gpu_stand_in import cupy_in_mode, is_stand_in
from layer_helpers import rng_array
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere, to_numpy
from pympar import backend, checkpoint, debug, manager, memory
from pympar.amp import GradScaler
from pympar.group import Group
from pympar.modules import ColumnParallelLinear, Linear, Module, Parameter, RowParallelLinear
from pympar.modules.layers_3d import Linear3D
from pympar.optim import AdamW
from pympar.zero import ZeroRedundancyOptimizer

MODES = [pytest.param("staged", id="cupy-staged"), pytest.param("aware", id="cupy-aware")]
IN, OUT, ROWS = 6, 5, 4


@pytest.fixture(params=MODES)
def cp(request):
    return cupy_in_mode(request.param)


@pytest.fixture
def tp(clean_state):
    """TP 2 by DP size/2 on a multiple of 4 ranks, else DP only (ZeRO over every rank)."""
    manager.initialize_parallel(2 if WORLD.size % 4 == 0 else 1)
    yield manager.get_tensor_parallel_group()


def world_group() -> Group:
    return Group(WORLD, "world", list(range(WORLD.size)), owns_comm=False)


class Scaled(Module):
    """A TP linear layer times a learnable 0-d gain (a 0-d parameter, saved and loaded)."""

    def __init__(self, xp, seed=1):
        super().__init__()
        self.fc = ColumnParallelLinear(IN, OUT, gather_output=True, dtype=np.float64,
                                       seed=seed, xp=xp)
        self.gain = Parameter(xp.asarray(np.float64(1.5 + seed)))

    def forward(self, x):
        self.y = self.fc(x)
        return self.y * self.gain.data

    def backward(self, dy):
        self.gain.accumulate_grad((dy * self.y).sum())
        return self.fc.backward(dy * self.gain.data)


@pytest.mark.mpi(min_size=1)
def test_module_state_dict_numpy_into_cupy_and_back(cp):
    """A NumPy state dict loads into CuPy parameters (CuPy refuses ``dst[...] = numpy``)."""
    host, device = Linear(IN, OUT, dtype=np.float64, seed=1), Linear(IN, OUT, dtype=np.float64,
                                                                    seed=2, xp=cp)
    device.load_state_dict(host.state_dict())
    for name, value in device.state_dict().items():
        agree(isinstance(value, cp.ndarray), f"{name} left the device")
        assert_equal(value, host.state_dict()[name], what=name)
    back = Linear(IN, OUT, dtype=np.float64, seed=3)
    back.load_state_dict(device.state_dict())
    assert_equal(back.weight.data, host.weight.data, what="CuPy state into NumPy")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sharded", [False, True], ids=["adamw", "zero"])
def test_optimizer_state_moves_between_numpy_and_cupy(cp, tp, sharded):
    """AdamW and ZeRO on CuPy follow NumPy; their state dicts load across the two."""
    def make(xp, seed):
        layer = ColumnParallelLinear(IN, OUT, gather_output=True, dtype=np.float64, seed=seed,
                                     xp=xp)
        params = list(layer.parameters())
        opt = (ZeroRedundancyOptimizer(params, AdamW, lr=0.05) if sharded
               else AdamW(params, lr=0.05))
        return layer, opt

    def train(layer, opt, xp, steps, start=0):
        for step in range(start, start + steps):
            x = rng_array(10 + step, (ROWS, IN), np.float64, xp)
            opt.zero_grad()
            y = layer(x)
            layer.backward(y - xp.tanh(x[:, :OUT]))
            opt.step()

    ref, ref_opt = make(np, 1)
    train(ref, ref_opt, np, 3)
    dev, dev_opt = make(cp, 1)
    train(dev, dev_opt, cp, 3)
    assert_close(dev.weight.data, ref.weight.data, rtol=1e-12, atol=1e-13, what="CuPy vs NumPy")
    # NumPy state into a fresh CuPy optimizer, then both continue alike; and back.
    resumed, resumed_opt = make(cp, 7)
    resumed.load_state_dict(ref.state_dict())
    resumed_opt.load_state_dict(ref_opt.state_dict())
    host, host_opt = make(np, 8)
    host.load_state_dict(dev.state_dict())
    host_opt.load_state_dict(dev_opt.state_dict())
    for layer, opt, xp in ((ref, ref_opt, np), (resumed, resumed_opt, cp),
                           (host, host_opt, np)):
        train(layer, opt, xp, 2, start=3)
    assert_close(resumed.weight.data, ref.weight.data, rtol=1e-12, atol=1e-13,
                 what="NumPy optimizer state resumed on CuPy")
    assert_close(host.weight.data, ref.weight.data, rtol=1e-12, atol=1e-13,
                 what="CuPy optimizer state resumed on NumPy")


@pytest.mark.mpi(min_size=1)
def test_linear3d_loads_a_numpy_weight_into_cupy(cube, cp):
    layer = Linear3D(IN, OUT, dtype=np.float64, seed=1, xp=cp)
    full = rng_array(4, (OUT, IN), np.float64)
    bias = rng_array(5, (OUT,), np.float64)
    layer.load_full_weight(full, bias)
    assert_equal(layer.weight.data, layer.weight.placement.take(full), what="weight block")
    assert_equal(layer.bias.data, layer.bias.placement.take(bias), what="bias block")


@pytest.mark.mpi(min_size=1)
def test_checkpoint_between_numpy_and_cupy(cp, tp, shared_dir):
    """Save from CuPy (a 0-d parameter included), load into CuPy and NumPy; NumPy to CuPy."""
    def trained(xp):
        model = Scaled(xp)
        opt = AdamW(list(model.parameters()), lr=0.1)
        x = rng_array(3, (ROWS, IN), np.float64, xp)
        model.backward(model(x) - 1.0)
        opt.step()
        return model, opt

    ref, ref_opt = trained(np)
    dev, dev_opt = trained(cp)
    saved = {}
    for name, (model, opt) in {"cupy": (dev, dev_opt), "numpy": (ref, ref_opt)}.items():
        saved[name] = os.path.join(shared_dir, name)
        checkpoint.save(saved[name], model, opt, step=1)
    for source in saved:
        for xp in (np, cp):
            model = Scaled(xp, seed=5)
            opt = AdamW(list(model.parameters()), lr=0.1)
            step, _ = checkpoint.load(saved[source], model, opt)
            agree(step == 1, f"step {step}")
            what = f"{source} checkpoint loaded into {xp.__name__}"
            for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
                agree(type(got) is type(xp.asarray(np.zeros(1))), f"{what}: {name} type")
                assert_close(got, want, rtol=1e-13, atol=1e-14, what=f"{what}: {name}")
            moments = [to_numpy(v) for e in opt.state_dict()["state"].values()
                       for k, v in sorted(e.items()) if k != "step"]
            expected = [to_numpy(v) for e in ref_opt.state_dict()["state"].values()
                        for k, v in sorted(e.items()) if k != "step"]
            for got, want in zip(moments, expected):
                assert_close(got, want, rtol=1e-13, atol=1e-14, what=f"{what}: moments")


@pytest.mark.mpi(min_size=1)
def test_grad_scaler_on_cupy(cp, tp):
    """float16 on CuPy: the scaled gradient stays on the device; inf skips the step."""
    layer = RowParallelLinear(IN, OUT, input_is_parallel=False, dtype=np.float16, seed=1, xp=cp)
    params = list(layer.parameters())
    opt = ZeroRedundancyOptimizer(params, AdamW, lr=0.01)
    scaler = GradScaler()
    x = rng_array(2, (ROWS, IN), np.float16, cp)
    dy = rng_array(3, (ROWS, OUT), np.float16, cp) * 1e-3
    scaled = scaler.scale(dy)
    agree(isinstance(scaled, cp.ndarray) and scaled.dtype == np.float16, "scaled off device")
    expected = (to_numpy(dy).astype(np.float32) * 2.0**16).astype(np.float16)
    assert_equal(scaled, expected, what="scaled gradient")
    layer(x)
    layer.backward(scaled)
    before = to_numpy(params[0].data)
    agree(scaler.step(opt), "a finite float16 step on CuPy was skipped")
    scaler.update()
    agree(not np.array_equal(to_numpy(params[0].data), before), "the step changed nothing")
    layer(x)
    layer.backward(scaled)
    if WORLD.rank == WORLD.size - 1:
        params[0].grad[0, 0] = np.inf
    agree(not scaler.step(opt), "an inf gradient on one rank did not skip the step")
    scaler.update()
    agree(scaler.get_scale() == 2.0**15, f"scale {scaler.get_scale()}")


@pytest.mark.mpi(min_size=1)
def test_memory_report_counts_cupy_arrays_like_numpy(cp, tp):
    reports = []
    for xp in (np, cp):
        layer = ColumnParallelLinear(IN, OUT, gather_output=False, dtype=np.float32, seed=1,
                                     xp=xp)
        opt = ZeroRedundancyOptimizer(list(layer.parameters()), AdamW, lr=0.1)
        layer(rng_array(1, (ROWS, IN), np.float32, xp))
        reports.append(memory.memory_report(layer, opt))
    agree(reports[0] == reports[1] and reports[1]["parameters"] > 0,
          f"NumPy {reports[0]} != CuPy {reports[1]}")


@pytest.mark.mpi(min_size=1)
def test_out_overlapping_the_input_is_refused_on_cupy(cp):
    """MPI cannot read and write one buffer: an ``out`` overlapping ``x`` raises everywhere."""
    group = world_group()
    buf = cp.asarray(np.arange(5.0))
    raises_everywhere(ValueError, "out overlaps the input", group.all_reduce, buf[:4],
                      out=buf[1:])
    wide = cp.zeros((2, 3 * WORLD.size))
    raises_everywhere(ValueError, "out overlaps the input", group.all_gather, wide[:, :3],
                      axis=1, out=wide)
    assert_equal(group.all_reduce(buf[:4], out=cp.zeros(4)), np.arange(4.0) * WORLD.size,
                 what="a separate out")


@pytest.mark.mpi(min_size=2)
def test_timeout_never_hands_device_buffers_to_non_blocking_calls(cp):
    """The watchdog bounds the agreement check, never the data call: with or without a
    timeout, device (and host) buffers take MPI's blocking call, which every CUDA-aware MPI
    supports on device memory. The results are the same either way."""
    if not is_stand_in():
        pytest.skip("counts what reaches MPI through the stand-in")

    class Calls:  # the group's communicator, recording the methods the collectives take
        def __init__(self, comm):
            self.comm, self.names = comm, []

        def __getattr__(self, name):
            self.names.append(name)
            return getattr(self.comm, name)

    exports = sys.modules["cupy"].cuda
    group = world_group()
    comm, group.comm = group.comm, Calls(group.comm)
    x = cp.asarray(np.arange(6.0).reshape(2, 3) + WORLD.rank)
    expected = sum(np.arange(6.0).reshape(2, 3) + r for r in range(WORLD.size))
    aware = backend.cuda_aware()
    try:
        for timeout in (None, 60.0):
            before = exports.mpi_exports
            group.comm.names.clear()
            with debug.debug_mode(False, timeout=timeout):
                assert_equal(group.all_reduce(x), expected, what=f"all_reduce, timeout {timeout}")
                gathered = group.all_gather(x, axis=1, sizes=(3,) * WORLD.size)
            assert_equal(gathered, np.concatenate([to_numpy(x) - WORLD.rank + r
                                                   for r in range(WORLD.size)], 1), what="gather")
            device = exports.mpi_exports > before
            data = [n for n in group.comm.names if n != "Iprobe" and n[0] in "AI"]
            agree(device == aware and data == ["Allreduce", "Allgather"],
                  f"timeout {timeout}, aware {aware}: device memory reached MPI: {device}, "
                  f"data calls: {data}")
    finally:
        group.comm = comm


@pytest.mark.mpi(min_size=2)
def test_staging_buffers_are_released(cp, clean_state):
    """The pinned staging pool is handed back when the parallel state is destroyed."""
    if not is_stand_in():
        pytest.skip("counts pinned bytes through the stand-in")
    if backend.cuda_aware():
        pytest.skip("CUDA-aware: device buffers go to MPI directly, nothing is staged")
    import cupyx

    manager.initialize_parallel(WORLD.size)
    group = manager.get_tensor_parallel_group()
    pool = sys.modules["cupy"].get_default_pinned_memory_pool()
    freed = pool.freed_all
    big = cp.asarray(rng_array(1, (64, 1024), np.float32))
    group.all_reduce(big)
    agree(cupyx.live_bytes >= big.nbytes, f"pinned bytes {cupyx.live_bytes}")
    manager.destroy_parallel()
    gc.collect()
    agree(cupyx.live_bytes == 0 and pool.freed_all == freed + 1,
          f"after destroy_parallel: {cupyx.live_bytes} pinned bytes held, pool freed "
          f"{pool.freed_all - freed} times")


@pytest.mark.mpi(min_size=1)
def test_bfloat16_on_cupy(cp, tp, monkeypatch):
    """CuPy 14 holds bfloat16 (ml_dtypes): a TP layer matches NumPy's bfloat16 run. Before
    14 the layer refuses it, saying so."""
    bf16 = backend.bfloat16
    if bf16 is None:
        pytest.skip("ml_dtypes (bfloat16) is not installed")
    outs = []
    for xp in (np, cp):
        layer = ColumnParallelLinear(IN, OUT, gather_output=True, dtype=bf16, seed=1, xp=xp)
        y = layer(rng_array(1, (ROWS, IN), np.float32, xp).astype(bf16))
        dx = layer.backward(rng_array(2, (ROWS, OUT), np.float32, xp).astype(bf16))
        outs.append((y, dx, layer.weight.grad))
    for (a, b, what) in zip(outs[0], outs[1], ("y", "dx", "dW")):
        agree(b.dtype == bf16, f"{what} dtype {b.dtype}")
        assert_close(b, a, rtol=2e-2, atol=2e-2, what=f"bfloat16 {what}")
    if is_stand_in():
        monkeypatch.setattr(cp, "__version__", "13.6.0")
        raises_everywhere(TypeError, "bfloat16 on CuPy needs CuPy 14", ColumnParallelLinear,
                          IN, OUT, dtype=bf16, seed=1, xp=cp)

