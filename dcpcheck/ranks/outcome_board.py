"""How torchrun's in-process ranks tell each other what one case did: each
rank posts a :class:`RankReport` under the case's key in the launcher's
store, and rank 0 posts the *verdict* (every report it saw), which every rank
then takes as the case's result, so that all ranks record the same outcome.

A store, not a collective: a rank that never reports (gone, stopped, spinning
with the GIL held) only leaves its key empty, and a late report belongs to
its own case key, never to the next test's.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from dcpcheck.ranks.rankfn import RankOutcome

POLL_S = 0.1
# How much longer than rank 0 the other ranks wait for its verdict before
# they take what they saw themselves (rank 0 itself may be the silent one).
VERDICT_GRACE_S = 5.0
NO_DECISION = object()  # rank 0 posted no decision in time


@dataclass
class RankReport:
    """One rank's account of one case: its outcome, or its stack when its
    case thread was still running, or how it left the case."""

    rank: int
    outcome: RankOutcome | None = None
    stack: str | None = None
    timed_out: bool = False  # stuck at the case timeout (not after a peer failed)
    left: str | None = None

    @property
    def failed(self) -> bool:
        return self.outcome is None or not self.outcome.ok


def _dumps(report: RankReport) -> bytes:
    try:
        return pickle.dumps(report)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means "drop the return value"
        report.outcome.value = f"<unpicklable return value: {type(exc).__name__}: {exc}>"
        return pickle.dumps(report)


class OutcomeBoard:
    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store = dist.PrefixStore("dcpcheck/", store)
        self.rank = rank
        self.world_size = world_size
        self.seen: dict[str, dict[int, RankReport]] = {}

    def announce(self) -> None:
        """Where this rank's process is, for peers to say what it is doing when it goes silent."""
        self.store.set(f"process/{self.rank}", f"{socket.gethostname()} {os.getpid()}")

    def process_state(self, rank: int, describe) -> str:
        key = f"process/{rank}"
        if not self.store.check([key]):
            return "never announced itself"
        host, pid = self.store.get(key).decode().split()
        if host != socket.gethostname():
            return f"runs on host {host} (pid {pid})"
        return describe(int(pid))

    def decision(self, key: str, decide, *, deadline: float):
        """Rank 0's ``decide()``, posted under ``key``; every other rank takes
        it from the store (``decide`` is not called there). -> the value, or
        ``NO_DECISION`` when none was posted by ``deadline``."""
        name = f"{key}/decision"
        if self.rank == 0:
            value = decide()
            self.store.set(name, pickle.dumps(value))
            return value
        while not self.store.check([name]):
            if time.perf_counter() > deadline:
                return NO_DECISION
            time.sleep(POLL_S)
        return pickle.loads(self.store.get(name))

    def post(self, key: str, report: RankReport) -> None:
        self.store.set(f"{key}/report/{self.rank}", _dumps(report))

    def read(self, key: str) -> dict[int, RankReport]:
        """The reports posted so far for ``key``."""
        seen = self.seen.setdefault(key, {})
        for rank in range(self.world_size):
            name = f"{key}/report/{rank}"
            if rank not in seen and self.store.check([name]):
                seen[rank] = pickle.loads(self.store.get(name))
        return dict(seen)

    def any_failure(self, key: str) -> bool:
        return any(report.failed for report in self.read(key).values())

    def verdict(self, key: str, *, deadline: float) -> dict[int, RankReport]:
        """Every rank's report, as rank 0 saw them by ``deadline``."""
        name = f"{key}/verdict"
        if self.rank == 0:
            reports = self.read(key)
            while len(reports) < self.world_size and time.perf_counter() < deadline:
                time.sleep(POLL_S)
                reports = self.read(key)
            self.store.set(name, pickle.dumps(reports))
            return reports
        while not self.store.check([name]):
            if time.perf_counter() > deadline + VERDICT_GRACE_S:
                return self.read(key)
            time.sleep(POLL_S)
        return pickle.loads(self.store.get(name))
