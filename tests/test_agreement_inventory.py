"""The agreement's inventory (:mod:`pympar.agreed`) covers every public communicating call.

Every inventoried call resolves, and its parameters (``inspect.signature``, a mapping's
``**options`` read from its step) are exactly the ones classified; every public callable of
the inventoried modules is inventoried or listed outside with a reason; every public module
is one of those or listed outside; every ``PYMPAR_*`` variable the package reads is in
:data:`pympar.agreed.SETTINGS`. A doctored copy shows that each of these checks fails.
(Whether each agreed entry really raises is tests/test_agreement_mismatch.py.)
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
from typing import Any, Iterator

import pytest

import pympar
from pympar import agreed, mappings

# What the discovery looks at in a public class.
METHODS = ("__init__", "__call__", "forward", "backward", "step", "exchange", "adjoint",
           "refuse")


def resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def identity(obj: Any) -> Any:
    """What a callable is, for comparing a discovered one with an inventoried one: a
    function (inherited methods are their class's), or an instance and its call."""
    if inspect.ismethod(obj):
        owner = obj.__self__
        return obj.__func__ if inspect.isclass(owner) else (id(owner), obj.__func__)
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj):
        return getattr(obj, "__wrapped__", obj)
    if callable(obj):
        return (id(obj), type(obj).__call__)
    return obj


def parameters(path: str) -> set[str]:
    """The parameters of an inventoried call (without ``self``; a mapping direction's
    ``**options`` replaced by its step's options)."""
    obj = resolve(path)
    direction = obj.__self__ if inspect.ismethod(obj) else obj
    found = list(inspect.signature(obj).parameters.values())
    if found and found[0].name == "self":
        found = found[1:]
    names = {p.name for p in found}
    if isinstance(direction, mappings._Direction):
        names = (names - {"options"}) | set(direction._step.options)
    return names


