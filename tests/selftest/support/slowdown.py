"""How slow the machine was over an interval, as a busy process saw it.

A bound on how long a session takes to end holds on a quiet machine; the
README's own test command runs it beside another xdist worker's pools (two
W = 8 cases are sixteen busy ranks on CI's two cores), where a process gets a
fraction of a core and the same work takes several times as long. A bound
scaled by the slowdown a busy canary measured over the same interval stays as
tight as written on a quiet machine and stops failing on a loaded one."""

from __future__ import annotations

import subprocess
import sys

# Spins until its stdin closes, then prints the CPU seconds it got and the wall seconds it ran.
_CANARY = """
import select, sys, time
wall, cpu = time.monotonic(), time.process_time()
while not select.select([sys.stdin], [], [], 0)[0]:
    sum(range(10_000))
print(time.process_time() - cpu, time.monotonic() - wall)
"""


class Slowdown:
    """``with Slowdown() as slow: ...``; then ``slow.factor``: wall seconds
    per CPU second a busy process got meanwhile (1 on a quiet machine)."""

    factor: float

    def __enter__(self) -> Slowdown:
        self._canary = subprocess.Popen(
            [sys.executable, "-c", _CANARY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        return self

    def __exit__(self, *exc_info) -> None:
        output, _ = self._canary.communicate(timeout=60)  # closing stdin ends it
        cpu, wall = map(float, output.split())
        self.factor = max(1.0, wall / max(cpu, 1e-3))

    def bound(self, seconds: float) -> float:
        """``seconds`` on a quiet machine, stretched by the slowdown."""
        return seconds * self.factor
