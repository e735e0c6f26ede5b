"""Memory accounting: this rank's bytes in parameters, gradients, optimizer state, activations.

Counts the arrays pympar holds (``nbytes``), not the allocator's view, so that tests and
benchmarks can compare them exactly with formulas such as ``8/d`` bytes of Adam moments per
float32 parameter under :class:`~pympar.zero.ZeroRedundancyOptimizer`. Each array is counted
once even when several objects refer to it (same address and size).
"""

from __future__ import annotations

from typing import Any, Iterable

from .modules.core import Module, as_parameter_list
from .modules.parameter import Parameter
from .optim import Optimizer
from .zero import ZeroRedundancyOptimizer, per_param_state

__all__ = ["parameter_bytes", "gradient_bytes", "optimizer_bytes", "workspace_bytes",
           "activation_bytes", "memory_report"]


def _owned(arrays: Iterable[Any]) -> int:
    """Bytes of ``arrays``, each distinct block of memory once (same address and size)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for a in arrays:
        if a is None or not hasattr(a, "nbytes"):
            continue
        key = (_address(a), int(a.nbytes))
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def _address(a: Any) -> int:
    if hasattr(a, "__array_interface__"):
        return int(a.__array_interface__["data"][0])
    return int(a.data.ptr)  # CuPy


def parameter_bytes(params: Module | Iterable[Parameter]) -> int:
    """Bytes of the parameters' ``data`` on this rank."""
    return _owned(p.data for p in as_parameter_list(params))


def gradient_bytes(params: Module | Iterable[Parameter], optimizer: Any = None) -> int:
    """Bytes of the parameters' gradients on this rank.

    With a :class:`~pympar.zero.ZeroRedundancyOptimizer`, its float32 gradient shares of
    half-precision parameters (``4/d`` bytes per parameter, sized for the largest rank's share
    in each bucket) are added.
    """
    grads = [p.grad for p in as_parameter_list(params)]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        grads += list(optimizer._grad_flats.values())
    return _owned(grads)


def optimizer_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state: per-parameter state arrays, plus float32 masters under ZeRO.

    Scratch and communication buffers are not state; see :func:`workspace_bytes`.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        masters = [s.data for s, m in zip(optimizer.shares, optimizer.masters) if m]
        return optimizer_bytes(optimizer.optimizer) + _owned(masters)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer_bytes: expected a pympar optimizer, got "
                        f"{type(optimizer).__name__}")
    arrays = [a for values in per_param_state(optimizer).values() for a in values]
    return _owned(arrays)


def workspace_bytes(optimizer: Any) -> int:
    """Bytes of an optimizer's scratch and communication buffers (bounded, size-independent).

    For ZeRO: the wrapped optimizer's scratch (the largest share) and the bucket buffers
    (at most ``bucket_bytes`` per role and dtype).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return workspace_bytes(optimizer.optimizer) + _owned(optimizer._scratch.values())
    return _owned(optimizer._scratch.values())


def activation_bytes(module: Module) -> int:
    """Bytes of the arrays cached for backward (``save_for_backward``) in ``module``'s tree.

    Read it after a forward: it is the activation memory that backward will release.
    """
    arrays: list[Any] = []
    for m in module.modules():
        _collect(m.__dict__.get("_saved"), arrays)
    return _owned(arrays)


def _collect(item: Any, out: list[Any]) -> None:
    if isinstance(item, (tuple, list)):
        for x in item:
            _collect(x, out)
    elif hasattr(item, "nbytes") and hasattr(item, "shape"):
        out.append(item)


def memory_report(model: Module, optimizer: Any = None) -> dict[str, int]:
    """This rank's bytes by kind.

    Returns
    -------
    dict of str to int
        ``parameters``, ``gradients``, ``optimizer``, ``workspace`` and ``activations``
        (cached now), and ``total``; the optimizer entries are 0 without an optimizer.
    """
    report = {
        "parameters": parameter_bytes(model),
        "gradients": gradient_bytes(model, optimizer),
        "optimizer": 0 if optimizer is None else optimizer_bytes(optimizer),
        "workspace": 0 if optimizer is None else workspace_bytes(optimizer),
        "activations": activation_bytes(model),
    }
    report["total"] = sum(report.values())
    return report
