"""Mixed precision: a loss scaler with torch's semantics, and float32 master weights.

Parameters and compute may be float16 or bfloat16 (``pympar.backend.bfloat16``); the update
then runs on float32 master weights, with the gradients reduced and unscaled in float32.
:func:`master_weights_optimizer` gives an unsharded optimizer with masters;
:class:`pympar.zero.ZeroRedundancyOptimizer` keeps masters for its share only.

A :class:`GradScaler` multiplies the loss gradient by a scale so that small float16 gradients
do not flush to zero, then unscales them before the update. Overflow (inf/NaN anywhere, on any
rank) skips the step on every rank and halves the scale; after ``growth_interval`` clean steps
the scale doubles.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from mpi4py import MPI

from . import manager
from .backend import array_module
from .collectives import label
from .debug import CollectiveMismatchError
from .group import Group, self_group
from .modules.core import Module
from .modules.parameter import Parameter
from .optim import AdamW
from .settings import check_same
from .zero import ZeroRedundancyOptimizer

__all__ = ["GradScaler", "master_weights_optimizer", "self_group"]


def master_weights_optimizer(params: Module | Iterable[Parameter], optimizer_class: type = AdamW,
                             **kw: Any) -> ZeroRedundancyOptimizer:
    """An unsharded optimizer that keeps float32 masters for half-precision parameters.

    Use it where a plain optimizer would go (after ``allreduce_gradients``, which reduces
    float16/bfloat16 in float32): ``step`` casts the gradients to float32, updates the masters
    with ``optimizer_class(**kw)`` and rounds them into the parameters. Float32/float64
    parameters are updated in place as by ``optimizer_class`` itself.

    Parameters
    ----------
    params : Module or iterable of Parameter
    optimizer_class : type, default :class:`pympar.optim.AdamW`
    **kw
        Passed to ``optimizer_class``.

    Returns
    -------
    ZeroRedundancyOptimizer
        Over this rank alone (:func:`self_group`): the whole parameter is its share.
    """
    return ZeroRedundancyOptimizer(params, optimizer_class, group=self_group(), **kw)


class GradScaler:
    """Dynamic loss scaling (torch ``GradScaler`` semantics), agreed across all ranks.

    Typical step::

        model.backward(scaler.scale(loss_grad))
        allreduce_gradients(model, dp)      # not with ZeroRedundancyOptimizer
        scaler.step(optimizer)              # skipped everywhere on inf/NaN
        scaler.update()

    Parameters
    ----------
    init_scale : float, default 2**16
    growth_factor : float, default 2.0
        Applied after ``growth_interval`` consecutive steps without inf/NaN.
    backoff_factor : float, default 0.5
        Applied after a step with inf/NaN (that step is skipped).
    growth_interval : int, default 2000
    enabled : bool, default True
        False: ``scale`` is the identity, ``step`` just steps (after the check below),
        ``update`` does nothing.
    comm : mpi4py.MPI.Intracomm, optional
        Where the found-inf flag is agreed (one small all-reduce per step); default the
        parallel state's world (every TP, CP and DP rank) or ``MPI.COMM_WORLD``. Building
        the scaler is collective over it.

    Notes
    -----
    Every :meth:`step`, enabled or not, makes one checked pympar all-reduce on ``comm``
    under a label naming ``enabled`` and the growth settings, and carrying the scale and
    growth counter: ranks whose scalers differ in any of these raise
    :class:`~pympar.debug.CollectiveMismatchError` on every rank instead of stepping apart.

    Attributes
    ----------
    found_inf : bool or None
        Whether any :meth:`step` since the last :meth:`update` found inf/NaN (and skipped);
        ``None`` before a step.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 comm: MPI.Intracomm | None = None) -> None:
        error = None
        if not init_scale > 0 or not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            error = ValueError("GradScaler: need init_scale > 0, growth_factor > 1 and "
                               f"0 < backoff_factor < 1, got {init_scale}, {growth_factor}, "
                               f"{backoff_factor}")
        elif growth_interval < 1:
            error = ValueError(f"GradScaler: growth_interval must be >= 1, got "
                               f"{growth_interval}")
        self._comm = manager.parallel_comm() if comm is None else comm
        # Collective (as the group below): a rank that refuses its arguments must not leave
        # the others waiting there, so the refusal is compared first and raised everywhere.
        check_same(self._comm, "GradScaler", "" if error is None else
                   f"refused by this rank: {error}")
        if error is not None:
            raise error
        self.enabled = bool(enabled)
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self.found_inf: bool | None = None
        self._group = _group_of(self._comm)
        self._label = (f"GradScaler(enabled={self.enabled}, growth_factor={self.growth_factor}, "
                       f"backoff_factor={self.backoff_factor}, "
                       f"growth_interval={self.growth_interval}).step")
        # [found inf, scale, -scale, growth counter, -growth counter], reduced with max:
        # the flag is agreed, and ranks holding another scale or counter tell apart.
        self._flag = np.zeros(5, dtype=np.float64)

    def get_scale(self) -> float:
        """float: The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, x: Any) -> Any:
        """Return ``x * scale`` in ``x``'s dtype (the loss gradient to back-propagate).

        As torch does, the product is taken in float32 (at least) and rounded once to
        ``x``'s dtype: the default scale 2**16 is itself beyond float16's range, so a
        float16 multiplication would turn every gradient into inf.
        """
        if not self.enabled:
            return x
        work = np.promote_types(x.dtype, np.float32)
        return (x.astype(work) * work.type(self._scale)).astype(x.dtype, copy=False)

    def step(self, optimizer: Any) -> bool:
        """Unscale and step ``optimizer`` unless any rank's gradients hold inf/NaN.

        Gradients of ``optimizer.params`` are checked locally (before any sharded reduction)
        and the verdict agreed over ``comm``. Optimizers with ``takes_grad_scale`` (ZeRO and
        :func:`master_weights_optimizer`) unscale in float32 inside their step; others get
        their gradients multiplied by ``1 / scale`` in place first.

        Returns
        -------
        bool
            True when the step ran, False when it was skipped (on every rank alike).
        """
        flag = self._flag
        if self.enabled:
            flag[:] = (_has_nonfinite(optimizer.params), self._scale, -self._scale,
                       self._growth_tracker, -self._growth_tracker)
        else:
            flag[:] = 0.0
        with label(self._label):  # ranks disabled where others are enabled raise here
            self._group.all_reduce(flag, op="max", out=flag)
        if flag[1] != -flag[2] or flag[3] != -flag[4]:
            raise CollectiveMismatchError(
                f"GradScaler.step: the ranks of group {self._group.name!r} hold different "
                f"scales (from {0.0 - flag[2]} to {flag[1]}) or growth counters (from "
                f"{0.0 - flag[4]:.0f} to {flag[3]:.0f}); every rank raises")
        if not self.enabled:
            optimizer.step()
            return True
        # Kept until update(): with several optimizers, one overflow backs the scale off
        # even when a later step is clean (torch's rule).
        overflow = bool(flag[0])
        self.found_inf = overflow or bool(self.found_inf)
        if overflow:
            return False
        inv = 1.0 / self._scale
        if getattr(optimizer, "takes_grad_scale", False):
            optimizer.step(grad_scale=inv)
        else:
            for p in optimizer.params:
                if p.grad is not None:
                    p.grad *= inv
            optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale after :meth:`step`: x``backoff_factor`` when any step since the
        last update found inf/NaN, else count one clean step.

        Raises
        ------
        RuntimeError
            When no :meth:`step` ran since the last update.
        """
        if not self.enabled:
            return
        if self.found_inf is None:
            raise RuntimeError("GradScaler.update: call step(optimizer) first")
        if self.found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self.found_inf = None

    def state_dict(self) -> dict[str, float | int]:
        """The scale and growth counter (plain numbers)."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore :meth:`state_dict`."""
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])


def _group_of(comm: MPI.Intracomm) -> Group:
    """A group over ``comm`` (collective: it sets up the agreement check's board)."""
    ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                      MPI.COMM_WORLD.Get_group())
    return Group(comm, "grad-scaler", ranks, owns_comm=False)


def _has_nonfinite(params: list[Parameter]) -> bool:
    # One float64 sum per gradient: inf and NaN propagate through it, and a float64
    # accumulator cannot overflow on finite half/single-precision values.
    total = None
    with np.errstate(over="ignore", invalid="ignore"):  # inf - inf = NaN is the answer sought
        for p in params:
            if p.grad is not None:
                s = p.grad.sum(dtype=np.float64)
                total = s if total is None else total + s
    if total is None:
        return False
    return not bool(array_module(total).isfinite(total))
