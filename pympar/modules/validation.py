"""The one input check of the layers: an array of the layer's dtype and expected shape."""

from __future__ import annotations

from typing import Any

import numpy

from .. import backend

__all__ = ["check_array", "layer_name"]


def layer_name(layer: Any) -> str:
    """``layer`` in one line, for messages: its ``repr``, or for a container (whose ``repr``
    lists its children over several lines) its class and ``extra_repr``."""
    text = repr(layer)
    if "\n" in text and hasattr(layer, "extra_repr"):
        return f"{type(layer).__name__}({layer.extra_repr()})"
    return text


def check_array(layer: Any, x: Any, last_dim: int | None, dtype: Any, what: str = "input",
                shape: tuple[int, ...] | None = None, min_ndim: int = 1) -> None:
    """Raise naming ``layer`` unless ``x`` is an array of ``dtype`` with the expected shape.

    The one input/shape check of the layers. No silent casts: a cast would copy every
    activation.

    Parameters
    ----------
    layer : object
        The layer, shown by :func:`layer_name` in the message.
    x : array
        The array to check.
    last_dim : int or None
        Required size of the last axis (``None``: any).
    dtype : dtype
        Required dtype.
    what : str, default "input"
        What ``x`` is, for the message (e.g. ``"output gradient"``).
    shape : tuple of int, optional
        The exact shape required (then ``last_dim`` is not used).
    min_ndim : int, default 1
        Fewest axes accepted.

    Raises
    ------
    TypeError
        When ``x`` is not an array.
    ValueError
        On a wrong shape or dtype.
    """
    if not isinstance(x, numpy.ndarray) and not backend.is_cupy_array(x):
        # Array-likes (lists, torch tensors, objects with __array__) are refused, not
        # converted: a conversion would copy every activation.
        raise TypeError(f"{layer_name(layer)}: expected a numpy.ndarray or cupy.ndarray as {what}, got "
                        f"{type(x).__name__} (convert it with numpy.asarray)")
    if shape is not None:
        ok, want = tuple(x.shape) == tuple(shape), str(tuple(shape))
    else:
        ok = x.ndim >= min_ndim and (last_dim is None or x.shape[-1] == last_dim)
        want = "(" + ", ".join(["rows"] * (min_ndim - 1) + ["...", str(last_dim)]) + ")"
    if not ok or x.dtype != dtype:
        raise ValueError(f"{layer_name(layer)}: expected {what} of shape {want} and dtype "
                         f"{numpy.dtype(dtype).name}, got shape {tuple(x.shape)} and dtype "
                         f"{x.dtype}")
