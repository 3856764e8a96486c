"""The mutant base class and the registry of every mutant.

A mutant is :class:`EmbeddedPort` with one bug: ``bug`` names a global of a
port module (a function, a Triton helper or kernel, a constant) and the
buggy stand-in for it. Every capability of the port that reaches that global
gets a rebound copy (:mod:`dcpcheck.mutants.rebind`), so the mutant is the
whole port with that one change, however deep it sits.
"""

from __future__ import annotations

import inspect
import types
from typing import ClassVar

from dcpcheck.impls.protocol import CAPABILITIES
from dcpcheck.mutants.diff import copy_hunks
from dcpcheck.mutants.rebind import python_function, rebind
from dcpcheck.port.impl import EmbeddedPort
from dcpcheck.stages import STAGES

REGISTRY: dict[str, type[Mutant]] = {}


class Swap:
    """The bug: in port ``module``, the globals ``replacements`` (name -> stand-in)."""

    def __init__(self, module: types.ModuleType, **replacements):
        self.module = module
        self.replacements = replacements


class Mutant(EmbeddedPort):
    """Subclasses set ``stage``, ``home`` (the test dir expected to kill it),
    ``description`` (one line) and ``bug``; defining ``bug`` registers the class."""

    stage: ClassVar[int]
    home: ClassVar[str]
    description: ClassVar[str]
    bug: ClassVar[Swap]
    mutated_capabilities: ClassVar[tuple[str, ...]]  # the capabilities the bug reaches

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "bug" not in cls.__dict__:
            return  # a family base, not a mutant
        if cls.stage not in STAGES:
            raise TypeError(f"{cls.__name__}: stage {cls.stage} is not one of {sorted(STAGES)}")
        if "\n" in cls.description.strip():
            raise TypeError(f"{cls.__name__}: the description must be one line")
        if cls.__name__ in REGISTRY:
            raise TypeError(f"two mutants named {cls.__name__}")
        entries, static = {}, set()
        for name in CAPABILITIES:
            raw = inspect.getattr_static(EmbeddedPort, name, None)
            if isinstance(raw, staticmethod):
                static.add(name)
                raw = raw.__func__
            if raw is not None:
                entries[name] = raw
        changed = rebind(entries, cls.bug.module, cls.bug.replacements)
        for name, function in changed.items():
            setattr(cls, name, staticmethod(function) if name in static else function)
        cls.name = cls.__name__
        cls.mutated_capabilities = tuple(sorted(changed))
        REGISTRY[cls.__name__] = cls

    @classmethod
    def drift(cls) -> str | None:
        """Why a buggy copy no longer matches the port function it replaces
        (it should differ in exactly one hunk: the bug), or None."""
        module = cls.bug.module
        for name, replacement in cls.bug.replacements.items():
            original = getattr(module, name)
            if python_function(original) is None or python_function(replacement) is None:
                continue  # a constant, a class or a partial: not a copy
            hunks = copy_hunks(original, replacement)
            if len(hunks) != 1:
                shown = "; ".join(" / ".join(hunk) for hunk in hunks)[:300]
                return (
                    f"the copy of {module.__name__}.{name} differs from the port in {len(hunks)} hunks, "
                    f"not 1: {shown}"
                )
        return None
