"""Several micro-batches in flight through layers that keep one cache each.

Every layer keeps the cache of its last forward (:meth:`pympar.modules.Module.
save_for_backward`). A pipeline schedule runs several forwards before their backwards, so
after each forward it takes the stage's caches out (:func:`take_caches`), and puts them back
right before that micro-batch's backward (:func:`put_caches`): no layer changes, and what a
micro-batch keeps alive is exactly what its layers cached.

Debug mode's check of skipped backwards (:mod:`pympar.debug`) stays as it is: a cache put
back counts as saved at that moment, so a layer whose backward the stage then skips still
holds it when the next forward or ``allreduce_gradients`` comes, which raise as in a serial
run; :func:`check_consumed` says so at once.
"""

from __future__ import annotations

from .. import debug
from ..modules import core
from ..modules.core import Module
from ..modules.validation import layer_name

__all__ = ["Caches", "take_caches", "put_caches", "check_consumed"]


class Caches:
    """The caches of one forward of a module, taken out of its layers.

    Attributes
    ----------
    entries : list of (Module, tuple)
        Each layer that had a cache, with it.
    """

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[Module, tuple]]) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)


def take_caches(module: Module) -> Caches:
    """Take the caches of ``module``'s layers (itself and every descendant) out of them.

    Returns
    -------
    Caches
        Pass it to :func:`put_caches` before the backward of the same forward.
    """
    entries = []
    for layer in module.modules():
        saved = layer.__dict__.get("_saved")
        if saved is not None:
            entries.append((layer, saved))
            object.__setattr__(layer, "_saved", None)
    return Caches(entries)


def put_caches(module: Module, caches: Caches) -> None:
    """Put caches taken by :func:`take_caches` back into their layers, for the backward.

    Raises
    ------
    RuntimeError
        When a layer holds a cache already (another forward's, not taken out).
    """
    held = [layer for layer, _ in caches.entries if layer.__dict__.get("_saved") is not None]
    if held:
        raise RuntimeError(f"put_caches: {', '.join(layer_name(m) for m in held[:4])} of "
                           f"{type(module).__name__} still hold the cache of another forward; "
                           f"take each forward's caches out before the next forward")
    for layer, saved in caches.entries:
        object.__setattr__(layer, "_saved", saved)
        if debug._enabled:  # saved now, as far as the skipped-backward check can tell
            object.__setattr__(layer, "_saved_at", core._backwards_run[0])
            core._cached_in_debug.add(layer)
    caches.entries = []


def check_consumed(module: Module, what: str) -> None:
    """Debug mode: raise RuntimeError when a layer of ``module`` still holds a cache after
    a backward (the stage skipped its backward); nothing outside debug mode."""
    if not debug._enabled:
        return
    pending = [layer for layer in module.modules() if layer.__dict__.get("_saved") is not None]
    if pending:
        names = ", ".join(layer_name(m) for m in pending[:4])
        raise RuntimeError(f"{what}: the backward of {names} never ran after its forward, so "
                           f"their gradients lack this micro-batch; run backward through every "
                           f"layer (debug mode checks this)")
