"""Layout tags: which 3D layout an activation block is in, so that a layer can refuse one
in the wrong layout instead of computing a wrong answer.

Two layouts of one cube can give blocks of the same local shape (the input and output groups
exchange roles between consecutive 3D layers), so the shape alone cannot tell them apart.
Layers tag the blocks they return with their layout's key; element-wise layers carry the tag
from input to output. The tag lives in a side table keyed by the array's identity, held
through a weak reference so that it dies with the array. Untagged arrays (made by user code)
are not checked. Arrays that do not support weak references (some array types) stay untagged.
"""

from __future__ import annotations

import weakref
from typing import Any, Hashable

__all__ = ["tag", "tag_of", "carry"]

_TAGS: dict[int, tuple[weakref.ref, Hashable]] = {}


def tag(array: Any, key: Hashable) -> Any:
    """Record that ``array`` is in layout ``key``; return ``array``."""
    ident = id(array)

    def forget(ref: weakref.ref, ident: int = ident) -> None:
        entry = _TAGS.get(ident)
        if entry is not None and entry[0] is ref:
            del _TAGS[ident]

    try:
        ref = weakref.ref(array, forget)
    except TypeError:
        return array
    _TAGS[ident] = (ref, key)
    return array


def tag_of(array: Any) -> Hashable | None:
    """The layout key of ``array``, or None when it carries none."""
    entry = _TAGS.get(id(array))
    if entry is None or entry[0]() is not array:
        return None
    return entry[1]


def carry(source: Any, result: Any) -> Any:
    """Give ``result`` the tag of ``source`` (element-wise layers keep the layout)."""
    key = tag_of(source) if _TAGS else None
    return result if key is None else tag(result, key)
