"""Each rank case starts from a known state, so a test's outcome never
depends on which tests ran before it on the reused ranks (a failure can
always be reproduced by rerunning its node id alone):

* restored around every case: the environment variables (also when a stuck
  case is abandoned), and the global random generators (torch, ``random``,
  numpy), seeded from the case's seed;
* checked after every case: process-wide torch settings a case must not
  change (default dtype and device, grad mode, deterministic algorithms,
  thread count), and the attributes of the DCP group object the case was
  handed. A change fails *that* case, naming what leaked, and is undone;
* checked again before every case: those, and the warnings filters, as the
  previous case on the process left them. What changed in between (a thread
  that case left running, code it left to run at idle) fails the new case,
  naming the previous one as the one that leaked it, and is undone. (The
  warnings filters are not checked at a case's end: a module a case imports
  first may add its own.)
"""

from __future__ import annotations

import os
import random
import reprlib
import warnings

import torch


def _set_default_device(device: torch.device) -> None:
    # CPU is torch's own default: put back as unset, not as a device mode on every call.
    torch.set_default_device(None if device == torch.device("cpu") else device)


SETTINGS = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (torch.get_default_device, _set_default_device),
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
        self.warnings_filters = list(warnings.filters)
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

    def _put_back_warnings_filters(self) -> list[str]:
        """The warnings filters added or removed since, put back."""
        now = list(warnings.filters)
        if now == self.warnings_filters:
            return []
        added = [_filter(entry) for entry in now if entry not in self.warnings_filters]
        removed = [_filter(entry) for entry in self.warnings_filters if entry not in now]
        warnings.filters[:] = self.warnings_filters
        warnings._filters_mutated()  # what warnings.filterwarnings calls: cached decisions are dropped
        changes = [f"added {', '.join(added)}" if added else "", f"removed {', '.join(removed)}" if removed else ""]
        return [f"warnings filters {'; '.join(filter(None, changes)) or 'reordered'}"]

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


def _filter(entry: tuple) -> str:
    """``'error' for FutureWarning``: a warnings filter (action, message, category, module, line) in words."""
    action, message, category, module, _ = entry
    matching = "".join(
        f" {what} {pattern.pattern!r}" for what, pattern in (("message", message), ("module", module)) if pattern
    )
    return f"{action!r} for {getattr(category, '__name__', category)}{matching}"


class LeftByLastCase:
    """The state the last case on this process left (its own changes undone
    at its end), for the next case to check at its start."""

    def __init__(self):
        self.nodeid: str | None = None
        self.state: CaseState | None = None

    def remember(self, nodeid: str, group) -> None:
        self.nodeid, self.state = nodeid, CaseState(group=group)

    def changed_since(self, group, *, warnings_filters: bool) -> list[str]:
        """What changed since the last case ended, each put back: its
        settings, its group's attributes (the same group object only), and
        with ``warnings_filters`` the warnings filters."""
        if self.state is None:
            return []
        leaked = self.state._put_back_settings()
        if self.state.group is group:
            leaked += self.state._put_back_group()
        if warnings_filters:
            leaked += self.state._put_back_warnings_filters()
        return leaked


LEFT_BY_LAST_CASE = LeftByLastCase()  # one per process: its ranks' cases run one after another
