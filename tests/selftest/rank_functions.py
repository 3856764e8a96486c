"""Rank functions that misbehave on purpose, for the harness self-tests."""

from __future__ import annotations

import os
import signal

import torch


def sum_of_ranks(ctx) -> float:
    total = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    ctx.group.all_reduce(total)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    assert total.item() == expected, f"all_reduce gave {total.item()}, expected {expected}"
    return total.item()


def raise_on_rank(ctx, *, bad_rank: int, before_collective: bool) -> None:
    if before_collective and ctx.rank == bad_rank:
        raise ValueError(f"planted failure on rank {bad_rank}")
    sum_of_ranks(ctx)
    if ctx.rank == bad_rank:
        raise ValueError(f"planted failure on rank {bad_rank}")


def skip_collective_on_rank(ctx, *, bad_rank: int) -> None:
    if ctx.rank != bad_rank:
        sum_of_ranks(ctx)


def kill_rank(ctx, *, bad_rank: int) -> None:
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    sum_of_ranks(ctx)
