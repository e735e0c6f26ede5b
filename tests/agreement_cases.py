"""Cases of tests/test_agreement_mismatch.py: each makes one call of :mod:`pympar.agreed`'s
inventory with one argument different on the last rank (``ctx.pick(theirs, mine)``).

Alike calls get their cases generated (every collective, mapping direction and FFT);
the others are written out. ``CASES[(path, parameter)]`` takes a :class:`Context`; the
layers' cases are in agreement_layer_cases.py.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from pympar import agreed, collectives, debug, fft, mappings
from pympar.amp import GradScaler
from pympar.checkpoint import load, save
from pympar.decomposition import Decomposition
from pympar.group import Group
from pympar.halo import HaloExchange
from pympar.mesh import Mesh
from pympar.modules import Linear, Parameter
from pympar.optim import SGD, Adam, AdamW, allreduce_gradients
from pympar.zero import ZeroRedundancyOptimizer

WORLD = MPI.COMM_WORLD
Case = Callable[["Context"], Any]
CASES: dict[tuple[str, str], Case] = {}


class Context:
    """What a case needs: fresh groups (freed after it), the last rank's choice, a folder."""

    def __init__(self, folder: str) -> None:
        self.last = WORLD.rank == WORLD.size - 1
        self.folder = folder
        self.made: list[Group] = []
        self.cleanups: list[Callable[[], None]] = []

    def pick(self, theirs: Any, mine: Any) -> Any:
        """``mine`` on the last rank, ``theirs`` on the others."""
        return mine if self.last else theirs

    def group(self) -> Group:
        """A fresh group of the whole world (collective)."""
        g = Mesh(WORLD, {"w": WORLD.size}).group("w", key=f"case{len(self.made)}")
        self.made.append(g)
        return g

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            cleanup()
        for g in self.made:
            g.free()


def case(path: str, *params: str) -> Callable[[Case], Case]:
    """Register ``function`` as the case of each of ``params`` of ``path``."""
    def register(function: Case) -> Case:
        for param in params:
            CASES[(path, param)] = lambda ctx, f=function, p=param: f(ctx, p)
        return function
    return register


# ----------------------------------------------------------------------- collectives
def _collective_case(name: str) -> Case:
    def run(ctx: Context, param: str) -> Any:
        g = ctx.group()
        p = g.size
        x = np.ones((2 * p, 2 * p, 2 * p))
        kwargs: dict[str, Any] = {"x": x}
        if name == "all_to_all":
            kwargs.update(split_axis=0, concat_axis=1)
        other = {"x": x.astype(np.float32), "op": "max", "out": np.empty(1), "root": 1,
                 "axis": 1, "sizes": (2 * p,) * p, "label": "another label",
                 "split_axis": 2, "concat_axis": 2}
        kwargs[param] = ctx.pick(kwargs.get(param), other[param])
        return getattr(collectives, name)(g, **kwargs)
    return run


# ----------------------------------------------------------------------- mappings
def _mapping_case(path: str) -> Case:
    _, _, name, direction = path.split(".")
    m = getattr(mappings, name)
    call = m if direction == "__call__" else m.backward

    def run(ctx: Context, param: str) -> Any:
        g = ctx.group()
        p = g.size
        x = np.ones((2 * p, 2, 2 * p))
        kwargs: dict[str, Any] = {}
        if param == "x":
            x = ctx.pick(x, x.astype(np.float32))
        elif param == "out":
            kwargs["out"] = ctx.pick(None, np.empty(1))
        elif param == "global_size":
            gathered = call._step.gathered
            axis = 0 if gathered is None else gathered({})
            total = p * x.shape[axis]
            kwargs["global_size"] = ctx.pick(total if gathered else None, total + 1)
        else:  # the step's own options
            kwargs[param] = ctx.pick(True if param == "tensor_parallel_output_grad" else
                                     (0 if param == "seq_axis" else -1),
                                     False if param == "tensor_parallel_output_grad" else 1)
        return call(x, g, **kwargs)
    return run


