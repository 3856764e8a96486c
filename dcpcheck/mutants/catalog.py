"""Every mutant, by name: ``--dcp-impl dcpcheck.mutants.catalog:<Name>``.

:data:`MUTANTS` holds the records (cheap: nothing is copied or imported);
``catalog.<Name>`` loads that mutant (:func:`dcpcheck.mutants.loader.load`).
"""

from __future__ import annotations

from dcpcheck.mutants import field, stage1, stage3, stage3_gate, stage9
from dcpcheck.mutants.loader import load
from dcpcheck.mutants.patch import Mutant
from dcpcheck.stages import STAGES

# The field's bug reports as mutants (field.py) come after the catalog's own.
MUTANTS: tuple[Mutant, ...] = (
    *stage1.MUTANTS,
    *stage3.MUTANTS,
    *stage3_gate.MUTANTS,
    *stage9.MUTANTS,
    *field.MUTANTS,
)
BY_NAME: dict[str, Mutant] = {mutant.name: mutant for mutant in MUTANTS}


def _check_records() -> None:
    if len(BY_NAME) != len(MUTANTS):
        names = [mutant.name for mutant in MUTANTS]
        raise TypeError(f"two mutants named {sorted({name for name in names if names.count(name) > 1})}")
    for mutant in MUTANTS:
        if mutant.stage not in STAGES:
            raise TypeError(f"{mutant.name}: stage {mutant.stage} is not one of {sorted(STAGES)}")
        if "\n" in mutant.description.strip():
            raise TypeError(f"{mutant.name}: the description must be one line")


_check_records()


def __getattr__(name: str) -> type:
    if name not in BY_NAME:
        raise AttributeError(f"no mutant named {name!r}; known: {', '.join(BY_NAME)}")
    return load(BY_NAME[name])
