"""The ``Module`` base class and ``Sequential``.

Every layer in pympar has a hand-written backward: ``forward`` caches exactly what ``backward``
needs, and ``backward(dy)`` returns the input gradient and accumulates (``+=``) parameter
gradients. There is no autograd tape.

A parallel layer names itself once (:meth:`Module.label_calls`) and starts its forward and
backward with one agreement (:meth:`Module.agreement`): the ranks of its group compare the
layer's label and the input's dtype and every extent that is not split over them, so that a
layer built differently, or an input refused, on one rank raises on every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator, Mapping

import weakref
import zlib

import numpy

from .. import _agreement, backend, debug
from .._agreement import Label
from .parameter import Parameter
from .validation import layer_name

__all__ = ["Module", "Sequential", "check_backward_done", "described_init"]

# Layers that cached a training-mode forward in debug mode, for check_backward_done; weak:
# a layer that is gone has nothing pending. Empty outside debug mode.
_cached_in_debug: "weakref.WeakSet[Module]" = weakref.WeakSet()
# Debug mode: how many caches backward passes have consumed, the clock that tells a skipped
# backward (others ran after the cache was saved) from a forward-only pass (none did).
_backwards_run = [0]

# (label, dtype, masked shape, extra) -> the agreement's signature; bounded.
_SIGNATURES: dict[tuple, int] = {}
_MAX_SIGNATURES = 4096


class Module:
    """Base class of layers with hand-written backward.

    Subclasses implement ``forward`` (caching what backward needs, e.g. via
    :meth:`save_for_backward`) and ``backward(dy) -> dx``, which accumulates into every
    parameter's ``grad``. Assigning a :class:`Parameter` or :class:`Module` to an attribute
    registers it; registration order fixes the order of :meth:`parameters`.

    Attributes
    ----------
    training : bool
        Training mode flag, toggled by :meth:`train` and :meth:`eval`.
    input_grad : bool
        Whether :meth:`backward` computes the input gradient (class default True). A layer
        built with ``input_grad=False`` computes neither that gradient nor the collective
        that reduces it, and its ``backward`` returns None: the first layer of a model,
        whose input is data.
    """

    input_grad: bool = True

    def __init__(self) -> None:
        if "_parameters" in self.__dict__:
            # Attributes were registered before this call; keep them.
            return
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "training", True)

    # -- registration ------------------------------------------------------------------
    def _registries(self) -> tuple[OrderedDict, OrderedDict]:
        # Tolerate subclasses that assign attributes before calling Module.__init__.
        if "_parameters" not in self.__dict__:
            Module.__init__(self)
        return self.__dict__["_parameters"], self.__dict__["_modules"]

    def __setattr__(self, name: str, value: Any) -> None:
        params, mods = self._registries()
        # Re-assigning a name to a different kind of value must unregister the old entry.
        if not isinstance(value, Parameter):
            params.pop(name, None)
        if not isinstance(value, Module):
            mods.pop(name, None)
        if isinstance(value, Parameter):
            if value.name is None:
                value.name = name
            params[name] = value
        elif isinstance(value, Module):
            mods[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        params, mods = self._registries()
        params.pop(name, None)
        mods.pop(name, None)
        object.__delattr__(self, name)

    # -- labels and the agreement -------------------------------------------------------
    _agreed: tuple[str, ...] = ()

    def label_calls(self, name: str, agreed: tuple[str, ...] = ()) -> None:
        """Name this layer's forward and backward: ``name + ".forward"`` and ``".backward"``.

        ``name`` holds what every rank of the group must share (class, global sizes,
        flags, dtype); :meth:`agreement` compares it, statistics record the collectives
        inside under it (``"Linear3D(8->16, ...).forward:all_gather"``), and errors name it.
        ``agreed`` is more that every rank must share but the name leaves out (the init's
        seed and methods: :func:`described_init`); :meth:`agreement` compares it too, and a
        mismatch report shows it. :mod:`pympar.agreed` lists what each layer compares.
        """
        object.__setattr__(self, "_labels", {d: Label(f"{name}.{d}")
                                             for d in ("forward", "backward")})
        object.__setattr__(self, "_agreed", tuple(agreed))

    def agreement(self, direction: str, x: Any, group: Any, split: tuple[int, ...] = (),
                  sizes_of: int | None = None, extra: tuple = (),
                  validate: tuple | None = None) -> Label:
        """Agree once with the ranks of ``group``; return the label block to run in.

        Start ``forward`` and ``backward`` with ``with self.agreement("forward", x, g):``.
        The ranks compare the layer's label (inside any enclosing one) and what
        :meth:`label_calls` was given to agree, ``input_grad`` in a backward, whether ``x`` is
        an array, its dtype, its number of dimensions and its extents except those along the
        ``split`` axes, ``extra``, and the outcome of ``validate``: every rank raises
        :class:`~pympar.errors.CollectiveMismatchError` when they differ (naming what a
        rank refused), and each rank its own error when every rank refused alike.

        Parameters
        ----------
        direction : {"forward", "backward"}
            Which label (see :meth:`label_calls`).
        x : array or any
            The input (or output gradient).
        group : Group
            The ranks that run the layer together.
        split : tuple of int
            Axes whose extent may differ between ranks (blocks of a split axis).
        sizes_of : int, optional
            An axis of ``split`` whose every rank's extent the ranks learn in the same
            agreement (one small exchange more): entering the block gives them.
        extra : tuple
            More that must be equal (e.g. a checksum of key lengths).
        validate : tuple, optional
            ``(function, *arguments)``: the layer's own check of ``x`` (raising TypeError
            or ValueError), run first.

        Returns
        -------
        Label
            The block; ``with ... as sizes`` gives the extents of ``sizes_of`` (else None).
        """
        block = self._labels[direction]
        array = type(x) is numpy.ndarray or backend.is_cupy_array(x)
        learn = sizes_of is not None and array and -x.ndim <= sizes_of < x.ndim
        refused = None
        if debug._enabled and direction == "forward" and self.training and \
                self._skipped_backward():
            refused = self._pending_error()  # before any collective of this forward
        elif validate is not None:
            try:
                validate[0](*validate[1:])
            except (TypeError, ValueError) as error:
                refused = error
        if group.size == 1:
            if refused is not None:
                raise refused
            return Label(block.name, (x.shape[sizes_of],)) if learn else block
        board = group._state.board
        if board is None:
            raise RuntimeError(f"{block.name}: group {group.name!r} has been freed (Group.free "
                               f"or manager.destroy_parallel); use the groups of the current "
                               f"state")
        name = block.name if _agreement._label is None else _agreement.within(block.name)
        fixed = self._agreed  # and input_grad=False, which makes fewer collectives
        if direction == "backward" and not self.input_grad:
            fixed += ("input_grad=False",)
        if array:
            shape = x.shape
            for axis in split:
                if -x.ndim <= axis < x.ndim:
                    axis %= x.ndim
                    shape = shape[:axis] + (-1,) + shape[axis + 1:]
            key = (name, x.dtype.str, shape, extra, fixed)
        else:
            key = (name, f"not an array: {type(x).__name__}", None, extra, fixed)
        if refused is not None:  # the fact, not the text: messages name rank-local groups
            key += (f"refused by this rank ({type(refused).__name__})",)
        sig = _SIGNATURES.get(key)
        if sig is None:
            if len(_SIGNATURES) >= _MAX_SIGNATURES:
                _SIGNATURES.clear()
            sig = _SIGNATURES[key] = zlib.crc32(repr(key).encode()) | 1
        if not learn or refused is not None:
            if not board.agree(sig, group, name, debug._timeout):
                debug.report(group, _described(self, x, key, refused), _must_hold(x, split))
            if refused is not None:  # every rank refused alike: each raises its own error
                raise refused
            return block
        return Label(block.name, _agreement.extents(group, sig, _described(self, x, key, None),
                                                    None, x.shape[sizes_of],
                                                    hint=_must_hold(x, split)))

    # -- forward / backward ------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the output and cache what :meth:`backward` needs."""
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    def backward(self, dy: Any) -> Any:
        """Return the input gradient (None when ``input_grad`` is False) and accumulate the
        gradients of parameters that require one."""
        raise NotImplementedError(f"{type(self).__name__}.backward is not implemented")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def save_for_backward(self, *items: Any) -> None:
        """Cache ``items`` for the next :meth:`backward`.

        In debug mode (:mod:`pympar.debug`) a training-mode forward whose previous forward's
        cache is still pending although other layers' backward ran since (this one's was
        skipped on this rank) raises RuntimeError naming the layer and the rank, and so does
        ``allreduce_gradients`` with such a cache pending. A forward-only pass (no backward
        since) just replaces the cache, as it always does outside debug mode.
        """
        if debug._enabled and self.training:
            if self._skipped_backward():
                raise self._pending_error()
            _cached_in_debug.add(self)
            object.__setattr__(self, "_saved_at", _backwards_run[0])
        object.__setattr__(self, "_saved", items)

    def _skipped_backward(self) -> bool:
        """Debug mode: whether this layer's cache is pending although some layer's backward
        ran after it was saved (a forward-only pass, with no backward since, is not a skip)."""
        return (self.__dict__.get("_saved") is not None
                and self.__dict__.get("_saved_at", _backwards_run[0]) != _backwards_run[0])

    def _pending_error(self) -> RuntimeError:
        """Debug mode's error for a forward while the previous one's cache is pending."""
        return RuntimeError(
            f"{layer_name(self)} on {_this_rank()}: a forward while the previous forward's "
            f"cache is still pending, although other layers' backward ran since: its backward "
            f"was skipped on this rank (stopped early upstream?), and its gradients lack that "
            f"step; run backward through every layer (debug mode checks this)")

    def saved_tensors(self) -> tuple:
        """Return and release the cache of the last forward.

        Releasing it lets activations be freed as soon as backward has used them.

        Raises
        ------
        RuntimeError
            If no forward has run since the last backward.
        """
        saved = self.__dict__.get("_saved")
        if saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        object.__setattr__(self, "_saved", None)
        if debug._enabled:
            _backwards_run[0] += 1
        return saved

    # -- traversal ---------------------------------------------------------------------
    def children(self) -> Iterator["Module"]:
        """Yield direct submodules in registration order, each once."""
        seen: set[int] = set()
        for mod in self._registries()[1].values():
            if id(mod) not in seen:
                seen.add(id(mod))
                yield mod

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """Yield ``(dotted_name, module)`` for this module and every descendant, pre-order."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            name, mod = stack.pop()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            yield name, mod
            kids = list(mod._registries()[1].items())
            stack.extend((f"{name}.{k}" if name else k, m) for k, m in reversed(kids))

    def modules(self) -> Iterator["Module"]:
        """Yield this module and every descendant, pre-order."""
        for _, mod in self.named_modules():
            yield mod

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Yield ``(dotted_name, parameter)``, e.g. ``("fc1.weight", p)``.

        The names are stable: they depend only on the attribute names the modules were
        assigned to (``Sequential`` children are ``"0"``, ``"1"``, ...), not on the layout,
        so a serial and a parallel model built alike give the same names. Checkpoints and
        :meth:`state_dict` key on them. Order: each module's own parameters in assignment
        order, then its submodules recursively. A parameter shared by several modules is
        yielded once, under its first name.

        Parameters
        ----------
        prefix : str, default ""
            Prepended (with a dot) to every name.
        """
        seen: set[int] = set()
        for mod_name, mod in self.named_modules(prefix):
            for pname, p in mod._registries()[0].items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{pname}" if mod_name else pname), p

    def parameters(self) -> list[Parameter]:
        """Return all parameters in the deterministic order of :meth:`named_parameters`."""
        return [p for _, p in self.named_parameters()]

    # -- state -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset every parameter gradient; see :meth:`Parameter.zero_grad`."""
        for p in self.parameters():
            p.zero_grad(set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        """Set ``requires_grad`` on every parameter (False freezes them); return self.

        A frozen parameter gets no gradient: layers skip computing and accumulating it, and
        the optimizers and the data-parallel gradient all-reduce skip it. Checkpoints still
        save it.
        """
        for p in self.parameters():
            p.requires_grad = bool(requires_grad)
        return self

    def train(self, mode: bool = True) -> "Module":
        """Set the training flag on this module and all descendants; return self."""
        for mod in self.modules():
            object.__setattr__(mod, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        """Switch to evaluation mode; return self."""
        return self.train(False)

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Return an ordered mapping of dotted parameter names to copies of their values."""
        return OrderedDict((name, p.data.copy()) for name, p in self.named_parameters())

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Copy values from ``state_dict`` into the parameters, in place.

        Parameters
        ----------
        state_dict : mapping of str to array
            As produced by :meth:`state_dict`; NumPy values may load into CuPy parameters.
        strict : bool, default True
            Raise when keys are missing or unexpected; otherwise skip them.

        Returns
        -------
        missing, unexpected : list of str
            Keys absent from ``state_dict`` and keys with no matching parameter.

        Raises
        ------
        TypeError
            When ``state_dict`` is not a mapping or a value is not an array (naming its key).
        ValueError
            On a shape or dtype mismatch (always, naming the key), or missing/unexpected keys
            when ``strict``. Nothing is modified when an error is raised.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: expected a mapping of parameter names to arrays "
                            f"(as state_dict() returns), got {type(state_dict).__name__}")
        owners = {}
        for mod_name, mod in self.named_modules():
            for pname in mod._registries()[0]:
                owners[f"{mod_name}.{pname}" if mod_name else pname] = type(mod).__name__
        named = OrderedDict(self.named_parameters())
        missing = [k for k in named if k not in state_dict]
        unexpected = [k for k in state_dict if k not in named]
        if strict and (missing or unexpected):
            raise ValueError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
        for key, p in named.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            owner = owners.get(key, type(self).__name__)
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise TypeError(f"{where}: key {key!r} ({owner}) holds a {type(value).__name__}, "
                                "not an array")
            if tuple(value.shape) != p.shape:
                raise ValueError(
                    f"{where}: key {key!r} ({owner}) has shape {tuple(value.shape)}, "
                    f"expected {p.shape}"
                )
            if value.dtype != p.dtype:
                raise ValueError(
                    f"{where}: key {key!r} ({owner}) has dtype {value.dtype}, expected {p.dtype}"
                )
        for key, p in named.items():
            if key in state_dict:
                _copy_into(p.data, state_dict[key])
        return missing, unexpected

    # -- printing ----------------------------------------------------------------------
    def extra_repr(self) -> str:
        """Return the text shown inside this module's parentheses in ``repr``."""
        return ""

    def __repr__(self) -> str:
        kids = list(self._registries()[1].items())
        if not kids:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, mod in kids:
            lines.append("  (" + name + "): " + repr(mod).replace("\n", "\n  "))
        return "\n".join(lines) + "\n)"


def described_init(seed: int, weight: Any = None, bias: Any = None) -> str:
    """What a layer's initial parameters are drawn from, in words its agreement compares
    (:meth:`Module.label_calls`' ``agreed``): the seed and the weight's and bias's init
    methods, each a name or a callable (by its ``__qualname__``, which the factories of
    :mod:`~pympar.modules.init_methods` set to their arguments)."""
    text = f"init seed={seed}"
    for part, method in (("weight", weight), ("bias", bias)):
        if method is not None:
            name = method if isinstance(method, str) else getattr(
                method, "__qualname__", type(method).__name__)
            text += f", {part} {name}"
    return text


def _this_rank() -> str:
    from mpi4py import MPI  # imported here: only a debug-mode error needs it

    world = MPI.COMM_WORLD
    return f"global rank {world.Get_rank()} of {world.Get_size()}"


def check_backward_done(params: "Module | Iterable[Parameter]", group: Any, what: str) -> None:
    """Debug mode: raise, on every rank of ``group``, when a layer that owns one of ``params``
    still holds the cache of a training-mode forward whose backward never ran on some rank
    while other layers' backward did.

    Called before a gradient reduction (:func:`pympar.optim.allreduce_gradients`): a
    gradient missing one rank's contribution would otherwise be reduced silently. Does
    nothing outside debug mode.

    Parameters
    ----------
    params : Module or iterable of Parameter
        The parameters about to be reduced.
    group : Group or None
        The ranks about to reduce them (their collective's check carries the refusal).
    what : str
        The reduction, for the message.

    Raises
    ------
    RuntimeError
        On this rank when its layers have pending caches and so do every other rank's.
    pympar.debug.CollectiveMismatchError
        On every rank when only some ranks have pending caches (naming their layers).
    """
    if not debug._enabled or not _cached_in_debug:
        return
    owned = {id(p) for p in as_parameter_list(params)}
    pending = [m for m in list(_cached_in_debug) if m._skipped_backward()
               and any(id(p) in owned for p in m._registries()[0].values())]
    if not pending:
        return
    names = "; ".join(f"{layer_name(m)} (parameters "
                      f"{', '.join(p.name or '?' for p in m._registries()[0].values())})"
                      for m in pending[:4])
    more = f" and {len(pending) - 4} more" if len(pending) > 4 else ""
    error = RuntimeError(
        f"{what} on {_this_rank()}: the backward of {names}{more} never ran after its last "
        f"forward, so their gradients lack this rank's contribution; run backward through "
        f"every layer (debug mode checks this)")
    if group is not None and getattr(group, "size", 1) > 1:
        _agreement.refuse(group, what, error)
    raise error


def _described(layer: Module, x: Any, key: tuple, refused: Exception | None) -> str:
    """A layer's call in words for the report (``key`` is what its agreement compares): the
    label, then (after ``debug._DETAIL``) this rank's input, once each."""
    name, dtype, shape, extra, fixed = key[:5]
    detail = (f"input {tuple(x.shape)} {x.dtype}" if shape is not None
              else f"input {dtype}")
    detail += "".join(f", {e}" for e in extra + fixed)
    if refused is not None:
        # The layer's own message starts with the layer, which the report already names.
        text = str(refused).removeprefix(f"{layer_name(layer)}: ")
        detail += f", refused by this rank: {text}"
    return f"{name}{debug._DETAIL}{detail}"


def _must_hold(x: Any, split: tuple[int, ...]) -> str:
    """What the ranks of a layer's group must pass alike, in words."""
    ndim = getattr(x, "ndim", 0)
    axes = sorted({a % ndim for a in split if -ndim <= a < ndim}) if ndim else []
    if not axes:
        return "every rank must pass an input of the same shape and dtype"
    shown = ", ".join(str(a) for a in axes)
    return (f"every rank must pass an input of the same dtype and extents, except along "
            f"axis {shown} (split over the group)")


def _copy_into(dst: Any, src: Any) -> None:
    # A CuPy source must come to the host explicitly before landing in a NumPy destination,
    # and a NumPy source go to the device first (CuPy refuses a NumPy array assigned in).
    if backend.is_cupy_array(src) and not backend.is_cupy_array(dst):
        src = src.get()
    elif backend.is_cupy_array(dst) and not backend.is_cupy_array(src):
        src = backend.array_module(dst).asarray(src)
    dst[...] = src


class Sequential(Module):
    """Chain modules: forward runs them in order, backward in reverse.

    Parameters
    ----------
    *modules : Module
        The layers, registered as submodules named ``"0"``, ``"1"``, ...
    input_grad : bool, default True
        False sets ``input_grad=False`` on the first layer (recursively into a first child
        that is itself a container): ``backward`` then computes no input gradient and
        returns None. True leaves the layers as they were built.
    """

    def __init__(self, *modules: Module, input_grad: bool = True) -> None:
        super().__init__()
        for i, mod in enumerate(modules):
            if not isinstance(mod, Module):
                raise TypeError(f"Sequential: argument {i} is {type(mod).__name__}, not a Module")
            setattr(self, str(i), mod)
        if not input_grad:
            self.input_grad = False

    @property  # type: ignore[override]
    def input_grad(self) -> bool:
        """bool: Whether the first layer computes the input gradient (setting it sets it
        there, recursively)."""
        first = next(iter(self._modules.values()), None)
        return True if first is None else bool(first.input_grad)

    @input_grad.setter
    def input_grad(self, value: bool) -> None:
        first = next(iter(self._modules.values()), None)
        if first is not None:
            first.input_grad = bool(value)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def forward(self, x: Any) -> Any:
        """Apply every layer in order."""
        for mod in self._modules.values():
            x = mod.forward(x)
        return x

    def backward(self, dy: Any) -> Any:
        """Back-propagate through every layer in reverse order; None when the first layer
        computes no input gradient."""
        for mod in reversed(self._modules.values()):
            dy = mod.backward(dy)
        return dy


def as_parameter_list(params: "Module | Iterable[Parameter]") -> list[Parameter]:
    """Return a de-duplicated list of parameters from a module or an iterable of them."""
    items = params.parameters() if isinstance(params, Module) else list(params)
    seen: set[int] = set()
    out = []
    for p in items:
        if not isinstance(p, Parameter):
            raise TypeError(f"expected Parameter, got {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
