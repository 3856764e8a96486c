"""Copies of port functions that see one of their globals replaced.

A bug usually sits in a helper several calls below a capability (a Triton
``@jit`` helper inside a kernel inside a Python wrapper). Instead of copying
that whole chain, :func:`rebind` copies only the functions on the way and
gives each copy a globals dict in which the buggy replacement stands for the
original; everything else is the port's own code, unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from dcpcheck.port import triton_env  # noqa: F401  (first: sets TRITON_INTERPRET before triton loads)

import triton
from triton.runtime import KernelInterface

PORT_PACKAGE = "dcpcheck.port"


def _is_port(name: str) -> bool:
    return name == PORT_PACKAGE or name.startswith(PORT_PACKAGE + ".")


def python_function(obj) -> types.FunctionType | None:
    """The Python function of a plain or ``@triton.jit`` function, else None."""
    fn = obj.fn if isinstance(obj, KernelInterface) else obj
    return fn if isinstance(fn, types.FunctionType) else None


def _defined_in(obj, module: types.ModuleType) -> bool:
    fn = python_function(obj)
    return fn is not None and fn.__module__ == module.__name__


def _referenced_names(code: types.CodeType) -> set[str]:
    """Global and attribute names used by ``code`` and its nested code
    (comprehensions, lambdas): a superset of the globals it reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _referenced_names(const)
    return names


class _Rebinder:
    """One replacement of globals of one port module, applied to every port
    function reached from an entry point (memoised: shared helpers are
    copied once)."""

    def __init__(self, module: types.ModuleType, replacements: Mapping[str, object]):
        self.module_name = module.__name__
        self.replacements = dict(replacements)
        # A function defined in ``module`` is replaced wherever it is reached,
        # under any name (imported by another module, or an entry point
        # itself); an imported name or a constant only as ``module``'s global.
        self.function_names = {
            id(getattr(module, name)): name for name in replacements if _defined_in(getattr(module, name), module)
        }
        self.used: set[str] = set()
        self.memo: dict[int, object] = {}

    def function(self, obj):
        """``obj`` itself when nothing below it changes, else a rebound copy."""
        if id(obj) in self.function_names:
            name = self.function_names[id(obj)]
            self.used.add(name)
            return self.replacements[name]
        fn = python_function(obj)
        if fn is None or not _is_port(fn.__module__):
            return obj
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        self.memo[id(obj)] = obj  # a recursive call sees the original while its copy is built
        overrides = self._overrides(fn.__globals__, fn.__module__, _referenced_names(fn.__code__))
        result = obj if not overrides else _copy_function(fn, overrides, jitted=isinstance(obj, KernelInterface))
        self.memo[id(obj)] = result
        return result

    def _overrides(self, namespace: Mapping[str, object], module_name: str, names: set[str]) -> dict:
        overrides = {}
        for name in names:
            if module_name == self.module_name and name in self.replacements:
                overrides[name] = self.replacements[name]
                self.used.add(name)
            elif name in namespace:
                value = namespace[name]
                if isinstance(value, types.ModuleType):
                    rebound = self._module_view(value, names)
                else:
                    rebound = self.function(value)
                if rebound is not value:
                    overrides[name] = rebound
        return overrides

    def _module_view(self, module: types.ModuleType, names: set[str]):
        """A port module used as ``module.attr`` (e.g. ``gate.build_attention``):
        a stand-in module whose attributes among ``names`` are rebound."""
        if not _is_port(module.__name__):
            return module
        overrides = self._overrides(vars(module), module.__name__, names)
        if not overrides:
            return module
        view = types.ModuleType(module.__name__, module.__doc__)
        view.__dict__.update(vars(module))
        view.__dict__.update(overrides)
        return view


def _copy_function(fn: types.FunctionType, overrides: dict, *, jitted: bool):
    namespace = {**fn.__globals__, **overrides}
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    # Same source and code, so Triton (JIT or interpreter) parses it as the
    # original; only the names it resolves through its globals differ.
    return triton.jit(copy) if jitted else copy


def rebind(entries: Mapping[str, object], module: types.ModuleType, replacements: Mapping[str, object]) -> dict:
    """``entries`` (name -> port function) rebound so that ``module``'s
    globals ``replacements`` are replaced wherever they are reached.
    Returns only the entries that changed; raises when a replacement is
    reached from no entry (the bug would be dead code)."""
    unknown = sorted(name for name in replacements if not hasattr(module, name))
    if unknown:
        raise AttributeError(f"{module.__name__} has no global {unknown}: the port changed under this mutant")
    rebinder = _Rebinder(module, replacements)
    changed = {}
    for name, entry in entries.items():
        rebound = rebinder.function(entry)
        if rebound is not entry:
            changed[name] = rebound
    unused = sorted(set(replacements) - rebinder.used)
    if unused:
        raise LookupError(f"no entry point reaches {module.__name__}.{unused}: the mutant would change nothing")
    return changed
