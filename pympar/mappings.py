"""Layout mappings: each a forward layout change and its exact adjoint (the backward).

A mapping is a module-level object used as ``y = m(x, group=None, ...)`` and
``dx = m.backward(dy, group=None, ...)``. ``group=None`` means the current
tensor-parallel group (the context-parallel group for the all-to-all pair, see
:mod:`pympar.manager`). On a group of one rank every mapping returns its input
object itself, without a copy.

Layouts: "sequence" is axis 0 and "hidden" the last axis. A *replicated* array
is one logical value held by every rank; a *sharded* array is the tuple of the
ranks' blocks (balanced rule of ``numpy.array_split``: the first ``n % p`` ranks
hold one more); a *partial* array is the tuple of per-rank values whose sum is
meant. Each backward is the adjoint of its forward in these terms:
``<m(x), y> == <x, m.backward(y)>``, replicated arrays counted once, sharded and
partial arrays summed over ranks.

Mappings that gather take ``global_size=``, the global extent of the gathered axis (not a
rank count): the ranks then know each other's block sizes without learning them in the
call's agreement check, and a wrong value is caught on the rank it does not fit.
The former name ``size=`` still works for one release, with a ``DeprecationWarning``.
"Rank" here is always the rank in the mapping's group.

:func:`label` names the collectives of a block of code (``with
pympar.mappings.label("Linear3D.backward"):``) in statistics and debug errors, as each
mapping names its own (``"gather_from_sequence.forward"``).

Forward / backward of each mapping:

- ``copy_to_all``: identity / all-reduce.
- ``reduce_from_all``: all-reduce / identity.
- ``scatter_to_hidden``: keep my last-axis block / all-gather the last axis.
- ``gather_from_hidden``: all-gather the last axis / keep my last-axis block.
- ``reduce_scatter_to_hidden``: reduce-scatter the last axis / all-gather it.
- ``scatter_to_sequence``: keep my axis-0 block / all-gather axis 0.
- ``gather_from_sequence``: all-gather axis 0 / reduce-scatter axis 0 (keep my
  block with ``tensor_parallel_output_grad=False``).
- ``reduce_scatter_to_sequence``: reduce-scatter axis 0 / all-gather axis 0.
- ``all_to_all_from_sequence_to_hidden``: ``[S/P, ..., H] -> [S, ..., H/P]`` /
  the inverse.
- ``all_to_all_from_hidden_to_sequence``: ``[S, ..., H/P] -> [S/P, ..., H]`` /
  the inverse.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import numpy as np

from . import collectives, debug, manager
from .collectives import label
from .group import Group
from .partition import balanced_sizes, block_slice

__all__ = [
    "Mapping",
    "label",
    "copy_to_all",
    "reduce_from_all",
    "scatter_to_hidden",
    "gather_from_hidden",
    "reduce_scatter_to_hidden",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_to_all_from_sequence_to_hidden",
    "all_to_all_from_hidden_to_sequence",
]

Step = Callable[..., Any]
SEQUENCE, HIDDEN = 0, -1
_NDARRAY = np.ndarray  # one global lookup on the hot path of every call, not two


@functools.lru_cache(maxsize=4096)
def _block_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    block = block_slice(n, parts, rank)
    return block.start, block.stop


# ----------------------------------------------------------------- steps
# A step is one direction of a mapping: step(group, x, out, sizes, name, /, **options) -> y,
# where sizes (every rank's extent of the gathered axis, from global_size=) is None unless
# the caller knows them, and name labels the collective. Positional-only, so no option can
# collide. Each carries what Mapping._apply checks before it runs: ``options`` (the keywords
# it takes), ``gathered`` (options -> the axis whose global extent global_size= gives, or
# None: it takes no global_size=) and ``sends`` (options -> whether it makes a collective).


def _always(options: dict[str, Any]) -> bool:
    return True


def _never(options: dict[str, Any]) -> bool:
    return False


def _step(step: Step, options: tuple[str, ...] = (), gathered: Callable | None = None,
          sends: Callable = _always) -> Step:
    step.options, step.gathered, step.sends = frozenset(options), gathered, sends
    return step


def _local(x: Any, name: str | None) -> Any:
    """``x`` validated as the collectives validate theirs, for a step that sends nothing.

    Steps that communicate leave it to the collective, which makes every rank raise when
    one rank's input is refused; a step that sends nothing has nobody waiting for it.
    """
    return x if type(x) is _NDARRAY else collectives._array(x, name or "mapping")


def _identity(group: Group, x: Any, out: Any, sizes: Any = None, name: Any = None, /) -> Any:
    x = _local(x, name)
    if out is None or out is x:
        return x
    out[...] = x
    return out


def _all_reduce(group: Group, x: Any, out: Any, sizes: Any, name: str, /) -> Any:
    return collectives.all_reduce(group, x, "sum", out, name)


def _keep_block(axis: int) -> Step:
    def keep_block(group: Group, x: Any, out: Any, sizes: Any, name: str, /) -> Any:
        x = _local(x, name)
        if not x.ndim:
            raise ValueError("keep my block: the input has no axis to split")
        ax = axis if axis >= 0 else axis + x.ndim
        start, stop = _block_range(x.shape[ax], group.size, group.rank)
        block = x[start:stop] if ax == 0 else x[(slice(None),) * ax + (slice(start, stop),)]
        if out is None:
            # A view when already contiguous (axis 0 of a C array), else a C copy.
            return block if block.flags.c_contiguous else block.copy()
        out[...] = block
        return out
    return _step(keep_block, sends=_never)


def _gather(axis: int) -> Step:
    def all_gather(group: Group, x: Any, out: Any, sizes: Any, name: str, /) -> Any:
        return collectives.all_gather(group, x, axis, out, sizes, name)
    return _step(all_gather, gathered=lambda options: axis)


def _reduce_scatter(axis: int) -> Step:
    def reduce_scatter(group: Group, x: Any, out: Any, sizes: Any, name: str, /) -> Any:
        return collectives.reduce_scatter(group, x, axis, out, "sum", name)
    return _step(reduce_scatter)


def _reduce_scatter_or_keep(axis: int) -> Step:
    reduce, keep = _reduce_scatter(axis), _keep_block(axis)

    def reduce_scatter(group: Group, x: Any, out: Any, sizes: Any, name: str, /, *,
                       tensor_parallel_output_grad: bool = True) -> Any:
        # False: the forward's output was replicated (counted once), so its
        # adjoint is the plain split, not a sum over ranks.
        return (reduce if tensor_parallel_output_grad else keep)(group, x, out, sizes, name)
    return _step(reduce_scatter, ("tensor_parallel_output_grad",),
                 sends=lambda options: bool(options.get("tensor_parallel_output_grad", True)))


def _all_to_all(split_heads: bool) -> Step:
    def all_to_all(group: Group, x: Any, out: Any, sizes: Any, name: str, /, *,
                   seq_axis: int = SEQUENCE, head_axis: int = HIDDEN) -> Any:
        split, concat = (head_axis, seq_axis) if split_heads else (seq_axis, head_axis)
        return collectives.all_to_all(group, x, split, concat, out, sizes, name)

    def gathered(options: dict[str, Any]) -> int:
        return options.get("seq_axis", SEQUENCE) if split_heads else \
            options.get("head_axis", HIDDEN)
    return _step(all_to_all, ("seq_axis", "head_axis"), gathered)


_step(_identity, sends=_never)
_step(_all_reduce)


# ----------------------------------------------------------------- mapping


class Mapping:
    """A layout change (``__call__``) and its adjoint (:meth:`backward`).

    Parameters
    ----------
    name : str
        The public name, shown in debug errors and statistics.
    forward, backward : callable
        Steps ``step(group, x, out, sizes, label, **options) -> y``.
    default_axis : {"tensor", "context"}
        The parallel-state group used when ``group=None``.
    doc : str
        What the mapping does; becomes the object's ``__doc__``.
    """

    def __init__(self, name: str, forward: Step, backward: Step,
                 default_axis: str, doc: str) -> None:
        self.name = name
        # Per direction: the step and the label its collective carries.
        self._steps = ((forward, f"{name}.forward"), (backward, f"{name}.backward"))
        self._default_axis = default_axis
        self.__doc__ = doc

    def __repr__(self) -> str:
        return f"<pympar mapping {self.name}>"

    def __call__(self, x: Any, group: Group | None = None, *, out: Any = None,
                 global_size: int | None = None, **options: Any) -> Any:
        """Apply the forward layout change.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            This rank's input.
        group : Group, optional
            The group; the current TP group (CP group for the all-to-all pair) when None.
        out : array, optional
            Where to write the result (for communicating steps, a buffer reused across
            calls avoids allocation).
        global_size : int, optional
            For a step that gathers: the global extent of the gathered axis (the sum of
            every rank's block, not a rank count); without it the ranks' block sizes
            travel with the agreement check. ``size=`` is its deprecated former name.
        **options
            Mapping-specific keywords (``seq_axis``, ``head_axis``).

        Returns
        -------
        array
            The result, of ``x``'s array module and dtype; ``x`` itself on a group of one
            rank.
        """
        return self._apply(0, x, group, out, global_size, options)

    def backward(self, dy: Any, group: Group | None = None, *, out: Any = None,
                 global_size: int | None = None, **options: Any) -> Any:
        """Apply the adjoint of the forward to the gradient ``dy``.

        Parameters are those of ``__call__``; ``gather_from_sequence`` also takes
        ``tensor_parallel_output_grad`` (default True).

        Returns
        -------
        array
            The gradient of the forward's input; ``dy`` itself on a group of one rank.
        """
        return self._apply(1, dy, group, out, global_size, options)

    def _apply(self, direction: int, x: Any, group: Group | None, out: Any,
               global_size: int | None, options: dict[str, Any]) -> Any:
        """The one path of both directions: resolve the group and sizes, run the step."""
        if options and "size" in options:
            warnings.warn("the size= keyword of pympar mappings is deprecated; use "
                          "global_size= (the global extent of the gathered axis)",
                          DeprecationWarning, stacklevel=3)
            global_size = options.pop("size")
        step, name = self._steps[direction]
        group = manager.resolve_group(group, self.name, self._default_axis)
        if collectives._hooked and debug.is_enabled() and group.size > 1:
            # Every rank must call the same mapping, even one whose step communicates
            # nothing (copy_to_all's forward): compared here, in debug mode. The check
            # every call makes comes first, so that a rank refusing its own arguments
            # (a layer's input, say) meets the others in it.
            collectives.agree(group, ("mapping", name), name)
            debug.check_mapping(group, name, x, dict(options, global_size=global_size))
        if (global_size is not None and step.gathered is None) or (
                options and not step.options.issuperset(options)):
            _refuse_options(step, name, group, x, global_size, options)
        if group.size == 1:
            return _alone(step, name, x, out, global_size, options)
        sizes = None if global_size is None else balanced_sizes(global_size, group.size)
        # (Unpacking an empty **options still costs a dict; skip it.)
        return step(group, x, out, sizes, name, **options) if options else \
            step(group, x, out, sizes, name)


def _refuse_options(step: Step, name: str, group: Group, x: Any, global_size: Any,
                    options: dict[str, Any]) -> None:
    """Raise for keywords ``step`` does not take, on every rank where the others communicate."""
    if global_size is not None and step.gathered is None:
        error = TypeError(f"{name} gathers nothing: it takes no global_size=")
    else:
        unknown = sorted(set(options) - step.options)
        error = TypeError(f"{name} takes no keyword {', '.join(unknown)} (it takes "
                          f"{', '.join(sorted(step.options)) or 'none'})")
    if group.size > 1 and step.sends(options):
        # A gather told no global_size= learns the extents in its check: always made.
        collectives.refuse(group, name, error,
                           always_checked=step.gathered is not None and global_size is None)
    raise error


def _alone(step: Step, name: str, x: Any, out: Any, global_size: Any,
           options: dict[str, Any]) -> Any:
    """A mapping on a group of one rank: its input itself, once the call is checked as the
    ranks of a larger group would check it."""
    x = _local(x, name)
    if global_size is not None:
        axis = step.gathered(options)
        if not -x.ndim <= axis < x.ndim or x.shape[axis] != global_size:
            raise ValueError(f"{name}: global_size={global_size} is not the extent of axis "
                             f"{axis} of this rank's input of shape {x.shape} (one rank "
                             f"holds all of it)")
    if out is not None and out is not x and (
            type(out) is not type(x) or out.shape != x.shape or out.dtype != x.dtype):
        raise (TypeError if type(out) is not type(x) else ValueError)(
            f"{name}: out is a {type(out).__name__} of shape {getattr(out, 'shape', '?')} "
            f"and dtype {getattr(out, 'dtype', '?')}, expected one of shape {x.shape} and "
            f"dtype {x.dtype}")
    return _identity(None, x, out, None, name)


def _mapping(name: str, forward: Step, backward: Step, doc: str,
             default_axis: str = "tensor") -> Mapping:
    return Mapping(name, forward, backward, default_axis, doc)


copy_to_all = _mapping(
    "copy_to_all", _identity, _all_reduce,
    "Forward: identity (a replicated input used by every rank). "
    "Backward: all-reduce (sum) of the per-rank gradients.")
reduce_from_all = _mapping(
    "reduce_from_all", _all_reduce, _identity,
    "Forward: all-reduce (sum) of per-rank partial results. Backward: identity.")
scatter_to_hidden = _mapping(
    "scatter_to_hidden", _keep_block(HIDDEN), _gather(HIDDEN),
    "Forward: keep my block of the last axis. Backward: all-gather the last axis "
    "(``global_size=`` the global extent).")
gather_from_hidden = _mapping(
    "gather_from_hidden", _gather(HIDDEN), _keep_block(HIDDEN),
    "Forward: all-gather the last axis (``global_size=`` the global extent). "
    "Backward: keep my block of the last axis.")
reduce_scatter_to_hidden = _mapping(
    "reduce_scatter_to_hidden", _reduce_scatter(HIDDEN), _gather(HIDDEN),
    "Forward: reduce-scatter (sum) along the last axis. Backward: all-gather the last "
    "axis (``global_size=`` the global extent).")
scatter_to_sequence = _mapping(
    "scatter_to_sequence", _keep_block(SEQUENCE), _gather(SEQUENCE),
    "Forward: keep my block of axis 0 (a view when ``x`` is C-contiguous). "
    "Backward: all-gather axis 0 (``global_size=`` the global extent).")
gather_from_sequence = _mapping(
    "gather_from_sequence", _gather(SEQUENCE), _reduce_scatter_or_keep(SEQUENCE),
    "Forward: all-gather axis 0 (``global_size=`` the global extent). Backward: reduce-scatter "
    "axis 0, or keep my block with ``tensor_parallel_output_grad=False`` (when the "
    "forward's output is used as one replicated value).")
reduce_scatter_to_sequence = _mapping(
    "reduce_scatter_to_sequence", _reduce_scatter(SEQUENCE), _gather(SEQUENCE),
    "Forward: reduce-scatter (sum) along axis 0. Backward: all-gather axis 0 "
    "(``global_size=`` the global extent).")
all_to_all_from_sequence_to_hidden = _mapping(
    "all_to_all_from_sequence_to_hidden", _all_to_all(True), _all_to_all(False),
    "Forward: [S/P, ..., H] -> [S, ..., H/P] over the context-parallel group: split the "
    "head axis (``head_axis``, default last), gather the sequence axis (``seq_axis``, "
    "default 0; ``global_size=`` the global S). Backward: the inverse (``global_size=`` the "
    "global H).",
    "context")
all_to_all_from_hidden_to_sequence = _mapping(
    "all_to_all_from_hidden_to_sequence", _all_to_all(False), _all_to_all(True),
    "Forward: [S, ..., H/P] -> [S/P, ..., H] over the context-parallel group: split the "
    "sequence axis, gather the head axis (``global_size=`` the global H). Backward: the inverse "
    "(``global_size=`` the global S).",
    "context")
