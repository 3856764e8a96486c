"""Each rank case starts from a known state, so a test's outcome never
depends on which tests ran before it on the reused ranks (a failure can
always be reproduced by rerunning its node id alone):

* restored around every case: the environment variables (also when a stuck
  case is abandoned), and the global random generators (torch, ``random``,
  numpy), seeded from the case's seed;
* checked after every case: process-wide torch settings a case must not
  change (default dtype, grad mode, deterministic algorithms, thread count),
  and the attributes of the DCP group object the case was handed. A change
  fails *that* case, naming what leaked, and is undone.
"""

from __future__ import annotations

import os
import random
import reprlib

import torch

SETTINGS = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "torch threads": (torch.get_num_threads, torch.set_num_threads),
}
# The group's count of the case's collectives: using the group changes it
# (the gate tests read it), and each case starts it at 0.
GROUP_COUNTER = "collective_calls"
# Values a case may assign again without changing anything (world_size = 2 on W = 2).
PLAIN_VALUES = (bool, int, float, str, torch.device)
MISSING = object()


def _seed_global_generators(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def _group_attributes(group) -> dict:
    """The group's own attributes a case must leave as it found them (none without a group)."""
    return {} if group is None else {name: value for name, value in vars(group).items() if name != GROUP_COUNTER}


def _group_change(name: str, before, now) -> str | None:
    """How a case changed the group's attribute ``name`` (MISSING: not there), or None."""
    if before is MISSING:
        return f"group.{name} added"
    if now is MISSING:
        return f"group.{name} deleted"
    if before is now or (type(before) is type(now) and isinstance(now, PLAIN_VALUES) and before == now):
        return None
    # reprlib: bounded, and safe from a value whose __repr__ raises
    return f"group.{name} {reprlib.repr(before)} -> {reprlib.repr(now)}"


class CaseState:
    """Taken before a case; :meth:`leaks` after it says (and undoes) what it
    changed, :meth:`put_back` undoes it for a case that never finishes (an
    abandoned torchrun case thread). ``seed``: the global generators are
    seeded from it. ``group``: the DCP group object the case is handed.

    The group is put back in place, not rebuilt for each case: an
    implementation may keep the object it was handed (as vLLM's DCP group is
    one object per process) and the rank's implementation lives on from case
    to case, so a fresh copy would leave it with the changed one. Checking a
    handful of attributes costs nothing next to a case."""

    def __init__(self, seed: int | None = None, group=None):
        self.environ = dict(os.environ)
        self.settings = {name: get() for name, (get, _) in SETTINGS.items()}
        self.group, self.group_attributes = group, _group_attributes(group)
        if seed is not None:
            _seed_global_generators(seed)

    def _put_back_environment(self) -> list[str]:
        """Each variable the case set, unset or changed, put back."""
        now = dict(os.environ)
        if now == self.environ:
            return []
        os.environ.clear()
        os.environ.update(self.environ)
        names = sorted(name for name in now.keys() | self.environ.keys() if now.get(name) != self.environ.get(name))
        return [
            f"{name} {'set' if name not in self.environ else 'unset' if name not in now else 'changed'}"
            for name in names
        ]

    def _put_back_settings(self) -> list[str]:
        leaked = []
        for name, (get, put) in SETTINGS.items():
            now = get()
            if now != self.settings[name]:
                leaked.append(f"{name} {self.settings[name]} -> {now}")
                put(self.settings[name])
        return leaked

    def _put_back_group(self) -> list[str]:
        """Each attribute of the group the case assigned, deleted or added, put back."""
        before, now = self.group_attributes, _group_attributes(self.group)
        leaked = []
        for name in sorted(before.keys() | now.keys()):
            change = _group_change(name, before.get(name, MISSING), now.get(name, MISSING))
            if change is None:
                continue
            leaked.append(change)
            if name in before:
                vars(self.group)[name] = before[name]
            else:
                del vars(self.group)[name]
        return leaked

    def leaks(self) -> list[str]:
        """What the case changed of the checked settings and of its group,
        each undone; the environment is put back silently."""
        self._put_back_environment()
        return self._put_back_settings() + self._put_back_group()

    def put_back(self) -> list[str]:
        """Everything the case changed, environment included, each undone."""
        environment = self._put_back_environment()
        changed = [f"the environment ({', '.join(environment)})"] if environment else []
        return changed + self._put_back_settings() + self._put_back_group()
