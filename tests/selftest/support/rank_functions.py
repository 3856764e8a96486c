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


def group_collectives_match_torch(ctx) -> None:
    """DcpGroup's all_gather / reduce_scatter against per-rank arithmetic."""
    W, r = ctx.world_size, ctx.rank
    mine = torch.arange(24, dtype=torch.float32, device=ctx.device).reshape(2, 3, 4) + 100 * r
    for dim in (0, 1, 2, -1):
        gathered = ctx.group.all_gather(mine, dim=dim)
        expected = torch.cat([mine - 100 * r + 100 * k for k in range(W)], dim=dim)
        assert torch.equal(gathered, expected), f"all_gather over dim {dim} is not the rank-ordered concat"
    full = torch.arange(2 * 4 * W, dtype=torch.float32, device=ctx.device).reshape(2, 4 * W) + r
    scattered = ctx.group.reduce_scatter(full, dim=1)
    expected = (full - r) * W + sum(range(W))
    assert torch.equal(scattered, expected[:, 4 * r : 4 * (r + 1)]), "reduce_scatter kept the wrong slice"
