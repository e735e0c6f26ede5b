"""Distributed ``rfftn``/``irfftn``/``fftn``/``ifftn``: each a forward and its exact adjoint.

A field is cut over ``groups`` (one group: a slab; two: a pencil): ``axes[i]`` is split over
``groups[i]`` by the balanced rule, the other axes are whole. The forward transforms the whole
axes ``axes[L:]`` (``L = len(groups)``), then for ``i = L-1, ..., 0`` exchanges ``axes[i + 1]``
for ``axes[i]`` over ``groups[i]`` (one all-to-all) and transforms ``axes[i]``. The spectrum
stays in that transposed layout, ``axes[i + 1]`` split over ``groups[i]``
(:func:`spectral_placement`); the inverse runs the same steps backwards.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy

from .. import backend, collectives
from ..debug import CollectiveMismatchError
from ..group import Group
from ..partition import Placement, Split, balanced_sizes
from ._local import ADJOINT_NORM, NORMS, c2c, c2r, direct, r2c, scale_conjugate_pairs

__all__ = ["FFTPair", "rfftn", "irfftn", "fftn", "ifftn", "physical_placement",
           "spectral_placement", "spectral_shape"]

Groups = "Group | Sequence[Group]"


def _groups(groups: Any) -> tuple[Group, ...]:
    if isinstance(groups, Group):
        return (groups,)
    groups = tuple(groups)
    if not groups or not all(isinstance(g, Group) for g in groups):
        raise TypeError(f"expected a Group or a sequence of Groups, got {groups!r}")
    return groups


def _axes(ndim: int, axes: Sequence[int] | None, splits: int) -> tuple[int, ...]:
    axes = tuple(range(ndim)) if axes is None else tuple(int(a) for a in axes)
    normal = tuple(a + ndim if a < 0 else a for a in axes)
    if any(not 0 <= a < ndim for a in normal) or len(set(normal)) != len(normal):
        raise ValueError(f"axes {axes} are not distinct axes of a {ndim}-d array")
    if len(normal) <= splits:
        raise ValueError(f"{len(normal)} transformed axes cannot be split over {splits} "
                         f"group(s): the transpose needs one more axis than groups")
    return normal


def spectral_shape(shape: Sequence[int], axes: Sequence[int], real: bool) -> tuple[int, ...]:
    """The global shape of the spectrum of a field of global ``shape`` transformed over ``axes``
    (``real``: the last of ``axes`` keeps ``n // 2 + 1`` modes, as :func:`numpy.fft.rfftn`)."""
    out = [int(n) for n in shape]
    if real:
        out[axes[-1]] = out[axes[-1]] // 2 + 1
    return tuple(out)


def physical_placement(shape: Sequence[int], groups: Groups,
                       axes: Sequence[int] | None = None) -> Placement:
    """Where this rank's block of a field of global ``shape`` lies: ``axes[i]`` split over
    ``groups[i]``. ``placement.take(full)`` is the block the transforms take."""
    groups = _groups(groups)
    axes = _axes(len(shape), axes, len(groups))
    return Placement(tuple(shape), tuple(Split.over(g, axes[i]) for i, g in enumerate(groups)))


def spectral_placement(shape: Sequence[int], groups: Groups, axes: Sequence[int] | None = None,
                       real: bool = False) -> Placement:
    """Where this rank's block of the spectrum of a field of global ``shape`` lies:
    ``axes[i + 1]`` split over ``groups[i]`` (``real``: of :func:`rfftn`'s half spectrum)."""
    groups = _groups(groups)
    axes = _axes(len(shape), axes, len(groups))
    return Placement(spectral_shape(shape, axes, real),
                     tuple(Split.over(g, axes[i + 1]) for i, g in enumerate(groups)))


class _Call:
    """One validated call: the groups, axes, norm and (when known) global lengths."""

    def __init__(self, name: str, x: Any, groups: Any, axes: Any, norm: Any, s: Any,
                 real: bool, spectral_input: bool, out: Any = None) -> None:
        self.name, self.real = name, real
        self.groups = _groups(groups)
        # The exchanges in the call's order: the last group first towards the spectrum.
        self.order = list(self.groups) if spectral_input else list(self.groups)[::-1]
        try:
            if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected a numpy.ndarray or cupy.ndarray, got "
                                f"{type(x).__name__}")
            if real and not spectral_input and x.dtype.kind != "f":
                raise TypeError(f"{name}: expected a real floating-point field, got {x.dtype}")
            if x.dtype.kind not in "fc":
                raise TypeError(f"{name}: expected a floating-point or complex array, got "
                                f"{x.dtype}")
            if norm not in NORMS:
                raise ValueError(f"{name}: norm must be one of {NORMS}, got {norm!r}")
            self.norm = norm
            self.axes = _axes(x.ndim, axes, len(self.groups))
            self.lengths = None if s is None else tuple(int(n) for n in s)
            if self.lengths is not None:
                self._check_extents(x, spectral_input)
            if out is not None:
                self._check_out(x, out, spectral_input)
            # The exchanges' label carries the whole axes' extents, s=, the axes and norm=,
            # which the agreement check then compares (pympar.agreed lists them): a real
            # transform maps lengths 2k and 2k + 1 to one spectrum, so the exchanged shapes
            # alone would not tell them apart, and norm= only scales the local transforms.
            splits = len(self.groups)
            whole = self.axes[:1] + self.axes[splits + 1:] if spectral_input else \
                self.axes[splits:]
            self.label = (f"{name}(whole extents {tuple(x.shape[a] for a in whole)}, "
                          f"s={self.lengths}, axes={self.axes}, norm={norm or 'backward'})")
        except (TypeError, ValueError) as err:
            self.refuse(0, err)
            raise

    def _check_extents(self, x: Any, spectral_input: bool) -> None:
        if len(self.lengths) != len(self.axes) or min(self.lengths) < 1:
            raise ValueError(f"{self.name}: s={self.lengths} must give one positive global "
                             f"length per transformed axis {self.axes}")
        lengths = list(self.lengths)
        if spectral_input and self.real:
            lengths[-1] = lengths[-1] // 2 + 1
        shift = 1 if spectral_input else 0
        for k, (axis, n) in enumerate(zip(self.axes, lengths)):
            split = k - shift
            group = self.groups[split] if 0 <= split < len(self.groups) else None
            want = n if group is None else balanced_sizes(n, group.size)[group.rank]
            if x.shape[axis] != want:
                where = ("whole" if group is None else
                         f"split over {group.size} ranks of group {group.name!r}, rank "
                         f"{group.rank} holding the balanced block")
                raise ValueError(
                    f"{self.name}: axis {axis} of this rank's block has extent "
                    f"{x.shape[axis]}, but with global length {n} ({where}) it should be "
                    f"{want}; the field must be split as pympar.fft."
                    f"{'spectral' if spectral_input else 'physical'}_placement says")

    def _check_out(self, x: Any, out: Any, spectral_input: bool) -> None:
        """Refuse an ``out`` that cannot hold this rank's block of the result."""
        if spectral_input and self.real:
            dtype = numpy.empty(0, x.dtype).real.dtype
        else:
            dtype = numpy.result_type(x.dtype, numpy.complex64)
        if type(out) is not type(x) or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: out must be a C-contiguous {type(x).__name__} of "
                             f"dtype {dtype}, got {type(out).__name__} {out.dtype}")
        shape = list(x.shape)
        for k, axis in enumerate(self.axes):
            n = None if self.lengths is None else (
                self.lengths[k] if spectral_input else self.spectral_length(k))
            split = k if spectral_input else k - 1
            group = self.groups[split] if 0 <= split < len(self.groups) else None
            if n is not None:
                shape[axis] = n if group is None else balanced_sizes(n, group.size)[group.rank]
        if self.lengths is not None and tuple(out.shape) != tuple(shape) or out.ndim != x.ndim:
            raise ValueError(f"{self.name}: out has shape {tuple(out.shape)}; this rank's block "
                             f"of the result has shape {tuple(shape)}")

    def spectral_length(self, k: int) -> int | None:
        """The global extent of the spectrum along ``axes[k]`` (None when not known)."""
        if self.lengths is None:
            return None
        n = self.lengths[k]
        return n // 2 + 1 if self.real and k == len(self.axes) - 1 else n

    def refuse(self, first: int, err: Exception) -> None:
        """Make the ranks of the exchanges not yet made, from the ``first``-th on, raise.

        Every group is told, also after one raises the mismatch (its other ranks were
        communicating), which is raised then: the ranks of a later exchange must not wait
        for this one.
        """
        mismatch = None
        for group in self.order[first:]:
            if group.size > 1:
                try:
                    collectives.refuse(group, self.name, err)
                except CollectiveMismatchError as caught:
                    mismatch = mismatch or caught
        if mismatch is not None:
            raise mismatch

    def scratch(self, slot: str, shape: Sequence[int], like: Any, dtype: Any = None) -> Any:
        """A reused array of ``like``'s module (and dtype, unless given) for an intermediate
        of the call (the first group's scratch; never returned to the caller)."""
        return self.groups[0]._state.scratch(
            f"fft.{slot}", tuple(shape), like.dtype if dtype is None else dtype, like)

    def exchange(self, y: Any, index: int, step: int, split: int, concat: int,
                 extent: int | None, out: Any = None, reuse: bool = False) -> Any:
        """The all-to-all over ``groups[index]`` (the ``step``-th exchange of the call), into
        ``out``, else (``reuse``, an intermediate of known extent) a scratch array."""
        group = self.groups[index]
        if group.size == 1:
            if out is None:
                return y
            out[...] = y
            return out
        sizes = None if extent is None else balanced_sizes(extent, group.size)
        if out is None and reuse and sizes is not None:
            shape = list(y.shape)
            shape[split], shape[concat] = balanced_sizes(y.shape[split], group.size)[
                group.rank], extent
            out = self.scratch(f"exchange{step}", shape, y)
        try:
            return collectives.all_to_all(group, y, split, concat, out, sizes, self.label)
        except (TypeError, ValueError, CollectiveMismatchError) as err:
            self.refuse(step + 1, err)
            raise


