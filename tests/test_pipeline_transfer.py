"""StageTransfer: activations to the next stage and gradients back, equal to what was sent,
NumPy and CuPy (staged and CUDA-aware), uneven shapes and any dtype; every failure (a wrong
gradient's shape, calls that differ, a stage ending early, a refusal, the watchdog, a stage's
program ending) raises on every stage within the watchdog."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time

import numpy as np
import pytest

from layer_helpers import XPS, get_xp
from mpi_helpers import WORLD, agree, raises_everywhere, to_numpy
from pympar import backend, collectives, debug, stats
from pympar.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerEndedError
from pympar.mesh import Mesh
from pympar.pipeline import PipelineGroup, StageTransfer

P = WORLD.Get_size()
needs_two = pytest.mark.skipif(P < 2, reason="a pipeline of one stage sends nothing")
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def pp():
    """Every rank of the world as one stage each."""
    group = Mesh(WORLD, {"pp": P}).group("pp")
    yield group
    group.free()


@pytest.fixture
def watchdog():
    """The watchdog at TIMEOUT for the test (then as it was)."""
    with debug.debug_mode(debug.is_enabled(), timeout=TIMEOUT):
        yield


def activation(stage: int, k: int, dtype, xp):
    """The activation stage ``stage`` sends for micro-batch ``k``: ``k + 1`` rows (uneven)."""
    rng = np.random.default_rng(100 * stage + k)
    host = (rng.standard_normal((k + 1, 3, 2)) * 10).astype(dtype)
    return host if xp is np else xp.asarray(host)


def dtypes():
    found = [np.float64, np.float32, np.int64, np.complex128]
    return found + ([backend.bfloat16] if backend.bfloat16 is not None else [])


def exchange(transfer: StageTransfer, m: int, xp, dtype) -> list[str]:
    """Every stage sends ``m`` activations forward and their gradients (twice the received)
    back; what arrived that differs from what was sent, in words."""
    pipe, wrong = transfer.pipeline, []
    got = {}
    for k in range(m):
        if not pipe.is_first:
            got[k] = transfer.recv_forward(k, xp)
            expected = activation(pipe.rank - 1, k, dtype, np)
            if not isinstance(got[k], type(activation(0, 0, dtype, xp))) or \
                    got[k].dtype != expected.dtype or \
                    not np.array_equal(to_numpy(got[k]), expected):
                wrong.append(f"micro-batch {k} from stage {pipe.rank - 1}")
        if not pipe.is_last:
            transfer.send_forward(activation(pipe.rank, k, dtype, xp), k)
    for k in reversed(range(m)):
        if not pipe.is_last:
            grad = transfer.recv_backward(k, xp)
            if not np.array_equal(to_numpy(grad), 2 * activation(pipe.rank, k, dtype, np)):
                wrong.append(f"gradient {k} from stage {pipe.rank + 1}")
        if not pipe.is_first:
            transfer.send_backward(got[k] * 2, k)
    transfer.finish()
    return wrong


@needs_two
@pytest.mark.parametrize("xp_name", XPS)
def test_activations_and_gradients_arrive_as_sent(pp, xp_name, watchdog):
    xp = get_xp(xp_name)
    transfer = StageTransfer(pp)
    try:
        for dtype in dtypes():
            if xp is not np and backend.is_bfloat16(dtype):
                continue  # CuPy's bfloat16 is its own matter (backend.check_dtype)
            wrong = exchange(transfer, 3, xp, dtype)
            agree(not wrong, f"{np.dtype(dtype).name}: {wrong}")
    finally:
        transfer.free()


@needs_two
def test_only_the_neighbours_take_part_and_stats_count(pp, watchdog):
    """A pipeline group's ranks are its stages in order; a transfer's messages are counted."""
    pipe = PipelineGroup(pp)
    agree(pipe.prev_global_rank == (None if pipe.is_first else pp.ranks[pp.rank - 1])
          and pipe.next_rank == (None if pipe.is_last else pp.rank + 1), repr(pipe))
    transfer = StageTransfer(pp, label="counted")
    with stats.record() as recorder:
        exchange(transfer, 2, np, np.float64)
    calls = {op: row[0] for (group, op), row in recorder.rows.items() if group == pp.name}
    sends = [f"pipeline.send_{d}" for d, end in (("forward", pipe.is_last),
                                                 ("backward", pipe.is_first)) if not end]
    receives = [f"pipeline.recv_{d}" for d, end in (("forward", pipe.is_first),
                                                    ("backward", pipe.is_last)) if not end]
    agree(calls == dict.fromkeys(sends + receives, 2), f"stage {pipe.rank} recorded {calls}")
    transfer.free()


def raises_on_every_stage(function, error: type, match: str, comm) -> BaseException:
    """``function()`` raises ``error`` matching ``match`` on every stage, within the
    watchdog (well before it ends)."""
    start = time.monotonic()
    caught = raises_everywhere(error, match, function, comm=comm)
    agree(time.monotonic() - start < TIMEOUT / 2, "the error took the watchdog's time", comm)
    return caught


@needs_two
def test_a_gradient_of_another_shape_raises_everywhere(pp, watchdog):
    transfer = StageTransfer(pp)
    pipe = transfer.pipeline

    def run():
        if not pipe.is_first:
            x = transfer.recv_forward(0)
        if not pipe.is_last:
            transfer.send_forward(np.ones((4, 3)), 0)
            transfer.recv_backward(0)
        if not pipe.is_first:
            transfer.send_backward(x[:-1] if pipe.is_last else x, 0)  # one row short
        transfer.finish()

    raises_on_every_stage(run, CollectiveMismatchError, r"gradient of micro-batch 0 as \(3, 3\)",
                          pp.comm)
    transfer.free()


@needs_two
def test_calls_that_differ_raise_everywhere(pp, watchdog):
    """The last stage runs another schedule (its label), or expects another micro-batch."""
    for label, k in (("GPipe(micro_batches=3)", 0), ("GPipe(micro_batches=2)", 1)):
        transfer = StageTransfer(pp)
        pipe = transfer.pipeline
        mine = "GPipe(micro_batches=2)" if pipe.is_last else label

        def run():
            with collectives.label(mine):
                if not pipe.is_first:
                    transfer.recv_forward(k if pipe.is_last else 0)
                if not pipe.is_last:
                    transfer.send_forward(np.ones(2), 0)
                transfer.finish()

        raises_on_every_stage(run, CollectiveMismatchError,
                              "neighbouring stages .* disagree: .*expects", pp.comm)
        transfer.free()


@needs_two
def test_a_stage_that_ends_early_raises_everywhere(pp, watchdog):
    """The last stage takes one micro-batch of two and ends its call."""
    transfer = StageTransfer(pp)
    pipe = transfer.pipeline
    m = 1 if pipe.is_last else 2

    def run():
        for k in range(m):
            if not pipe.is_first:
                transfer.recv_forward(k)
            if not pipe.is_last:
                transfer.send_forward(np.ones(3), k)
        for k in range(m):
            if not pipe.is_last:
                transfer.recv_backward(k)
            if not pipe.is_first:
                transfer.send_backward(np.ones(3), k)
        transfer.finish()

    raises_on_every_stage(run, CollectiveMismatchError, "ended|expects", pp.comm)
    transfer.free()


@needs_two
def test_what_a_stage_sent_before_it_failed_arrives_first(pp, watchdog):
    """The first stage sends a large activation (a message MPI moves by rendezvous) and
    fails before the next stage has posted its receive: that stage still receives the
    activation as sent, then raises PeerEndedError at its next receive, whatever order the
    activation and the abort reach it in."""
    transfer = StageTransfer(pp)
    pipe = transfer.pipeline
    sent = np.random.default_rng(3).standard_normal((512, 512))
    outcome = "ok"
    if pipe.is_first:
        transfer.send_forward(sent, 0)
        transfer.abort(ValueError("boom after micro-batch 0"))
    elif pipe.rank == 1:
        time.sleep(0.3)  # both messages are there, or on their way, before it asks
        got = transfer.recv_forward(0)
        outcome = "ok" if np.array_equal(got, sent) else "micro-batch 0 arrived wrong"
        try:
            transfer.recv_forward(1)
            outcome = "micro-batch 1 arrived from a stage that failed"
        except PeerEndedError as err:
            if "boom after micro-batch 0" not in str(err):
                outcome = f"PeerEndedError without the cause: {err}"
    agree(outcome == "ok", f"stage {pipe.rank}: {outcome}")
    pp.comm.Barrier()
    transfer.free()


@needs_two
def test_a_refused_argument_raises_everywhere(pp, watchdog):
    """The last stage sends forward (it has no next stage): it raises ValueError, the
    others the mismatch naming its refusal."""
    transfer = StageTransfer(pp)
    pipe = transfer.pipeline
    caught = None
    try:
        if not pipe.is_first:
            transfer.recv_forward(0)
        transfer.send_forward(np.ones(2), 0)  # refused on the last stage
        transfer.finish()
    except (ValueError, CollectiveMismatchError) as error:
        caught = error
    own = pipe.is_last
    agree(isinstance(caught, ValueError if own else CollectiveMismatchError)
          and "no stage to send to" in str(caught), repr(caught), pp.comm)
    again = None
    try:
        transfer.finish()
    except Exception as error:  # noqa: BLE001 - inspected
        again = error
    agree(again is caught, f"a failed transfer raises its error again: {again!r}", pp.comm)
    transfer.free()


@needs_two
def test_a_neighbour_that_never_comes_times_out(pp):
    """Stage 1 is busy past the watchdog's timeout: stage 0 raises CollectiveTimeoutError
    naming it, and stage 1, when it comes, PeerEndedError (told by stage 0)."""
    transfer = StageTransfer(pp)
    pipe = transfer.pipeline
    caught = None
    with debug.debug_mode(debug.is_enabled(), timeout=0.5):
        try:
            if pipe.rank == 1:
                time.sleep(2.5)
            if pipe.rank == 0:
                transfer.recv_backward(0)
            else:
                if pipe.rank == 1:
                    transfer.send_backward(np.ones(2), 0)
                transfer.finish()
        except CollectiveTimeoutError as error:
            caught = error
    # Stage 0 times out waiting for stage 1 and tells it; the stages after 1 time out
    # waiting for it too, or learn it from a neighbour.
    kind, pattern = {0: (CollectiveTimeoutError, r"did not complete within 0.5 s .*: rank 1 "),
                     1: (PeerEndedError, "timed out")}.get(pipe.rank,
                                                         (CollectiveTimeoutError, ""))
    ok = isinstance(caught, kind) and re.search(pattern, str(caught)) is not None
    agree(ok and (pipe.rank != 0 or type(caught) is CollectiveTimeoutError),
          f"stage {pipe.rank}: {caught!r}", pp.comm)
    transfer.free()


def test_remembered_headers_are_the_headers_they_stand_for():
    """Headers made from a template and read by lookup equal :func:`_wire.header` and
    :func:`_wire.read_header`, whatever the micro-batch, and past the limit too."""
    from pympar.pipeline import _wire

    headers = _wire.Headers(limit=2)
    arrays = [np.zeros((3, 2), np.float32), np.zeros(5, np.int64), np.zeros((1, 1, 4))]
    for k in (0, 7, -1, 2 ** 40):
        for i, x in enumerate(arrays):
            made = headers.make(_wire.DATA, 11 + i, k, f"call {i}", x)
            assert np.array_equal(made, _wire.header(_wire.DATA, 11 + i, k, f"call {i}", x))
            assert headers.read(made.copy()) == _wire.read_header(made)
        done = headers.make(_wire.DONE, 5, k, "the end")
        assert np.array_equal(done, _wire.header(_wire.DONE, 5, k, "the end"))
        assert headers.read(done.copy()) == _wire.read_header(done)
    foreign = np.arange(_wire.empty_header().size, dtype=np.int64)
    assert headers.read(foreign.copy()) == _wire.read_header(foreign)
    assert headers.read(foreign.copy())["kind"] == 0


def test_a_header_carries_every_axis_and_the_dtype():
    """Shapes of 0 to MAX_DIMS axes and every dtype come back as written; a dtype whose name
    does not make it again (structured) is refused."""
    from pympar.pipeline import _wire

    for ndim in range(_wire.MAX_DIMS + 1):
        for dtype in dtypes():
            x = np.zeros(tuple(range(2, 2 + ndim)), dtype)
            read = _wire.read_header(_wire.header(_wire.DATA, 3, 1, "call", x))
            assert (read["shape"], read["dtype"], read["shown"]) == (x.shape, x.dtype, "call")
    with pytest.raises(TypeError, match="plain dtypes"):
        _wire.dtype_name(np.dtype([("a", "<f8"), ("b", "<i4")]))


@needs_two
def test_a_structured_array_is_refused_everywhere(pp, watchdog):
    """The first stage sends a structured array: it raises TypeError, the others the
    mismatch naming its refusal."""
    transfer = StageTransfer(pp)
    pipe = transfer.pipeline
    caught = None
    try:
        if pipe.is_first:
            transfer.send_forward(np.zeros(3, [("a", "<f8"), ("b", "<i4")]), 0)
        else:
            transfer.recv_forward(0)
        transfer.finish()
    except (TypeError, CollectiveMismatchError) as error:
        caught = error
    agree(isinstance(caught, TypeError if pipe.is_first else CollectiveMismatchError)
          and "plain dtypes" in str(caught), repr(caught), pp.comm)
    transfer.free()


def test_one_stage_sends_nothing():
    group = Mesh(WORLD, {"pp": 1, "rest": P}, order="pp-rest").group("pp")
    transfer = StageTransfer(group)
    with pytest.raises(ValueError, match="no stage to send to"):
        transfer.send_forward(np.ones(2))
    transfer.free()
    transfer = StageTransfer(group)
    with pytest.raises(ValueError, match="nothing to receive"):
        transfer.recv_backward(0)
    transfer = StageTransfer(group)
    transfer.finish()
    transfer.free()
    group.free()


SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
from pympar import manager
from pympar.mesh import Mesh
from pympar.modules import Linear, MSELoss
from pympar.pipeline import OneFOneB, split_stages
manager.initialize_parallel()
pp = Mesh(MPI.COMM_WORLD, {"pp": 2}).group("pp")
stage = split_stages([Linear(3, 3, dtype=np.float64), Linear(3, 3, dtype=np.float64)], pp)
run = OneFOneB(stage, pp, 2, MSELoss() if pp.rank == 1 else None)
if pp.rank == 1:
    sys.exit(0)  # ends its program with the schedule made, before running it
start = time.monotonic()
try:
    run.run(np.ones((4, 3)))
except Exception as error:
    print(f"stage 0 after {time.monotonic() - start:.1f} s: {type(error).__name__}: {error}",
          flush=True)
    raise
"""


