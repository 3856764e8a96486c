"""A host-wide ledger of the GPU memory that running cases said they need.

Several pytest processes share one GPU (the xdist workers of a session, and
the sessions ``tools/gpu_ci.py`` runs side by side). Each checks that its GPU
has the case's ``gpu_memory`` free before it starts (``SpawnedRanks``), but
two workers that look at once both see it free and then both allocate it: on
one H100 two realistic stage-9 cases ran out of memory mid-case that way. So
a marked case *holds* its GiB here for as long as it runs, and a case whose
GiB do not fit beside what others hold waits for them, first come first
served, up to its wait limit; past that it runs anyway (the ledger counts
what cases declared, not what they use) and says how long it waited. It
also waits, up to FREE_WAIT_S, until the GPU has its GiB free (NVML's count:
idle pools' CUDA contexts and unmarked cases of other sessions hold memory
no one declared), which the others' idle pools ending makes true.

One JSON file per GPU (NVML's UUID names it) in the temporary directory,
locked with ``flock`` for each read-modify-write, holds the entries
(``held`` and ``waiting``: pid, GiB, case). An entry whose process is gone is
dropped, so a killed worker never blocks the GPU. Unmarked cases hold
nothing. A worker also ends its idle pools when someone waits
(:meth:`GpuLedger.someone_waits`): their CUDA contexts are memory too. And
while another process's case holds (or, first in line, waits for) nearly
all of the GPU, a worker starts no new ranks
(:meth:`GpuLedger.wait_out_large_holds`): each start is a CUDA context of
its own, which the large case's free-memory wait cannot see coming (on one
H100 a W = 8 case of 64 GiB, admitted with them free, ran out of memory as
the other sessions' workers started pools beside it).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dcpcheck.ranks.gpu_free import gpu_memory, gpu_uuid
from dcpcheck.ranks.procstate import pid_alive

LEDGER_DIR_ENV = "DCPCHECK_GPU_LEDGER_DIR"  # where the ledgers live (default: the temporary directory)
# What share of a GPU the declared needs may add up to: the rest is for what no case declares
# (CUDA contexts of idle pools, unmarked cases, other programs). plugin/markers.py skips a case above it.
GPU_MEMORY_USABLE = 0.85
# What each rank's CUDA context takes besides its declared need (0.8 GiB measured on an H200).
CUDA_CONTEXT_GIB = 1.0
POLL_S = 0.2
# How long a case that fits the ledger waits for the GPU's free memory to reach its need: the other processes end
# their idle pools before their next case (seconds apart); memory that does not come free by then is not theirs.
FREE_WAIT_S = 60.0
# A hold above this share of the capacity has the GPU, in effect, to itself while it runs: no process starts ranks.
# Nearly all of it: production's W = 8 (64 of an H100's 67 GiB); the realistic stage-9 W = 8 (56 GiB declared,
# 42 used) has run beside other processes' starts on one H100 and one H200.
LARGE_HOLD_SHARE = 0.9
GIB = 2**30


@dataclass(frozen=True)
class Entry:
    pid: int
    token: str
    gib: float
    case: str


class GpuLedger:
    """The ledger of one GPU: ``capacity_gib`` is what the declared needs may add up to."""

    def __init__(self, path: Path, capacity_gib: float, free_gib: Callable[[], float | None] = lambda: None):
        self.path = path
        self.capacity_gib = capacity_gib
        self.free_gib = free_gib  # the GPU's free GiB now (None: unknown)

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        """The ledger's entries (dead processes' dropped), written back when the block ends if they changed."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.read(fd, 1 << 20)
            try:
                state = json.loads(raw) if raw else {}
            except ValueError:
                state = {}  # a torn file (a writer killed mid-write): its entries' processes re-register
            entries = {
                kind: [Entry(**e) for e in state.get(kind, []) if pid_alive(e["pid"])] for kind in ("held", "waiting")
            }
            yield entries
            data = json.dumps({kind: [e.__dict__ for e in items] for kind, items in entries.items()}).encode()
            if data != raw:  # asked before every case on CUDA: a look that changed nothing writes nothing
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, data)
        finally:
            os.close(fd)  # releases the lock

    @contextmanager
    def hold(self, gib: float, case: str, wait_limit: float, free_needed: float | None = None) -> Iterator[float]:
        """Hold ``gib`` for the block, after waiting (at most ``wait_limit`` s) until it fits beside what others
        hold, every earlier waiter went first and the GPU has ``free_needed`` GiB free (default ``gib``; at most
        FREE_WAIT_S for that): -> the seconds waited."""
        free_needed = gib if free_needed is None else free_needed
        me = Entry(os.getpid(), uuid.uuid4().hex, gib, case)
        started = time.monotonic()
        with self._locked() as entries:
            entries["waiting"].append(me)
        try:
            while True:
                with self._locked() as entries:
                    waiting = [e for e in entries["waiting"] if e.token != me.token]
                    first = entries["waiting"] and entries["waiting"][0].token == me.token
                    held = sum(e.gib for e in entries["held"])
                    fits = not entries["held"] or held + gib <= self.capacity_gib
                    waited = time.monotonic() - started
                    free = self.free_gib() if fits and first else None
                    free_enough = free is None or free >= free_needed or waited >= FREE_WAIT_S
                    if (first and fits and free_enough) or waited >= wait_limit:
                        entries["waiting"] = waiting
                        entries["held"].append(me)
                        break
                time.sleep(POLL_S)
            yield time.monotonic() - started
        finally:
            with self._locked() as entries:
                for kind in entries:
                    entries[kind] = [e for e in entries[kind] if e.token != me.token]

    def wait_out_large_holds(self, limit: float) -> float:
        """Before this process starts ranks: wait (at most ``limit`` s) while another process's case holds more
        than LARGE_HOLD_SHARE of the capacity, or waits first in line for it (unless this process holds an
        entry: that case may be what it waits for) -> the seconds waited."""
        mine, started = os.getpid(), time.monotonic()

        def large(entry: Entry) -> bool:
            return entry.pid != mine and entry.gib > LARGE_HOLD_SHARE * self.capacity_gib

        while time.monotonic() - started < limit:
            with self._locked() as entries:
                holds_some = any(e.pid == mine for e in entries["held"])
                others = entries["held"] + ([] if holds_some else entries["waiting"][:1])
            if not any(large(entry) for entry in others):
                break
            time.sleep(POLL_S)
        return time.monotonic() - started

    def someone_waits(self) -> bool:
        """Whether a case waits for memory on this GPU."""
        with self._locked() as entries:
            return bool(entries["waiting"])


def host_ledger(cuda_index: int) -> GpuLedger | None:
    """The ledger of CUDA device ``cuda_index`` on this host; None where NVML cannot name it."""
    key, memory = gpu_uuid(cuda_index), gpu_memory(cuda_index)
    if key is None or memory is None:
        return None
    directory = Path(os.environ.get(LEDGER_DIR_ENV) or tempfile.gettempdir())

    def free_gib() -> float | None:
        now = gpu_memory(cuda_index)
        return None if now is None else now.free_bytes / GIB

    capacity = GPU_MEMORY_USABLE * memory.total_bytes / GIB
    return GpuLedger(directory / f"dcpcheck-gpu-ledger-{key}.json", capacity, free_gib)