def _splits(call: _Call) -> int:
    """How many axes are split: none when every group has one rank (then one local call
    transforms every axis, instead of one call per stage)."""
    return len(call.groups) if any(g.size > 1 for g in call.groups) else 0


def _to_spectral(call: _Call, x: Any, double_pairs: bool = False, out: Any = None) -> Any:
    """The forward steps; intermediates in scratch arrays, the result in ``out`` or a new
    array (never a scratch one: every exchange but the last makes a new array)."""
    axes, norm, splits = call.axes, call.norm, _splits(call)
    whole = axes[splits:]
    if splits == 0:  # (else the last exchange checks out)
        _check_result_out(call, out, x.shape, half=axes[-1] if call.real else None)
    if call.real:
        shape = list(x.shape)
        shape[axes[-1]] = shape[axes[-1]] // 2 + 1
        y = r2c(x, whole, norm, out if splits == 0 else
                call.scratch("r2c", shape, x, _complex_dtype(x)) if direct(x) else None)
        if double_pairs:  # the adjoint of irfftn along the real axis (whole here)
            scale_conjugate_pairs(y, axes[-1], x.shape[axes[-1]], 2.0)
    else:
        y = c2c(x, whole, norm, inverse=False, out=out if splits == 0 else None)
    for step, i in enumerate(reversed(range(splits))):
        last = step == splits - 1
        y = call.exchange(y, i, step, axes[i + 1], axes[i],
                          None if call.lengths is None else call.lengths[i],
                          out if last else None)
        y = c2c(y, (axes[i],), norm, inverse=False, overwrite=True,  # y is ours
                out=y if last and out is not None else None)  # out must hold the result
    return y


