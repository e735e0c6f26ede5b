"""Weight init methods: how one row of a logical weight is filled.

An init method is a callable ``fn(rng, out, fan_in, fan_out)``: ``rng`` is a
:class:`numpy.random.Generator` positioned at the start of one row, ``out`` a 1-D float64
NumPy array of that row's length. It fills ``out`` in place and returns ``None`` (or returns an
array of ``out``'s shape, which is copied in). It must consume ``rng`` deterministically.
The factories below build such callables; ``init_method`` arguments also accept their names
as strings, meaning the factory with default arguments.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Union

import numpy

InitMethod = Callable[[numpy.random.Generator, numpy.ndarray, int, int], Any]
"""Signature of an init method: ``fn(rng, out, fan_in, fan_out) -> None``."""

def xavier_uniform(gain: float = 1.0) -> InitMethod:
    """Glorot uniform: U(-b, b) with ``b = gain * sqrt(6 / (fan_in + fan_out))``."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_uniform(rng, out, gain * math.sqrt(6.0 / (fan_in + fan_out)))

    init.__qualname__ = f"xavier_uniform(gain={gain})"
    return init


def xavier_normal(gain: float = 1.0) -> InitMethod:
    """Glorot normal: N(0, s^2) with ``s = gain * sqrt(2 / (fan_in + fan_out))``."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_normal(rng, out, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))

    init.__qualname__ = f"xavier_normal(gain={gain})"
    return init


def kaiming_uniform(a: float = math.sqrt(5.0)) -> InitMethod:
    """He uniform for a leaky-ReLU gain, fan-in mode: U(-b, b), ``b = sqrt(6 / ((1 + a^2) fan_in))``.

    The default ``a = sqrt(5)`` is what ``torch.nn.Linear`` uses, giving ``b = 1 / sqrt(fan_in)``.
    (``torch.nn.init.kaiming_uniform_`` itself defaults to ``a = 0``; pass ``a=0`` for that.)
    """

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_uniform(rng, out, math.sqrt(6.0 / ((1.0 + a * a) * fan_in)))

    init.__qualname__ = f"kaiming_uniform(a={a})"
    return init


def normal(std: float = 0.02, mean: float = 0.0) -> InitMethod:
    """N(mean, std^2), independent of fan; the string ``"normal"`` means ``std=0.02``."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        _fill_normal(rng, out, mean, std)

    init.__qualname__ = f"normal(std={std}, mean={mean})"
    return init


def uniform(low: float = 0.0, high: float = 1.0) -> InitMethod:
    """U(low, high), independent of fan."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        rng.random(out=out)
        out *= high - low
        out += low

    init.__qualname__ = f"uniform(low={low}, high={high})"
    return init


def zeros() -> InitMethod:
    """All zeros (consumes no random numbers)."""

    def init(rng: numpy.random.Generator, out: numpy.ndarray, fan_in: int, fan_out: int) -> None:
        out.fill(0.0)

    init.__qualname__ = "zeros()"
    return init


def _fill_uniform(rng: numpy.random.Generator, out: numpy.ndarray, bound: float) -> None:
    rng.random(out=out)
    out *= 2.0 * bound
    out -= bound


def _fill_normal(rng: numpy.random.Generator, out: numpy.ndarray, mean: float, std: float) -> None:
    rng.standard_normal(out=out)
    out *= std
    if mean:
        out += mean


_NAMED: dict[str, Callable[[], InitMethod]] = {
    "xavier_uniform": xavier_uniform,
    "xavier_normal": xavier_normal,
    "kaiming_uniform": kaiming_uniform,
    "normal": normal,
    "uniform": uniform,
    "zeros": zeros,
}

# The factories are exported under the names init_method strings give them.
__all__ = ["InitMethod", *_NAMED, "get_init_method"]


def get_init_method(init_method: Union[str, InitMethod]) -> InitMethod:
    """Resolve a name (``"xavier_uniform"``, ``"xavier_normal"``, ``"kaiming_uniform"``,
    ``"normal"``, ``"uniform"``, ``"zeros"``) or an init-method callable.

    Raises
    ------
    ValueError
        For an unknown name or a non-callable.
    """
    if isinstance(init_method, str):
        if init_method not in _NAMED:
            raise ValueError(
                f"unknown init_method {init_method!r}; expected one of {sorted(_NAMED)} "
                "or a callable fn(rng, out, fan_in, fan_out)"
            )
        return _NAMED[init_method]()
    if callable(init_method):
        return init_method
    raise ValueError(f"init_method must be a name or a callable, got {init_method!r}")
