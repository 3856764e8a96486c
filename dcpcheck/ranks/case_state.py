"""Each rank case starts from a known state, so a test's outcome never
depends on which tests ran before it on the reused ranks (a failure can
always be reproduced by rerunning its node id alone):

* restored around every case: the environment variables (also when a stuck
  case is abandoned), and the global random generators (torch, ``random``,
  numpy), seeded from the case's seed;
* checked after every case: process-wide torch settings a case must not
  change (default dtype, grad mode, deterministic algorithms, thread count).
  A change fails *that* case, naming what leaked, and is undone.
"""

from __future__ import annotations

import os
import random

import torch

SETTINGS = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "torch threads": (torch.get_num_threads, torch.set_num_threads),
}


def _seed_global_generators(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


class CaseState:
    """Taken before a case; :meth:`leaks` after it says (and undoes) what it
    changed, :meth:`put_back` undoes it for a case that never finishes (an
    abandoned torchrun case thread). ``seed``: the global generators are
    seeded from it."""

    def __init__(self, seed: int | None = None):
        self.environ = dict(os.environ)
        self.settings = {name: get() for name, (get, _) in SETTINGS.items()}
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

    def leaks(self) -> list[str]:
        """What the case changed of the checked settings, each undone; the
        environment is put back silently."""
        self._put_back_environment()
        return self._put_back_settings()

    def put_back(self) -> list[str]:
        """Everything the case changed, environment included, each undone."""
        environment = self._put_back_environment()
        changed = [f"the environment ({', '.join(environment)})"] if environment else []
        return changed + self._put_back_settings()