def _check_result_out(call: _Call, out: Any, shape: Sequence[int],
                      half: int | None = None) -> None:
    """Refuse an ``out`` of another shape than this rank's block of the result, ``shape``
    (with ``half``, that axis halved as :func:`rfftn` does): known once the exchanges are
    made, where no ``s=`` gave it before (a local error: the exchanges are complete)."""
    if out is None:
        return
    shape = list(shape)
    if half is not None:
        shape[half] = shape[half] // 2 + 1
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{call.name}: out has shape {tuple(out.shape)}; this rank's block "
                         f"of the result has shape {tuple(shape)}")


def _complex_dtype(x: Any) -> Any:
    return numpy.result_type(x.dtype, numpy.complex64)


def _to_physical(call: _Call, y: Any, halve_pairs: bool = False, out: Any = None) -> Any:
    """The inverse steps; intermediates in scratch arrays (every exchange's output is one),
    the result in ``out`` or a new array."""
    axes, norm, splits = call.axes, call.norm, _splits(call)
    for i in range(splits):
        # the caller's input: transformed out of place (into scratch where that is direct)
        first = i == 0 and y.dtype.kind == "c" and direct(y)
        y = c2c(y, (axes[i],), norm, inverse=True, overwrite=i > 0,
                out=call.scratch("c2c", y.shape, y) if first else None)
        y = call.exchange(y, i, i, axes[i], axes[i + 1], call.spectral_length(i + 1),
                          reuse=True)
    whole = axes[splits:]
    if not call.real:  # out of place: y may be a scratch array
        _check_result_out(call, out, y.shape)
        if out is None:
            out = backend.array_module(y).empty(y.shape, _complex_dtype(y))
        return c2c(y, whole, norm, inverse=True, out=out)
    n = call.lengths[-1] if call.lengths is not None else 2 * (y.shape[axes[-1]] - 1)
    _check_result_out(call, out, y.shape[:axes[-1]] + (n,) + y.shape[axes[-1] + 1:])
    if halve_pairs and splits == 0:  # the adjoint of rfftn along the real axis (whole here)
        work = call.scratch("halved", y.shape, y)
        work[...] = y
        y = work
    if halve_pairs:
        scale_conjugate_pairs(y, axes[-1], n, 0.5)
    owned = splits > 0 or halve_pairs
    return c2r(y, whole, [y.shape[a] for a in whole[:-1]] + [n], norm, overwrite=owned,
               out=out, work=None if owned or not direct(y) else call.scratch("c2r", y.shape, y))


