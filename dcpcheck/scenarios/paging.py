"""Block tables that live across a trace, as a serving engine keeps them.

One :class:`PagedTables` is one rank's page allocator for one KV layout:
requests take pages from a shuffled free list as their compressed states grow
and give them back when they finish, so later requests reuse pages that held
other requests' states. Page 0 is never handed out: unused block-table
columns point at it, and a cache keeps it poisoned.
"""

from __future__ import annotations

import torch

from dcpcheck.oracle.layout import pages_needed
from dcpcheck.scenarios.batch import KvLayout

NULL_PAGE = 0


class PagedTables:
    def __init__(self, layout: KvLayout, rank: int, *, num_pages: int, seed: int):
        self.layout = layout
        self.rank = rank
        self.num_pages = num_pages
        order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.free = order.tolist()  # taken from the end, returned to the end: freed pages come back first
        self.pages: dict[int, list[int]] = {}

    def grow(self, uid: int, seq_len: int) -> None:
        """Give ``uid`` the pages its ``seq_len // rho`` states need on this rank."""
        layout = self.layout
        states = seq_len // layout.rho
        needed = int(pages_needed(states, self.rank, layout.bs, layout.interleave, layout.world_size))
        owned = self.pages.setdefault(uid, [])
        while len(owned) < needed:
            if not self.free:
                raise RuntimeError(f"rank {self.rank}: all {self.num_pages} pages in use; raise num_pages")
            owned.append(self.free.pop())

    def release(self, uid: int) -> None:
        self.free.extend(reversed(self.pages.pop(uid, [])))

    def table(self, uids: tuple[int, ...]) -> torch.Tensor:
        """[R, width] int32 rows of ``uids``: their pages, then NULL_PAGE; one
        spare column past the longest row."""
        width = max((len(self.pages.get(uid, ())) for uid in uids), default=0) + 1
        table = torch.full((len(uids), width), NULL_PAGE, dtype=torch.int32)
        for row, uid in enumerate(uids):
            owned = self.pages.get(uid, [])
            table[row, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        return table
