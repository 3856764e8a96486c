"""Every mutant, by name: ``--dcp-impl dcpcheck.mutants.catalog:<Name>``.

Importing this module imports every family of mutants; each mutant class
registers itself (:data:`dcpcheck.mutants.base.REGISTRY`) when defined.
"""

from __future__ import annotations

from dcpcheck.mutants import stage1, stage3, stage3_gate, stage9  # noqa: F401  (define and register their mutants)
from dcpcheck.mutants.base import REGISTRY, Mutant

MUTANTS: tuple[type[Mutant], ...] = tuple(REGISTRY.values())


def __getattr__(name: str) -> type[Mutant]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise AttributeError(f"no mutant named {name!r}; known: {', '.join(REGISTRY)}") from None
