"""``state_dict`` / ``load_state_dict`` of the optimizers, checked before anything changes.

The state is a plain dict in torch's spirit: the optimizer's type, its hyperparameters and,
per parameter position, the step count and the moment arrays (shaped like the parameter's
shard). Subclasses name their moments (``state_keys``) and hyperparameters
(``hyperparameter_names``) and check the latter (``_check_hyperparameters``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["StateDictMixin"]


class StateDictMixin:
    """Saving and restoring an optimizer's state; mixed into :class:`pympar.optim.Optimizer`.

    The host class provides ``params`` (list of Parameter), ``steps`` (list of int, one per
    parameter) and, per name in ``state_keys``, a list of moment arrays (see ``_moments``).
    """

    #: Names of the per-parameter moment arrays, in order (subclasses override).
    state_keys: tuple[str, ...] = ()
    #: Names of the hyperparameters saved by :meth:`state_dict` (subclasses override).
    hyperparameter_names: tuple[str, ...] = ("lr",)

    def _moments(self, key: str) -> list[Any]:
        return getattr(self, key)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state as a plain dict (nothing is copied).

        Returns
        -------
        dict
            ``{"type": class name, "hyperparameters": {name: value}, "state": {i: {"step":
            int, <moment>: array, ...}}}`` where ``i`` is the parameter's position in
            ``params`` and each moment array is the live buffer, shaped like that parameter's
            shard (SGD without momentum has no moments; Adam has ``exp_avg`` and
            ``exp_avg_sq``). Hyperparameters are JSON-compatible (tuples become lists).
        """
        hyper = {}
        for name in self.hyperparameter_names:
            value = getattr(self, name)
            hyper[name] = list(value) if isinstance(value, tuple) else value
        state = {}
        for i in range(len(self.params)):
            entry: dict[str, Any] = {"step": int(self.steps[i])}
            for key in self.state_keys:
                entry[key] = self._moments(key)[i]
            state[i] = entry
        return {"type": type(self).__name__, "hyperparameters": hyper, "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output in place (moments copied into the live buffers).

        Parameters
        ----------
        state_dict : dict
            As returned by :meth:`state_dict` of the same optimizer type over parameters of the
            same shapes; NumPy moments may load into CuPy buffers.

        Raises
        ------
        TypeError
            If ``state_dict`` is not a mapping, or an entry has the wrong type.
        ValueError
            On a wrong optimizer type, missing or unexpected entries, a moment whose shape or
            dtype differs from its parameter's shard, or an invalid hyperparameter. The message
            names the entry; nothing is changed when an error is raised.
        """
        checked = self.check_state_dict(state_dict)
        state = state_dict["state"]
        # Everything checked: now change the optimizer.
        from pympar.modules.core import _copy_into

        for name, value in checked.items():
            setattr(self, name, value)
        for i in range(len(self.params)):
            self.steps[i] = int(state[i]["step"])
            for key in self.state_keys:
                _copy_into(self._moments(key)[i], state[i][key])

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``state_dict`` as :meth:`load_state_dict` does, changing nothing.

        Returns
        -------
        dict
            The checked hyperparameters (as they would be set).

        Raises
        ------
        TypeError, ValueError
            Exactly as :meth:`load_state_dict`.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: expected the dict returned by state_dict(), got "
                            f"{type(state_dict).__name__}")
        if set(state_dict) != {"type", "hyperparameters", "state"}:
            raise ValueError(f"{where}: expected keys ['hyperparameters', 'state', 'type'], "
                             f"got {sorted(map(str, state_dict))}")
        if state_dict["type"] != type(self).__name__:
            raise ValueError(f"{where}: state of a {state_dict['type']!r} optimizer")
        hyper, state = state_dict["hyperparameters"], state_dict["state"]
        if not isinstance(hyper, Mapping) or set(hyper) != set(self.hyperparameter_names):
            raise ValueError(f"{where}: 'hyperparameters' must have the keys "
                             f"{sorted(self.hyperparameter_names)}, got {hyper!r}")
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: 'state' must be a dict keyed by parameter position, got "
                            f"{type(state).__name__}")
        want = set(range(len(self.params)))
        if set(state) != want:
            raise ValueError(f"{where}: 'state' has entries {sorted(state, key=str)}, expected "
                             f"one per parameter position 0..{len(self.params) - 1}")
        for i, p in enumerate(self.params):
            entry = state[i]
            label = f"state[{i}] ({p.name or 'unnamed'})"
            if not isinstance(entry, Mapping) or set(entry) != {"step", *self.state_keys}:
                raise ValueError(f"{where}: {label} must have the keys "
                                 f"{sorted(['step', *self.state_keys])}")
            step = entry["step"]
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
                raise ValueError(f"{where}: {label}['step'] must be an int >= 0, got {step!r}")
            for key in self.state_keys:
                value = entry[key]
                if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                    raise TypeError(f"{where}: {label}[{key!r}] must be an array, got "
                                    f"{type(value).__name__}")
                if tuple(value.shape) != p.shape or value.dtype != p.dtype:
                    raise ValueError(f"{where}: {label}[{key!r}] has shape {tuple(value.shape)} "
                                     f"and dtype {value.dtype}, expected {p.shape} and "
                                     f"{p.dtype} (the parameter's shard)")
        return self._check_hyperparameters(
            {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()})

    def _check_hyperparameters(self, hyper: dict[str, Any]) -> dict[str, Any]:
        lr = hyper["lr"]
        if not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"{type(self).__name__}.load_state_dict: lr must be a number >= 0, "
                             f"got {lr!r}")
        return {"lr": float(lr)}