# ----------------------------------------------------------------------- FFTs
def _fft_case(path: str) -> Case:
    _, _, name, direction = path.split(".")
    pair = getattr(fft, name)
    call = pair if direction == "__call__" else pair.backward
    real = name in ("rfftn", "irfftn")
    field_side = (name in ("rfftn", "fftn")) == (direction == "__call__")

    def run(ctx: Context, param: str) -> Any:
        g = ctx.group()
        shape = (2 * g.size, 5, 4)
        placement = (fft.physical_placement(shape, g) if field_side
                     else fft.spectral_placement(shape, g, real=real))
        full = np.ones(placement.shape)
        if not (field_side and real):
            full = full + 1j
        x = placement.take(full)
        kwargs: dict[str, Any] = {"s": shape}
        if param in ("x", "dy"):
            x = ctx.pick(x, x.astype(np.complex64 if x.dtype.kind == "c" else np.float32))
        else:
            kwargs[param] = ctx.pick(kwargs.get(param), {
                "axes": (0, 2, 1), "norm": "ortho", "s": None,
                "out": np.empty(1, np.complex128)}[param])
        return call(x, g, **kwargs)
    return run


for _path, _entries in agreed.INVENTORY.items():
    _maker = (_collective_case(_path.rsplit(".", 1)[1]) if _path.startswith("pympar.collectives.")
              else _mapping_case(_path) if _path.startswith("pympar.mappings.")
              else _fft_case(_path) if _path.startswith("pympar.fft.") else None)
    if _maker is not None:
        for _param, _entry in _entries.items():
            if _entry.kind in ("label", "checked"):
                CASES[(_path, _param)] = lambda ctx, f=_maker, p=_param: f(ctx, p)


# ----------------------------------------------------------------------- halo
_HALO = "pympar.halo.HaloExchange."


def _halo(ctx: Context, **kwargs: Any) -> HaloExchange:
    g = ctx.group()
    return HaloExchange(Decomposition((4 * g.size, 6), {0: g}), **kwargs)


@case(_HALO + "__init__", "decomposition", "width", "faces")
def _halo_init(ctx: Context, param: str) -> Any:
    if param == "decomposition":
        g = ctx.group()
        return HaloExchange(Decomposition(ctx.pick((4 * g.size, 6), (4 * g.size + 1, 6)),
                                          {0: g}))
    return _halo(ctx, **{param: ctx.pick(*{"width": (1, 2),
                                           "faces": ("subarray", "packed")}[param])})


@case(_HALO + "forward", "x", "out")
def _halo_forward(ctx: Context, param: str) -> Any:
    h = _halo(ctx)
    x = np.ones(h.decomposition.local_shape)
    if param == "x":
        return h.forward(ctx.pick(x, x.astype(np.float32)))
    return h.forward(x, out=ctx.pick(None, np.empty(1)))


def _halo_padded(method: str) -> Case:
    def run(ctx: Context, param: str) -> Any:
        h = _halo(ctx)
        return getattr(h, method)(h.empty(dtype=ctx.pick(np.float64, np.float32)))
    return run


for _method, _param in (("backward", "dy"), ("exchange", "padded"), ("adjoint", "padded")):
    case(_HALO + _method, _param)(_halo_padded(_method))


@case(_HALO + "refuse", "error")
def _halo_refuse(ctx: Context, param: str) -> Any:
    h = _halo(ctx)
    if ctx.last:  # its input did not fit, say: it refuses where the others exchange
        return h.refuse("exchange", ValueError("this rank's input does not fit"))
    return h.exchange(h.empty())


@case("pympar.decomposition.Decomposition.__init__", "global_shape", "periodic")
def _decomposition(ctx: Context, param: str) -> Any:
    g = ctx.group()
    shape = (4 * g.size, 6)
    if param == "global_shape":
        return Decomposition(ctx.pick(shape, (4 * g.size, 7)), {0: g})
    return Decomposition(shape, {0: g}, periodic=ctx.pick(False, True))


# ----------------------------------------------------------------------- training
def _params(*shapes: tuple[int, ...]) -> list[Parameter]:
    params = [Parameter(np.ones(s), name=f"p{i}") for i, s in enumerate(shapes)]
    for p in params:
        p.grad = np.ones(p.shape)
    return params


