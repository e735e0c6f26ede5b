"""``Parameter``: a trainable array, its gradient and its place in the full array."""

from __future__ import annotations

from typing import Any

from ..backend import array_module
from ..partition import Placement

__all__ = ["Parameter"]


class Parameter:
    """A trainable array and its accumulated gradient.

    Parameters
    ----------
    data : array
        The value, a NumPy or CuPy array. Stored as given, not copied.
    name : str, optional
        A human-readable name, used in error messages.
    placement : Placement, optional
        Where ``data`` sits in the full (serial-layout) parameter: the full shape and the
        splits (group, axis, stride) that cut this rank's block from it, so that
        ``placement.take(full)`` is ``data``. Default: replicated, the full shape being
        ``data.shape``.
    requires_grad : bool, default True
        False freezes the parameter: no gradient is computed or accumulated for it.

    Attributes
    ----------
    data : array
        The value; optimizers update it in place.
    grad : array or None
        ``None`` until the first :meth:`accumulate_grad`, afterwards an array with the shape,
        dtype and array module of ``data``.
    """

    def __init__(
        self,
        data: Any,
        *,
        name: str | None = None,
        placement: Placement | None = None,
        requires_grad: bool = True,
    ) -> None:
        self.data = data
        self.grad = None
        self.name = name
        self.placement = Placement(tuple(data.shape)) if placement is None else placement
        if self.placement.local_shape != tuple(data.shape):
            raise ValueError(f"Parameter {name or ''}: placement {self.placement} describes a "
                             f"shard of shape {self.placement.local_shape}, data has "
                             f"{tuple(data.shape)}")
        self.requires_grad = bool(requires_grad)

    @property
    def shape(self) -> tuple[int, ...]:
        """tuple of int: Shape of ``data``."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        """dtype: Data type of ``data``."""
        return self.data.dtype

    @property
    def size(self) -> int:
        """int: Number of elements of ``data``."""
        return int(self.data.size)

    def accumulate_grad(self, g: Any, *, consume: bool = False) -> None:
        """Add ``g`` to the gradient, creating it on first use.

        Parameters
        ----------
        g : array
            Gradient contribution, same shape as ``data``.
        consume : bool, default False
            When True and no gradient exists yet, keep ``g`` itself as the gradient buffer
            instead of copying it (saves one weight-sized copy for freshly computed arrays).
            The caller must not use ``g`` afterwards.

        Raises
        ------
        ValueError
            If ``g`` does not have the shape of ``data``.
        """
        if tuple(g.shape) != tuple(self.data.shape):
            raise ValueError(
                f"Parameter {self.name or ''}: gradient shape {tuple(g.shape)} does not match "
                f"parameter shape {tuple(self.data.shape)}"
            )
        if self.grad is None:
            if consume and g.dtype == self.data.dtype and _same_module(g, self.data):
                self.grad = g
            else:
                # empty_like + assignment keeps data's dtype and array module.
                grad = array_module(self.data).empty_like(self.data)
                grad[...] = g
                self.grad = grad
        else:
            self.grad += g

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the gradient.

        Parameters
        ----------
        set_to_none : bool, default False
            False fills an existing gradient with zeros in place (its buffer is kept, so
            communication buckets and optimizers see a stable array); True drops it to ``None``.
        """
        if set_to_none:
            self.grad = None
        elif self.grad is not None:
            self.grad.fill(0)

    def __repr__(self) -> str:
        extra = "" if self.placement.replicated else f", full_shape={self.placement.shape}"
        label = f"{self.name!r}, " if self.name else ""
        return f"Parameter({label}shape={self.shape}, dtype={self.dtype}{extra})"


def _same_module(a: Any, b: Any) -> bool:
    # Both are ndarray subclasses of the same library exactly when their types share a module root.
    return type(a).__module__.split(".")[0] == type(b).__module__.split(".")[0]
