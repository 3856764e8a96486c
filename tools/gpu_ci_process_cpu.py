"""Which processes the host's cores worked for while a wave of the GPU CI ran (``tools/gpu_ci_load.py``): the
CPU seconds (user + system, ``/proc/<pid>/stat``) each kind of process used, told apart by its command line.
The GPU was 24 % and 39 % busy while the cores were 79 % and 71 % busy (H100, at 3fadbde): the waves are bound
by the cores, and this says whose work fills them before any of it is cut or moved.

A process that starts and ends between two samples is not seen (its seconds are lost); one that ends after
a sample keeps what it used up to it."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

# The rank processes of the pools (forked from zygote servers, whose command line they keep), pytest processes
# (sessions, xdist workers: execnet's gateways, the self-tests' inner sessions, torchrun's ranks), torchrun's
# launchers, compilers (Triton's and nvcc's) and the rest.
KINDS = ("ranks", "pytest", "torchrun", "compilers", "other")
COMPILERS = {"ptxas", "cc1", "cc1plus", "cc", "gcc", "g++", "as", "ld", "nvcc", "cicc", "fatbinary", "clang"}
EXECNET_GATEWAY = "exec(eval(sys.stdin.readline()))"  # how execnet starts an xdist worker: python -c ...
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_kind(cmdline: list[str]) -> str:
    """One of KINDS for a process started with ``cmdline``."""
    if any("zygote_server" in arg for arg in cmdline):
        return "ranks"
    if "torch.distributed.run" in cmdline or any(Path(arg).name == "torchrun" for arg in cmdline[:2]):
        return "torchrun"
    if any(Path(arg).name == "pytest" for arg in cmdline[:3]) or any(EXECNET_GATEWAY in arg for arg in cmdline[:3]):
        return "pytest"
    if cmdline and Path(cmdline[0]).name in COMPILERS:
        return "compilers"
    return "other"


def _processes() -> dict[tuple[int, str], int]:
    """(pid, start time) -> the CPU ticks it has used, for every process readable now."""
    ticks = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 on
        ticks[(int(entry.name), fields[19])] = int(fields[11]) + int(fields[12])  # utime + stime; starttime
    return ticks


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


class ProcessCpu:
    """``sample()`` -> the CPU seconds each kind used since the last sample (the first: since construction)."""

    def __init__(self):
        self.available = Path("/proc/self/stat").exists()
        self._kinds: dict[tuple[int, str], str] = {}
        self._last = _processes() if self.available else {}

    def sample(self) -> Counter:
        used: Counter = Counter()
        if not self.available:
            return used
        now = _processes()
        for key, ticks in now.items():
            if key not in self._kinds:
                self._kinds[key] = process_kind(_cmdline(key[0]))
            used[self._kinds[key]] += (ticks - self._last.get(key, 0)) / CLOCK_TICKS
        self._last = now
        return used
