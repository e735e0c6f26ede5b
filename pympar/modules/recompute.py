"""Activation recomputation: keep a block's input only, rerun its forward in backward."""

from __future__ import annotations

from typing import Any

import numpy as np

from .core import Module

__all__ = ["Recompute"]


class Recompute(Module):
    """Run ``module`` keeping only its input; recompute its forward at the start of backward.

    Forward runs ``module`` and then drops every cache its submodules saved for backward, so
    the block costs one input-sized array until backward. Backward reruns the forward on the
    kept input (its collectives included, so every rank of the module's groups must recompute
    too, as they do when every rank wraps the same block) and then calls ``module.backward``.

    Random streams are replayed: a submodule with a ``calls`` counter (e.g.
    :class:`~pympar.modules.Dropout`, whose mask is a Philox draw positioned by ``calls``) is
    rewound to its pre-forward position for the recomputation, so the masks, and hence the
    gradients, are bitwise those of an unwrapped run. NumPy's global random state
    (``numpy.random.rand`` and friends) is replayed too, as torch's checkpoint replays its
    global generator: the recomputation draws what the forward drew, and the state after
    backward is the one backward found. A ``numpy.random.Generator`` held by the block itself
    is not rewound; draw from a seeded stream positioned by ``calls`` instead (as ``Dropout``
    does). The global state is kept for backward only when the forward drew from it.

    Parameters
    ----------
    module : Module
        The block to recompute; its parameters are this module's parameters.
    """

    def __init__(self, module: Module) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"Recompute: expected a Module, got {type(module).__name__}")
        self.module = module

    @property
    def input_grad(self) -> bool:
        """bool: Whether backward computes the input gradient (the wrapped module's flag)."""
        return getattr(self.module, "input_grad", True)

    @input_grad.setter
    def input_grad(self, value: bool) -> None:
        module = self.__dict__.get("module")
        if module is not None:  # Module.__init__ may set the flag before the child exists
            module.input_grad = bool(value)

    def _streams(self) -> list[tuple[Module, int]]:
        return [(m, m.calls) for m in self.module.modules()
                if isinstance(getattr(m, "calls", None), int)]

    def forward(self, x: Any) -> Any:
        """Return ``module(x)``, keeping only ``x`` (and stream positions) for backward."""
        streams = self._streams()
        global_state = np.random.get_state()
        y = self.module.forward(x)
        if _same_state(global_state, np.random.get_state()):
            global_state = None  # the block drew nothing from it: nothing to replay or keep
        for m in self.module.modules():
            object.__setattr__(m, "_saved", None)
        self.save_for_backward(x, streams, global_state)
        return y

    def backward(self, dy: Any) -> Any:
        """Recompute the forward from the kept input, then return ``module.backward(dy)``."""
        x, streams, global_state = self.saved_tensors()
        after = self._streams()
        state_now = None if global_state is None else np.random.get_state()
        for m, position in streams:
            m.calls = position
        if global_state is not None:
            np.random.set_state(global_state)
        try:
            self.module.forward(x)
        finally:
            if state_now is not None:
                np.random.set_state(state_now)
            for m, position in after:
                m.calls = position
        return self.module.backward(dy)

    def extra_repr(self) -> str:
        """Nothing beyond the wrapped module, shown as a child."""
        return ""


def _same_state(a: tuple, b: tuple) -> bool:
    """Whether two ``numpy.random.get_state()`` tuples are one position of the stream."""
    return a[2:] == b[2:] and np.array_equal(a[1], b[1])
