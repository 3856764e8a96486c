"""A synthetic top-k indexer: which compressed states each query row reads.

A query at position ``p`` sees the states ``c < (p + 1) // rho``. With at most
``K`` of them the indexer takes them all, in order, ``[0, 1, .., n-1, -1, ..]``
(DSV4's short-context shortcut, and C128A's "every state" when ``K`` covers
the longest sequence); otherwise ``K`` distinct visible states in score order,
the scores a deterministic function of ``(seed, request key, position)`` so
that every rank and the DCP1 baseline get the same rows.
"""

from __future__ import annotations

import torch


def visible_states(positions: torch.Tensor, rho: int) -> torch.Tensor:
    """[T] int64: how many compressed states a query at each position sees."""
    return (positions.to(torch.int64) + 1) // rho


def indexer_topk(
    positions: torch.Tensor, request_keys: torch.Tensor, *, rho: int, top_k: int, seed: int
) -> torch.Tensor:
    """-> [T, top_k] int32 global state ids per row, -1 = none.

    ``request_keys`` [T] names each row's request stably (a uid, not a batch
    index) so the same query gets the same ids in every step layout."""
    visible = visible_states(positions, rho).tolist()
    keys = request_keys.tolist()
    rows = torch.full((len(visible), top_k), -1, dtype=torch.int64)
    for t, (n, key, p) in enumerate(zip(visible, keys, positions.tolist())):
        if n <= top_k:
            rows[t, :n] = torch.arange(n)
        else:
            scores = torch.Generator().manual_seed((seed * 1_000_003 + key * 65_537 + p) % 2**63)
            rows[t] = torch.randperm(n, generator=scores)[:top_k]
    return rows.to(torch.int32)


def uses_shortcut(positions: torch.Tensor, *, rho: int, top_k: int) -> torch.Tensor:
    """[T] bool: rows whose top-k is every visible state, in order."""
    return visible_states(positions, rho) <= top_k