@pytest.mark.skipif(P != 1, reason="launches its own 2-rank job; runs in the 1-rank pass")
def test_a_stage_whose_program_ends_ends_the_other_at_once(tmp_path):
    """Stage 1's program ends while stage 0 waits for it: stage 0 raises PeerEndedError at
    once (the end of the program tells the neighbours), long before the watchdog's 60 s."""
    import subprocess

    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent(SCRIPT))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PYMPAR_"))}
    env.update(PYMPAR_TIMEOUT="60", PYMPAR_LAUNCH_TIMEOUT="90",
               PYTHONPATH=os.pathsep.join([repo, env.get("PYTHONPATH", "")]))
    done = subprocess.run([os.path.join(repo, "scripts", "mpirun.sh"), "2", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    found = [line for line in output.splitlines() if line.startswith("stage 0 after")]
    assert found and "PeerEndedError" in found[0] and "ended its program" in found[0], output
    assert float(found[0].split()[3]) < 30, output


@needs_two
@pytest.mark.parametrize("xp_name", XPS[1:])
def test_a_schedule_on_device_arrays_equals_the_host_one(pp, xp_name, watchdog):
    """A 1F1B step whose layers and activations live on the device (received where the
    stage's parameters are) gives the NumPy step's loss and gradients."""
    from pympar.modules import Linear, MSELoss
    from pympar.pipeline import OneFOneB, split_stages

    xp = get_xp(xp_name)
    found = {}
    for module in (np, xp):
        widths = [3] + [4] * P + [2]
        chain = [Linear(a, b, dtype=np.float64, seed=i, xp=module)
                 for i, (a, b) in enumerate(zip(widths, widths[1:]))]
        stage = split_stages(chain, pp)
        run = OneFOneB(stage, pp, 3, MSELoss() if pp.rank == P - 1 else None)
        rng = np.random.default_rng(7)
        x, t = rng.standard_normal((7, 3)), rng.standard_normal((7, 2))
        loss = run.run(*(a if module is np else module.asarray(a) for a in (x, t)))
        found[module] = (loss, [to_numpy(p.grad) for p in stage.parameters()])
        run.transfer.free()
    (loss, grads), (device_loss, device_grads) = found[np], found[xp]
    agree((loss is None or np.isclose(loss, device_loss, rtol=1e-12))
          and all(np.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, device_grads)),
          f"stage {pp.rank}: loss {device_loss} != {loss}, or gradients differ", pp.comm)
