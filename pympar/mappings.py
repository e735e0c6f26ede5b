"""Layout mappings: each a forward layout change and its exact adjoint (the backward).

A mapping is a module-level object used as ``y = m(x, group=None, ...)`` and
``dx = m.backward(dy, group=None, ...)``. ``group=None`` means the current
tensor-parallel group (the context-parallel group for the all-to-all pair, see
:mod:`pympar.manager`). On a group of one rank every mapping returns its input
object itself, without a copy.

Layouts are values: every mapping declares the layout of its input (``source``) and
of its output (``destination``), as one of

- :class:`Replicated`: one logical value held by every rank;
- :class:`Sharded` ``(axis)``: the tuple of the ranks' blocks along ``axis`` (balanced
  rule of ``numpy.array_split``: the first ``n % p`` ranks hold one more);
- :class:`Partial`: the tuple of per-rank values whose sum is meant.

Each backward is the adjoint of its forward in these terms:
``<m(x), y> == <x, m.backward(y)>``, replicated arrays counted once, sharded and
partial arrays summed over ranks. "Sequence" is axis 0 and "hidden" the last axis.

Mappings that gather take ``global_size=``, the global extent of the gathered axis (not a
rank count): the ranks then know each other's block sizes without learning them in a
separate exchange, and a wrong value is caught on the rank it does not fit (every rank
raises). The former name ``size=`` still works for one release, with a
``DeprecationWarning``. "Rank" here is always the rank in the mapping's group. Each
mapping labels its collectives (``"gather_from_sequence.forward"``) in statistics and
errors.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Union

import numpy as np

from . import collectives, manager
from ._transfer import unfit
from .group import Group

__all__ = ["Mapping", "Replicated", "Sharded", "Partial", "MAPPINGS", "copy_to_all",
           "reduce_from_all", "scatter_to_hidden", "gather_from_hidden",
           "reduce_scatter_to_hidden", "scatter_to_sequence", "gather_from_sequence",
           "reduce_scatter_to_sequence", "all_to_all_from_sequence_to_hidden",
           "all_to_all_from_hidden_to_sequence"]

Step = Callable[..., Any]
SEQUENCE, HIDDEN = 0, -1
_NDARRAY = np.ndarray  # one global lookup on the hot path of every call, not two


# ----------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Replicated:
    """One logical value held by every rank (counted once)."""

    def resolve(self, options: dict[str, Any]) -> Layout:
        """This layout for a call with ``options`` (itself)."""
        return self


@dataclass(frozen=True)
class Sharded:
    """The ranks' balanced blocks of one logical value along ``axis``.

    Attributes
    ----------
    axis : int
        The split axis (``-1``: the last).
    option : str or None
        The mapping keyword that moves the axis (``"seq_axis"``), if any.
    """

    axis: int
    option: Union[str, None] = None

    def resolve(self, options: dict[str, Any]) -> Layout:
        """This layout for a call with ``options`` (the axis they name)."""
        if self.option is None or self.option not in options:
            return Sharded(self.axis)
        return Sharded(options[self.option])


@dataclass(frozen=True)
class Partial:
    """Per-rank values whose sum is the logical value (each rank's counted in the pairing).

    Attributes
    ----------
    unless : str or None
        A mapping keyword that, passed False, makes the layout :class:`Replicated`
        (``tensor_parallel_output_grad``).
    """

    unless: Union[str, None] = None

    def resolve(self, options: dict[str, Any]) -> Layout:
        """This layout for a call with ``options``."""
        if self.unless is not None and options.get(self.unless, True) is False:
            return Replicated()
        return Partial()


Layout = Union[Replicated, Sharded, Partial]


# ----------------------------------------------------------------- steps
# A step is one direction of a mapping: step(group, x, out, sizes, name, /, **options) -> y,
# where sizes (every rank's extent of the gathered axis, from global_size=) is None unless
# the caller knows them, and name labels the collective. Each carries ``options`` (the
# keywords it takes), ``gathered`` (options -> the axis whose global extent global_size=
# gives, or None) and ``sends`` (options -> whether it makes a collective).


def _always(options: dict[str, Any]) -> bool:
    return True


def _never(options: dict[str, Any]) -> bool:
    return False


def _step(step: Step, options: tuple[str, ...] = (), gathered: Callable | None = None,
          sends: Callable = _always) -> Step:
    step.options, step.gathered, step.sends = frozenset(options), gathered, sends
    return step


@functools.lru_cache(maxsize=4096)
def _block(n: int, parts: int, rank: int) -> slice:
    return collectives.block_slice(n, parts, rank)


def _local(x: Any, name: str | None) -> Any:
    """``x`` checked as the collectives check theirs, for a step that sends nothing."""
    return x if type(x) is _NDARRAY else collectives.as_array(x, name or "mapping")


def _identity(group: Group, x: Any, out: Any, sizes: Any = None, name: Any = None, /) -> Any:
    if type(x) is not _NDARRAY:
        x = _local(x, name)
    if out is None or out is x:
        return x
    _check_out(name, x, out)
    out[...] = x
    return out


def _check_out(name: str | None, result: Any, out: Any) -> None:
    """Raise unless ``out`` can hold ``result`` as it is: the same array type, shape and
    dtype (no broadcast, no cast)."""
    if type(out) is not type(result) or out.shape != result.shape or out.dtype != result.dtype:
        raise unfit(result, out, result.shape, name or "mapping")


def _all_reduce(group: Group, x: Any, out: Any, sizes: Any, name: str, /) -> Any:
    return collectives.all_reduce(group, x, "sum", out, name)


def _keep_block(axis: int) -> Step:
    def keep_block(group: Group, x: Any, out: Any, sizes: Any, name: str, /) -> Any:
        x = _local(x, name)
        if not x.ndim:
            raise ValueError("keep my block: the input has no axis to split")
        ax = axis if axis >= 0 else axis + x.ndim
        block = _block(x.shape[ax], group.size, group.rank)
        block = x[block] if ax == 0 else x[(slice(None),) * ax + (block,)]
        if out is None:
            # A view when already contiguous (axis 0 of a C array), else a C copy.
            return block if block.flags.c_contiguous else block.copy()
        _check_out(name, block, out)
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
        if tensor_parallel_output_grad:
            return reduce(group, x, out, sizes, name)
        # False: the forward's output was replicated (counted once), so its adjoint is the
        # plain split, not a sum over ranks. It sends nothing, but first agrees (the label,
        # dtype and shape): a rank that keeps its block where the others reduce-scatter
        # would otherwise leave them waiting, and return a block that lacks their sums.
        try:
            x = _local(x, name)
        except TypeError as err:
            collectives.refuse(group, name, err)
            raise
        collectives.agree(group, (name, "keep", x.dtype.str, x.shape),
                          f"{name}(tensor_parallel_output_grad=False, shape={x.shape}, "
                          f"dtype={x.dtype})")
        return keep(group, x, out, sizes, name)
    return _step(reduce_scatter, ("tensor_parallel_output_grad",))


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


class _Direction:
    """One direction of a mapping; calling it is the one path of every mapping call.

    Parameters
    ----------
    mapping : Mapping
        The mapping it belongs to (its name and default group).
    step : callable
        ``step(group, x, out, sizes, label, **options) -> y``.
    label : str
        What its collective is labelled (``"copy_to_all.backward"``).
    """

    def __init__(self, mapping: Mapping, step: Step, label: str) -> None:
        self._mapping, self._step, self._label = mapping, step, label

    def __call__(self, x: Any, group: Group | None = None, *, out: Any = None,
                 global_size: int | None = None, **options: Any) -> Any:
        """Apply this direction's layout change.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            This rank's input (or, for the backward, the gradient of the output).
        group : Group, optional
            The group; the current TP group (CP group for the all-to-all pair) when None.
        out : array, optional
            Where to write the result (for communicating steps, a buffer reused across
            calls avoids allocation).
        global_size : int, optional
            For a step that gathers: the global extent of the gathered axis (the sum of
            every rank's block, not a rank count); without it the ranks learn their
            block sizes in one small exchange. ``size=`` is its deprecated former name.
        **options
            Mapping-specific keywords (``seq_axis``, ``head_axis``; the backward of
            ``gather_from_sequence`` takes ``tensor_parallel_output_grad``, default True).

        Returns
        -------
        array
            The result, of ``x``'s array module and dtype; ``x`` itself on a group of one
            rank.
        """
        if options and "size" in options:
            warnings.warn("the size= keyword of pympar mappings is deprecated; use "
                          "global_size= (the global extent of the gathered axis)",
                          DeprecationWarning, stacklevel=2)
            global_size = options.pop("size")
        step, name = self._step, self._label
        if type(group) is not Group:
            group = manager.resolve_group(group, self._mapping.name, self._mapping.default_axis)
        if (global_size is not None and step.gathered is None) or (
                options and not step.options.issuperset(options)):
            _refuse_options(step, name, group, global_size, options)
        if group.size == 1:
            return _alone(step, name, x, out, global_size, options)
        sizes = None if global_size is None else collectives.balanced_sizes(global_size,
                                                                            group.size)
        # (Unpacking an empty **options still costs a dict; skip it.)
        return step(group, x, out, sizes, name, **options) if options else \
            step(group, x, out, sizes, name)


class Mapping(_Direction):
    """A layout change (calling it) and its adjoint (:attr:`backward`).

    Parameters
    ----------
    name : str
        The public name, shown in errors and statistics.
    forward, backward : callable
        Steps ``step(group, x, out, sizes, label, **options) -> y``.
    source, destination : Replicated, Sharded or Partial
        The layouts of the forward's input and output (the backward's are swapped).
    default_axis : {"tensor", "context"}
        The parallel-state group used when ``group=None``.
    doc : str
        What the mapping does; becomes the object's ``__doc__``.

    Attributes
    ----------
    backward : callable
        The adjoint, called like the mapping itself: ``dx = m.backward(dy, group, ...)``.
    """

    def __init__(self, name: str, forward: Step, backward: Step, source: Layout,
                 destination: Layout, default_axis: str, doc: str) -> None:
        super().__init__(self, forward, f"{name}.forward")
        self.name, self.source, self.destination = name, source, destination
        self.default_axis = default_axis
        self.backward = _Direction(self, backward, f"{name}.backward")
        self.__doc__ = doc

    def __repr__(self) -> str:
        return f"<pympar mapping {self.name}: {self.source} -> {self.destination}>"


def _refuse_options(step: Step, name: str, group: Group, global_size: Any,
                    options: dict[str, Any]) -> None:
    """Raise for keywords ``step`` does not take, on every rank where the others communicate."""
    if global_size is not None and step.gathered is None:
        error = TypeError(f"{name} gathers nothing: it takes no global_size=")
    else:
        unknown = sorted(set(options) - step.options)
        error = TypeError(f"{name} takes no keyword {', '.join(unknown)} (it takes "
                          f"{', '.join(sorted(step.options)) or 'none'})")
    if group.size > 1 and step.sends(options):
        collectives.refuse(group, name, error)
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
    return _identity(None, x, out, None, name)


_SEQ, _HEADS = Sharded(SEQUENCE, "seq_axis"), Sharded(HIDDEN, "head_axis")

# Each mapping's docstring: its parameters and result (the call signature the API pages show
# comes from its steps). group, out and the backward are as in _Direction.__call__.
_TP = """group : Group, optional
        The group; the current tensor-parallel group when None.
    out : array, optional
        Where to write the result (a buffer reused across calls spares an allocation)."""
_CP = _TP.replace("tensor-parallel", "context-parallel")
_AXES = """seq_axis : int, default 0
        The sequence axis.
    head_axis : int, default -1
        The head (or hidden) axis."""

#: Every mapping, in the order of the documentation.
MAPPINGS: tuple[Mapping, ...] = (
    Mapping("copy_to_all", _identity, _all_reduce, Replicated(), Partial(), "tensor",
            f"""Forward: identity (a replicated input used by every rank). Backward:
    all-reduce (sum) of the per-rank gradients.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        The replicated input, the same on every rank of the group.
    {_TP}

    Returns
    -------
    array
        ``x`` itself (or ``out``), which each rank goes on to use in its own way.

    Notes
    -----
    ``copy_to_all.backward(dy, group=None, *, out=None)`` sums every rank's ``dy``.
    """),
    Mapping("reduce_from_all", _all_reduce, _identity, Partial(), Replicated(), "tensor",
            f"""Forward: all-reduce (sum) of per-rank partial results. Backward: identity.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's partial result, of the full shape (the value meant is the sum).
    {_TP}

    Returns
    -------
    array
        The sum over the group's ranks, the same on every rank.

    Notes
    -----
    ``reduce_from_all.backward(dy, group=None, *, out=None)`` returns ``dy`` itself.
    """),
    Mapping("scatter_to_hidden", _keep_block(HIDDEN), _gather(HIDDEN), Replicated(),
            Sharded(HIDDEN), "tensor",
            f"""Forward: keep my block of the last axis. Backward: all-gather the last axis.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        The replicated input.
    {_TP}

    Returns
    -------
    array
        This rank's block of ``x``'s last axis (balanced rule; a C-contiguous copy).

    Notes
    -----
    ``scatter_to_hidden.backward(dy, group=None, *, out=None, global_size=None)``
    all-gathers the blocks; ``global_size`` is the last axis's global extent.
    """),
    Mapping("gather_from_hidden", _gather(HIDDEN), _keep_block(HIDDEN), Sharded(HIDDEN),
            Replicated(), "tensor",
            f"""Forward: all-gather the last axis. Backward: keep my block of the last axis.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's block of the last axis.
    {_TP}
    global_size : int, optional
        The global extent of the last axis; without it the ranks learn each other's
        blocks in one small exchange.

    Returns
    -------
    array
        The whole array, the same on every rank.

    Notes
    -----
    ``gather_from_hidden.backward(dy, group=None, *, out=None)`` keeps this rank's block.
    """),
    Mapping("reduce_scatter_to_hidden", _reduce_scatter(HIDDEN), _gather(HIDDEN), Partial(),
            Sharded(HIDDEN), "tensor",
            f"""Forward: reduce-scatter (sum) along the last axis. Backward: all-gather the
    last axis.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's partial result, of the full shape.
    {_TP}

    Returns
    -------
    array
        This rank's block of the last axis of the sum over the ranks.

    Notes
    -----
    ``reduce_scatter_to_hidden.backward(dy, group=None, *, out=None, global_size=None)``
    all-gathers the blocks; ``global_size`` is the last axis's global extent.
    """),
    Mapping("scatter_to_sequence", _keep_block(SEQUENCE), _gather(SEQUENCE), Replicated(),
            Sharded(SEQUENCE), "tensor",
            f"""Forward: keep my block of axis 0. Backward: all-gather axis 0.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        The replicated input.
    {_TP}

    Returns
    -------
    array
        This rank's block of axis 0 (balanced rule; a view when ``x`` is C-contiguous).

    Notes
    -----
    ``scatter_to_sequence.backward(dy, group=None, *, out=None, global_size=None)``
    all-gathers the blocks; ``global_size`` is the global extent of axis 0.
    """),
    Mapping("gather_from_sequence", _gather(SEQUENCE), _reduce_scatter_or_keep(SEQUENCE),
            Sharded(SEQUENCE), Partial(unless="tensor_parallel_output_grad"), "tensor",
            f"""Forward: all-gather axis 0. Backward: reduce-scatter axis 0, or keep my block.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's block of axis 0.
    {_TP}
    global_size : int, optional
        The global extent of axis 0; without it the ranks learn each other's blocks in
        one small exchange.

    Returns
    -------
    array
        The whole array, which each rank goes on to use in its own way.

    Notes
    -----
    ``gather_from_sequence.backward(dy, group=None, *, out=None,
    tensor_parallel_output_grad=True)`` sums the ranks' ``dy`` and keeps this rank's
    block of axis 0 (a reduce-scatter); with ``tensor_parallel_output_grad=False`` (the
    forward's output used as one replicated value) it keeps the block without a sum,
    after the ranks agree that every one keeps.
    """),
    Mapping("reduce_scatter_to_sequence", _reduce_scatter(SEQUENCE), _gather(SEQUENCE),
            Partial(), Sharded(SEQUENCE), "tensor",
            f"""Forward: reduce-scatter (sum) along axis 0. Backward: all-gather axis 0.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's partial result, of the full shape.
    {_TP}

    Returns
    -------
    array
        This rank's block of axis 0 of the sum over the ranks.

    Notes
    -----
    ``reduce_scatter_to_sequence.backward(dy, group=None, *, out=None, global_size=None)``
    all-gathers the blocks; ``global_size`` is the global extent of axis 0.
    """),
    Mapping("all_to_all_from_sequence_to_hidden", _all_to_all(True), _all_to_all(False),
            _SEQ, _HEADS, "context",
            f"""Forward: ``[S/P, ..., H] -> [S, ..., H/P]`` over the context-parallel group.
    Backward: the inverse.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's block of the sequence axis, every head.
    {_CP}
    global_size : int, optional
        The global sequence length ``S``.
    {_AXES}

    Returns
    -------
    array
        The whole sequence, this rank's block of the head axis (balanced rule).

    Notes
    -----
    ``all_to_all_from_sequence_to_hidden.backward(dy, group=None, *, out=None,
    global_size=None, seq_axis=0, head_axis=-1)`` is the inverse all-to-all
    (``global_size`` the global ``H``).
    """),
    Mapping("all_to_all_from_hidden_to_sequence", _all_to_all(False), _all_to_all(True),
            _HEADS, _SEQ, "context",
            f"""Forward: ``[S, ..., H/P] -> [S/P, ..., H]`` over the context-parallel group.
    Backward: the inverse.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        The whole sequence, this rank's block of the head axis.
    {_CP}
    global_size : int, optional
        The global head extent ``H``.
    {_AXES}

    Returns
    -------
    array
        This rank's block of the sequence axis, every head.

    Notes
    -----
    ``all_to_all_from_hidden_to_sequence.backward(dy, group=None, *, out=None,
    global_size=None, seq_axis=0, head_axis=-1)`` is the inverse all-to-all
    (``global_size`` the global ``S``).
    """),
)

(copy_to_all, reduce_from_all, scatter_to_hidden, gather_from_hidden, reduce_scatter_to_hidden,
 scatter_to_sequence, gather_from_sequence, reduce_scatter_to_sequence,
 all_to_all_from_sequence_to_hidden, all_to_all_from_hidden_to_sequence) = MAPPINGS


def _shown(layout: Layout) -> str:
    if isinstance(layout, Sharded):
        return f"``Sharded({layout.axis})``" + (f" (``{layout.option}``)" if layout.option else "")
    if isinstance(layout, Partial) and layout.unless:
        return f"``Partial`` (``Replicated`` with ``{layout.unless}=False``)"
    return f"``{type(layout).__name__}``"


def layout_table() -> str:
    """The mappings and their layouts as a reStructuredText table (for the documentation)."""
    rows = [(f":data:`{m.name}`", _shown(m.source), _shown(m.destination)) for m in MAPPINGS]
    rows.insert(0, ("mapping", "source (forward input)", "destination (forward output)"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    rule = "  ".join("=" * w for w in widths)
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([rule, lines[0], rule, *lines[1:], rule])


__doc__ += "\nThe mappings and their layouts:\n\n" + layout_table() + "\n"