def discovered(modules: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """``(path, identity)`` of every public callable of ``modules`` (by their ``__all__``):
    functions, mapping directions and FFTs, and public classes' :data:`METHODS`."""
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            path = f"{module_name}.{name}"
            if isinstance(obj, (mappings.Mapping, pympar.fft.FFTPair)):
                yield f"{path}.__call__", identity(obj.__call__)
                yield f"{path}.backward", identity(obj.backward)
            elif inspect.isclass(obj):
                for method in METHODS:  # defined by pympar's classes, not by Python's
                    owner = next((k for k in obj.__mro__ if method in vars(k)), object)
                    if owner.__module__.startswith("pympar"):
                        yield f"{path}.{method}", identity(getattr(obj, method))
            elif callable(obj) and not hasattr(obj, "__origin__"):  # not a typing alias
                yield path, identity(obj)


def problems(inventory: dict, outside: dict, modules: tuple, modules_outside: dict,
             settings: dict) -> list[str]:
    """Everything the inventory misses or lists wrongly (empty: complete)."""
    found = []
    for path, params in inventory.items():
        try:
            actual = parameters(path)
        except (ImportError, AttributeError) as err:
            found.append(f"{path}: inventoried but not found ({err})")
            continue
        for name in sorted(actual - set(params)):
            found.append(f"{path}: parameter {name!r} is in no list of pympar.agreed")
        for name in sorted(set(params) - actual):
            found.append(f"{path}: {name!r} is classified but the call has no such parameter")
        for name, entry in params.items():
            if entry.kind not in agreed.KINDS or not entry.how:
                found.append(f"{path}: {name!r} has kind {entry.kind!r} and how {entry.how!r}")
    for path in set(inventory) & set(outside):
        found.append(f"{path}: both inventoried and outside")
    listed = {}
    for path in (*inventory, *outside):
        try:
            listed[identity(resolve(path))] = path
        except (ImportError, AttributeError):
            found.append(f"{path}: listed but not found")
    for path, key in discovered(modules):
        if key not in listed:
            found.append(f"{path}: a public callable neither inventoried nor outside "
                         f"(pympar.agreed.INVENTORY or OUTSIDE, with why)")
    public = {f"pympar.{m.name}" for m in pkgutil.iter_modules(pympar.__path__)
              if not m.name.startswith("_")}
    for name in sorted(public - set(modules) - set(modules_outside)):
        found.append(f"{name}: a public module neither in MODULES nor MODULES_OUTSIDE")
    for name in sorted((set(modules) | set(modules_outside)) - public):
        found.append(f"{name}: listed but not a module of pympar")
    root = os.path.dirname(pympar.__file__)
    read = set()
    for folder, _, files in os.walk(root):
        for file in files:
            if file.endswith(".py") and file != "agreed.py":
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    read |= set(re.findall(r"PYMPAR_[A-Z][A-Z_]*[A-Z]", f.read()))
    for name in sorted(read - set(settings)):
        found.append(f"{name}: a setting the package reads, in no list (SETTINGS)")
    for name in sorted(set(settings) - read):
        found.append(f"{name}: in SETTINGS but read nowhere")
    return found


def actual_problems(**changes: Any) -> list[str]:
    lists = dict(inventory=agreed.INVENTORY, outside=agreed.OUTSIDE, modules=agreed.MODULES,
                 modules_outside=agreed.MODULES_OUTSIDE, settings=agreed.SETTINGS)
    lists.update(changes)
    return problems(**lists)


def test_every_public_communicating_call_and_argument_is_classified():
    found = actual_problems()
    assert not found, "\n".join(found)


def test_the_mapping_directions_and_transforms_are_all_listed():
    """Each mapping's two directions and each FFT's, communicating or not, are listed."""
    for m in mappings.MAPPINGS:
        for direction in ("__call__", "backward"):
            path = f"pympar.mappings.{m.name}.{direction}"
            assert (path in agreed.INVENTORY) != (path in agreed.OUTSIDE), path
            step = (m if direction == "__call__" else m.backward)._step
            # the inventory says a step communicates exactly when it makes a check
            assert (path in agreed.INVENTORY) == (step.sends({}) is True), path
    for name in ("rfftn", "irfftn", "fftn", "ifftn"):
        assert f"pympar.fft.{name}.backward" in agreed.INVENTORY


def test_an_unclassified_argument_fails(monkeypatch):
    """A parameter added to a public call, or one left out of the lists, is reported."""
    path = "pympar.collectives.all_reduce"
    fewer = {**agreed.INVENTORY, path: {k: v for k, v in agreed.INVENTORY[path].items()
                                        if k != "op"}}
    assert any("'op' is in no list" in p for p in actual_problems(inventory=fewer))
    # A new keyword of a mapping step, and a new parameter of a layer's constructor.
    monkeypatch.setattr(mappings.copy_to_all.backward._step, "options",
                        frozenset({"new_option"}))
    from pympar.modules import ColumnParallelLinear

    original = ColumnParallelLinear.__init__

    def widened(self, in_features, out_features, *args, new_flag=False, **kwargs):
        original(self, in_features, out_features, *args, **kwargs)

    monkeypatch.setattr(ColumnParallelLinear, "__init__", widened)
    found = actual_problems()
    assert any("copy_to_all.backward: parameter 'new_option'" in p for p in found), found
    assert any("ColumnParallelLinear.__init__: parameter 'new_flag'" in p for p in found)


def test_a_new_public_call_module_or_setting_fails(monkeypatch):
    """A new public function of a listed module, a new module, a new setting: reported."""
    from pympar import collectives

    def all_reduce_twice(group: Any, x: Any) -> Any:
        return group.all_reduce(group.all_reduce(x))

    monkeypatch.setattr(collectives, "__all__", [*collectives.__all__, "all_reduce_twice"])
    monkeypatch.setattr(collectives, "all_reduce_twice", all_reduce_twice, raising=False)
    found = actual_problems()
    assert any("collectives.all_reduce_twice: a public callable" in p for p in found), found
    fewer = {k: v for k, v in agreed.MODULES_OUTSIDE.items() if k != "pympar.preemption"}
    assert any("pympar.preemption: a public module" in p
               for p in actual_problems(modules_outside=fewer))
    settings = {k: v for k, v in agreed.SETTINGS.items() if k != "PYMPAR_CUDA_AWARE"}
    assert any("PYMPAR_CUDA_AWARE: a setting" in p
               for p in actual_problems(settings=settings))
    gone = {**agreed.INVENTORY, "pympar.collectives.all_reduce_thrice": {}}
    assert any("all_reduce_thrice: inventoried but not found" in p
               for p in actual_problems(inventory=gone))


def test_the_tables_render_every_entry():
    text = agreed.table()
    rows = sum(len(params) for params in agreed.INVENTORY.values())
    assert text.count("\n   * - ") == rows + 1
    assert agreed.settings_table().count("\n   * - ") == len(agreed.SETTINGS) + 1


@pytest.mark.parametrize("path", sorted(agreed.OUTSIDE))
def test_every_outside_entry_says_why(path):
    assert len(agreed.OUTSIDE[path]) > 10
