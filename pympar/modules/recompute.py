"""Activation recomputation: keep a block's input only, rerun its forward in backward."""

from __future__ import annotations

from typing import Any

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
    gradients, are bitwise those of an unwrapped run.

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
        y = self.module.forward(x)
        for m in self.module.modules():
            object.__setattr__(m, "_saved", None)
        self.save_for_backward(x, streams)
        return y

    def backward(self, dy: Any) -> Any:
        """Recompute the forward from the kept input, then return ``module.backward(dy)``."""
        x, streams = self.saved_tensors()
        after = self._streams()
        for m, position in streams:
            m.calls = position
        self.module.forward(x)
        for m, position in after:
            m.calls = position
        return self.module.backward(dy)

    def extra_repr(self) -> str:
        """Nothing beyond the wrapped module, shown as a child."""
        return ""
