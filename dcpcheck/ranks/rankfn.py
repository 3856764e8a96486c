"""Running one case of a rank function on one rank: the protocol shared by
the spawned pool and the in-process torchrun mode.

A rank function is a module-level function ``fn(ctx, **case)``; it raises on
failure and may return a small picklable value (stats for the summary).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpcheck.ranks.group import DcpGroup


@dataclass
class RankContext:
    """What a rank function gets: its group, its device and the implementation."""

    group: DcpGroup
    device: torch.device
    impl: Any
    seed: int
    case: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.group.rank_in_group

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded identically on every rank (build global
        inputs with it, then move them to ``ctx.device``)."""
        return torch.Generator().manual_seed(self.seed + offset)


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    error: str = ""  # "ExcType: message" + traceback, for a failed rank
    value: Any = None
    seconds: float = 0.0


def format_rank_error(rank: int, exc: BaseException) -> str:
    """``[rank r]`` first, then the exception, then where it came from."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    head = f"[rank {rank}] {type(exc).__name__}: {exc}"
    return head + "\n" + "".join(f"[rank {rank}] {line}" for chunk in frames for line in chunk.splitlines(True))


def run_rank_case(fn, ctx: RankContext) -> RankOutcome:
    start = time.perf_counter()
    try:
        value = fn(ctx, **ctx.case)
    except BaseException as exc:  # every failure is reported, with its rank; interrupts go on
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return RankOutcome(ctx.rank, False, format_rank_error(ctx.rank, exc), None, time.perf_counter() - start)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return RankOutcome(ctx.rank, True, "", value, time.perf_counter() - start)
