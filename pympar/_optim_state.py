"""``state_dict`` / ``load_state_dict`` of the optimizers, checked before anything changes.

The state is a plain dict in torch's spirit: the optimizer's type, its hyperparameters and,
per parameter position, the step count and the moment arrays (shaped like the parameter's
shard). Subclasses name their moments (``state_keys``) and hyperparameters
(``hyperparameter_names``) and check the latter (``_check_hyperparameters``).

The *local* state protocol is what :mod:`pympar.checkpoint` uses, for these optimizers and for
:class:`pympar.zero.ZeroRedundancyOptimizer` alike: :meth:`~StateDictMixin.local_state_dict`
has the format of ``state_dict()`` with every array being this rank's block, and
:meth:`~StateDictMixin.state_placements` says where that block sits in the full serial
array. Here the block is the parameter's shard; under ZeRO it is this rank's share of it,
so the checkpoint never gathers state.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .backend import array_module
from .modules.core import _copy_into

__all__ = ["StateDictMixin", "ShardedStateMixin"]


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
        for name, value in checked.items():
            setattr(self, name, value)
        for i in range(len(self.params)):
            self.steps[i] = int(state[i]["step"])
            for key in self.state_keys:
                live = self._moments(key)[i]
                if state[i][key] is not live:  # a checkpoint load has filled the live buffer
                    _copy_into(live, state[i][key])

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

    # -- local state protocol (pympar.checkpoint): no communication, nothing copied ----------
    def state_placements(self) -> list[Any]:
        """Per parameter position, the placement of the arrays of :meth:`local_state_dict`.

        Returns
        -------
        list of Placement
            Here each parameter's own ``placement``: the moments are shaped like its shard.
        """
        return [p.placement for p in self.params]

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's block of the state: here the same as :meth:`state_dict` (not collective)."""
        return self.state_dict()

    def check_local_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Check a :meth:`local_state_dict`-shaped dict, changing nothing.

        Here exactly :meth:`check_state_dict`.
        """
        return self.check_state_dict(state_dict)

    def load_local_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`local_state_dict` output in place (as :meth:`load_state_dict`)."""
        self.load_state_dict(state_dict)

    def _check_hyperparameters(self, hyper: dict[str, Any]) -> dict[str, Any]:
        lr = hyper["lr"]
        if not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"{type(self).__name__}.load_state_dict: lr must be a number >= 0, "
                             f"got {lr!r}")
        return {"lr": float(lr)}