@case("pympar.optim.allreduce_gradients", "module_or_params", "bucket_bytes", "average")
def _allreduce_gradients(ctx: Context, param: str) -> Any:
    g, params = ctx.group(), _params((3,), (4,))
    kwargs: dict[str, Any] = {}
    if param == "module_or_params":
        params = ctx.pick(params, params[::-1])
    elif param == "bucket_bytes":
        kwargs["bucket_bytes"] = ctx.pick(2**20, 1)
    else:
        kwargs["average"] = ctx.pick(True, False)
    return allreduce_gradients(params, g, **kwargs)


_ZERO = "pympar.zero.ZeroRedundancyOptimizer."


@case(_ZERO + "__init__", "params", "optimizer_class", "bucket_bytes", "kw")
@case(_ZERO + "step", "grad_scale")
def _zero(ctx: Context, param: str) -> Any:
    g = ctx.group()
    params = _params((4, 3), (5,)) if param != "params" else ctx.pick(
        _params((4, 3), (5,)), _params((4, 3), (6,)))
    kwargs: dict[str, Any] = {"lr": 1e-3}
    if param == "optimizer_class":
        kwargs["optimizer_class"] = ctx.pick(AdamW, Adam)
    elif param == "bucket_bytes":
        kwargs["bucket_bytes"] = ctx.pick(2**20, 1)
    elif param == "kw":
        kwargs["lr"] = ctx.pick(1e-3, 1e-2)
    optimizer = ZeroRedundancyOptimizer(params, group=g, **kwargs)
    return optimizer.step(**({"grad_scale": ctx.pick(1.0, 0.5)} if param == "grad_scale"
                             else {}))


@case("pympar.amp.GradScaler.__init__", "init_scale", "growth_factor", "backoff_factor",
      "growth_interval", "enabled")
def _scaler(ctx: Context, param: str) -> Any:
    g = ctx.group()
    theirs, mine = {"init_scale": (2.0**16, 2.0**10), "growth_factor": (2.0, 3.0),
                    "backoff_factor": (0.5, 0.25), "growth_interval": (2000, 100),
                    "enabled": (True, False)}[param]
    scaler = GradScaler(**{param: ctx.pick(theirs, mine)}, comm=g.comm)
    return scaler.step(SGD(_params((3,)), lr=0.1))


# ----------------------------------------------------------------------- checkpoints
def _model(out: int = 4) -> Linear:
    return Linear(3, out, dtype=np.float64)


@case("pympar.checkpoint.save", "path", "model", "optimizer", "step", "keep")
def _save(ctx: Context, param: str) -> Any:
    g = ctx.group()
    model = ctx.pick(_model(), _model(5)) if param == "model" else _model()
    kwargs = {"optimizer": SGD(model, lr=0.1)}
    if param == "optimizer":
        kwargs["optimizer"] = ctx.pick(kwargs["optimizer"], None)
    elif param in ("step", "keep"):
        kwargs[param] = ctx.pick(None, 2)
    path = os.path.join(ctx.folder, ctx.pick("a", "b") if param == "path" else "a")
    return save(path, model, comm=g, **kwargs)


@case("pympar.checkpoint.load", "path", "model", "optimizer")
def _load(ctx: Context, param: str) -> Any:
    g = ctx.group()
    model = _model()
    path = save(os.path.join(ctx.folder, "a"), model, SGD(model, lr=0.1), comm=g)
    if param == "path":
        save(os.path.join(ctx.folder, "b"), model, comm=g)
        path = ctx.pick(path, os.path.join(ctx.folder, "b"))
    if param == "model":
        model = ctx.pick(model, _model(5))
    optimizer = ctx.pick(SGD(model, lr=0.1), None) if param == "optimizer" else None
    return load(path, model, optimizer, comm=g)


# ----------------------------------------------------------------------- settings
@case("settings", "PYMPAR_DEBUG", "PYMPAR_TIMEOUT")
def _settings(ctx: Context, param: str) -> Any:
    if ctx.last and param == "PYMPAR_DEBUG":
        ctx.cleanups.append(debug.disable)
        debug.enable()
    elif ctx.last:
        debug.set_timeout(debug.get_timeout() + 1.0)  # the runner resets it
    return ctx.group()


del _path, _entries, _entry, _maker, _method, _param