class FFTPair:
    """A distributed FFT (``__call__``) and its exact adjoint (:meth:`backward`).

    ``<F(x), y> == <x, F.backward(y)>`` with the real inner product ``Re(vdot(a, b))``
    summed over ranks (real fields and half spectra are real vector spaces).

    Parameters
    ----------
    name : str
        ``"rfftn"``, ``"irfftn"``, ``"fftn"`` or ``"ifftn"``.
    real : bool
        Whether the physical field is real (half spectrum along the last transformed axis).
    inverse : bool
        Whether ``__call__`` goes from the spectrum to the field.
    """

    def __init__(self, name: str, real: bool, inverse: bool) -> None:
        self.name, self.real, self.inverse = name, real, inverse

    def __repr__(self) -> str:
        return f"pympar.fft.{self.name}"

    def __call__(self, x: Any, groups: Groups, axes: Sequence[int] | None = None,
                 norm: str | None = None, s: Sequence[int] | None = None,
                 out: Any = None) -> Any:
        """Transform ``x``, this rank's block (see the module docstring for the layouts).

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            This rank's block: of the field (``rfftn``/``fftn``, split as
            :func:`physical_placement` says) or of its spectrum (``irfftn``/``ifftn``, split
            as :func:`spectral_placement` says).
        groups : Group or sequence of Group
            ``groups[i]`` splits ``axes[i]`` of the field; one group is a slab, two a pencil.
        axes : sequence of int, optional
            Transformed axes (default all), more of them than groups.
        norm : {None, "backward", "ortho", "forward"}
            As NumPy's (None is "backward"). Like ``axes`` and ``s``, compared over the
            groups in the exchanges' agreement check: ranks passing different norms raise
            :class:`~pympar.errors.CollectiveMismatchError` on every rank.
        s : sequence of int, optional
            The field's global lengths along ``axes``; checked against every rank's block.
            For ``irfftn`` it gives the real length of the last axis (default even, as
            NumPy's). Without it the ranks' extents are learned in the exchange.
        out : array, optional
            Where to write this rank's block of the result: C-contiguous, of ``x``'s
            library, of the result's dtype and (with ``s=``, checked on every rank) shape.
            Reusing one spares the allocation of a large result, whose first touch of
            fresh pages can cost as much as a transform.

        Returns
        -------
        array
            This rank's block of the result: ``out``, or a new array of ``x``'s library.
        """
        call = _Call(self.name + ".forward", x, groups, axes, norm, s, self.real, self.inverse,
                     out)
        return _to_physical(call, x, out=out) if self.inverse else _to_spectral(call, x, out=out)

    def backward(self, dy: Any, groups: Groups, axes: Sequence[int] | None = None,
                 norm: str | None = None, s: Sequence[int] | None = None) -> Any:
        """The adjoint of :meth:`__call__` with the same arguments, applied to ``dy``
        (the gradient of a loss with respect to the output: the result is that with respect
        to the input). ``s`` as in :meth:`__call__`; ``rfftn.backward`` needs it for an odd
        last length."""
        call = _Call(self.name + ".backward", dy, groups, axes, norm, s, self.real,
                     not self.inverse)
        call.norm = ADJOINT_NORM[call.norm]
        if self.inverse:
            return _to_spectral(call, dy, double_pairs=self.real)
        return _to_physical(call, dy, halve_pairs=self.real)


rfftn = FFTPair("rfftn", real=True, inverse=False)
irfftn = FFTPair("irfftn", real=True, inverse=True)
fftn = FFTPair("fftn", real=False, inverse=False)
ifftn = FFTPair("ifftn", real=False, inverse=True)

for _pair, _what in ((rfftn, "real field to half spectrum (r2c)"),
                     (irfftn, "half spectrum to real field (c2r)"),
                     (fftn, "complex field to spectrum"), (ifftn, "spectrum to complex field")):
    _pair.__doc__ = (f"Distributed :func:`numpy.fft.{_pair.name}`, {_what}; "
                     f"``{_pair.name}.backward`` is its adjoint. See :class:`FFTPair`.")
del _pair, _what