class ShardedStateMixin:
    """The state of :class:`pympar.zero.ZeroRedundancyOptimizer`, in the plain optimizers' format.

    The host class provides ``optimizer`` (the wrapped optimizer, built on the shares),
    ``params``, ``shares`` (share-parameters with their ``placement``), ``masters`` (bool per
    parameter), ``group`` and ``_rows`` (per parameter, every rank's rows as slices).
    """

    def state_placements(self) -> list[Any]:
        """Per parameter, the placement of this rank's share (of every state array of it).

        ``self.optimizer``'s state arrays for parameter ``i`` (e.g. ``exp_avg[i]``) and the
        master ``shares[i].data`` are this block of the full serial array.
        """
        return [s.placement for s in self.shares]

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's share of the state, in the plain optimizers' format; not collective.

        Returns
        -------
        dict
            The wrapped optimizer's ``state_dict()``: ``{"type": its class name (e.g.
            ``"AdamW"``), "hyperparameters": {...}, "state": {i: {"step": int, <moment>:
            share array, ...}}}`` with ``i`` the position in :attr:`params`, plus
            ``"master"`` (the float32 master share) for a half-precision parameter. Arrays are
            the live buffers; those of parameter ``i`` are the block
            ``state_placements()[i]`` of the full serial array, which is where
            :mod:`pympar.checkpoint` writes and reads them: nothing is gathered.
        """
        state = self.optimizer.state_dict()
        for i, master in enumerate(self.masters):
            if master:
                state["state"][i]["master"] = self.shares[i].data
        return state

    def check_local_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Check a :meth:`local_state_dict`-shaped dict (this rank's shares), changing nothing.

        Returns
        -------
        dict
            The checked hyperparameters.

        Raises
        ------
        TypeError, ValueError
            As the wrapped optimizer's ``check_state_dict`` (another optimizer type, a missing
            entry, a share of the wrong shape or dtype), or a master of the wrong shape or dtype.
        """
        inner, masters = self._split_masters(state_dict)
        checked = self.optimizer.check_state_dict(inner)
        for i, master in masters.items():
            share = self.shares[i]
            if (not hasattr(master, "shape") or tuple(master.shape) != share.shape
                    or master.dtype != share.data.dtype):
                raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: state[{i}]['master'] "
                                 f"({share.name or 'unnamed'}) must be a {share.data.dtype} "
                                 f"array of shape {share.shape} (this rank's share)")
        return checked

    def load_local_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`local_state_dict` output (this rank's shares) in place; not collective.

        A half-precision parameter without a ``"master"`` entry gets its master from the
        parameter. Everything is checked (:meth:`check_local_state_dict`) before anything
        changes.
        """
        self.check_local_state_dict(state_dict)
        inner, masters = self._split_masters(state_dict)
        self.optimizer.load_state_dict(inner)
        me = self.group.rank
        for i, share in enumerate(self.shares):
            if not self.masters[i]:
                continue
            src = masters.get(i)
            if src is None:
                src = self.params[i].data[self._rows[i][me]]
            if src is not share.data:  # a checkpoint load has filled the live master already
                share.data[...] = _to_module(src, share.data)

    def _split_masters(self, state_dict: Any) -> tuple[Any, dict[int, Any]]:
        """The wrapped optimizer's part of a local state dict, and the masters by position.

        Malformed input comes back unchanged, for the wrapped optimizer's check to refuse.
        """
        state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if not isinstance(state, Mapping):
            return state_dict, {}
        inner, masters = {}, {}
        for i, entry in state.items():
            if (isinstance(entry, Mapping) and "master" in entry and isinstance(i, int)
                    and 0 <= i < len(self.masters) and self.masters[i]):
                masters[i] = entry["master"]
                entry = {k: v for k, v in entry.items() if k != "master"}
            inner[i] = entry
        return dict(state_dict, state=inner), masters

    def state_dict(self) -> dict[str, Any]:
        """The state for the full local parameters, as an unsharded optimizer holds it; collective.

        Every rank of ``group`` must call it: each share is all-gathered. For checkpoints use
        :mod:`pympar.checkpoint`, which writes the shares where they belong without gathering.

        Returns
        -------
        dict
            :meth:`local_state_dict` with every array gathered to its parameter's (local)
            shape: for float32/float64 parameters exactly what the wrapped optimizer class
            (e.g. :class:`pympar.optim.AdamW`) built on the same parameters returns, so either
            loads the other's state.
        """
        state = self.local_state_dict()
        for i, entry in state["state"].items():
            for key, value in entry.items():
                if key != "step":
                    entry[key] = self._gather_share(i, value)
        return state

    def _gather_share(self, i: int, value: Any) -> Any:
        sizes = tuple(rows.stop - rows.start for rows in self._rows[i])
        return self.group.all_gather(array_module(value).ascontiguousarray(value), axis=0,
                                     sizes=sizes)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict` (of ZeRO on any group size, or of the plain optimizer).

        Not collective: each rank keeps its share of every array.

        Raises
        ------
        TypeError, ValueError
            When the state does not fit (another optimizer type, a missing entry, an array not
            shaped like its parameter, ...); nothing is modified.
        """
        me = self.group.rank
        state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if not isinstance(state, Mapping):
            self.load_local_state_dict(state_dict)  # refused there, with the plain message
            return
        local = {}
        for i, entry in state.items():
            if isinstance(entry, Mapping) and isinstance(i, int) and 0 <= i < len(self.params):
                p, rows = self.params[i], self._rows[i][me]
                entry = dict(entry)
                for key, value in entry.items():
                    if not hasattr(value, "shape") or key == "step":
                        continue
                    if tuple(value.shape) != p.shape:
                        raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: state[{i}]"
                                         f"[{key!r}] ({p.name or 'unnamed'}) has shape "
                                         f"{tuple(value.shape)}, expected the parameter's "
                                         f"{p.shape}")
                    entry[key] = value[rows]
            local[i] = entry
        self.load_local_state_dict(dict(state_dict, state=local))


def _to_module(src: Any, like: Any) -> Any:
    # A CuPy source must come to the host before landing in a NumPy destination, and back.
    if hasattr(src, "get") and not hasattr(like, "get"):
        return src.get()
    return array_module(like).asarray(src)
