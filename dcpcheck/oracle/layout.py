"""The DCP KV-cache layout, written once and plainly: the reference formulas.

DESIGN.md section 1 (Ownership). Compressed state ``c`` lives on rank
``owner(c) = (c // S) % W`` at index ``local(c) = (c // (S*W)) * S + c % S``
among that rank's states of the request; rank ``r`` keeps its states in pages
of ``bs`` states listed by its block table.

Every function takes int64 tensors (any shape, broadcasting) or python ints
and computes in int64. The embedded port must not import this module: it is
the independent reference the port is checked against.
"""

from __future__ import annotations

import torch

IntLike = int | torch.Tensor


def _as_int64(x: IntLike) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64)


def owner_of_state(c: IntLike, S: int, W: int) -> torch.Tensor:
    """The rank that holds compressed state ``c``."""
    return (_as_int64(c) // S) % W


def local_index(c: IntLike, S: int, W: int) -> torch.Tensor:
    """Index of state ``c`` among its owner's states of the same request."""
    c = _as_int64(c)
    return (c // (S * W)) * S + c % S


def global_state(local: IntLike, r: int, S: int, W: int) -> torch.Tensor:
    """Inverse of :func:`local_index` on rank ``r``: the global state id."""
    local = _as_int64(local)
    return (local // S) * (S * W) + r * S + local % S


def local_kv_len(L_states: IntLike, r: int | torch.Tensor, S: int, W: int) -> torch.Tensor:
    """How many of the states ``c < L_states`` rank ``r`` owns."""
    L_states = _as_int64(L_states)
    r = _as_int64(r)
    full_cycles = L_states // (S * W)
    in_last_cycle = (L_states % (S * W) - r * S).clamp(0, S)
    return full_cycles * S + in_last_cycle


def pages_needed(L_states: IntLike, r: int | torch.Tensor, bs: int, S: int, W: int) -> torch.Tensor:
    """Block-table columns rank ``r`` needs for a request of ``L_states`` states."""
    return (local_kv_len(L_states, r, S, W) + bs - 1) // bs


def _table_and_req(block_table: torch.Tensor, x: torch.Tensor, req: IntLike | None):
    """A 2-D int64 table and a per-element row index broadcast with ``x``."""
    table = block_table.to(torch.int64)
    if req is None:
        if table.dim() != 1:
            raise ValueError("a block table with several rows needs req")
        return table.unsqueeze(0), *torch.broadcast_tensors(torch.zeros_like(x), x)
    return table, *torch.broadcast_tensors(_as_int64(req), x)


def slot_of_state(
    block_table: torch.Tensor,
    c: IntLike,
    bs: int,
    S: int,
    W: int,
    req: IntLike | None = None,
) -> torch.Tensor:
    """Physical slot of state ``c`` in its owner's cache, given the owner's block table.

    ``block_table`` is one row ``[max_blocks]`` (then ``req`` is None) or a
    table ``[R, max_blocks]`` with ``req`` (broadcastable to ``c``) naming the
    row of each state. ``-1`` where ``c < 0`` or its page index is outside the row.
    """
    table, req, c = _table_and_req(block_table, _as_int64(c), req)
    max_blocks = table.shape[1]
    if max_blocks == 0:
        return torch.full_like(c, -1)
    local = local_index(c, S, W)
    page = local // bs
    in_row = (c >= 0) & (page < max_blocks)
    physical_page = table[req, torch.where(in_row, page, 0)]
    slot = physical_page * bs + local % bs
    return torch.where(in_row, slot, torch.full_like(slot, -1))


def state_of_slot(
    block_table: torch.Tensor,
    slot: IntLike,
    bs: int,
    S: int,
    W: int,
    r: int,
    req: IntLike | None = None,
) -> torch.Tensor:
    """Inverse of :func:`slot_of_state` on rank ``r`` (same table/``req`` rules):
    the global state id stored at ``slot``, or ``-1`` when ``slot < 0`` or its
    page is not in the request's row."""
    table, req, slot = _table_and_req(block_table, _as_int64(slot), req)
    if table.shape[1] == 0:
        return torch.full_like(slot, -1)
    physical_page = torch.where(slot >= 0, slot // bs, -1)
    logical_page, found = _column_of_page(table, req, physical_page)
    found &= slot >= 0
    state = global_state(logical_page * bs + slot % bs, r, S, W)
    return torch.where(found, state, torch.full_like(state, -1))


def _column_of_page(table: torch.Tensor, req: torch.Tensor, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first column of row ``req`` of ``table`` holding ``page``, and whether one does: a sorted search
    of (row, page) keys, not a ``[..., max_blocks]`` comparison (vLLM's rows at a served ``max_model_len``
    are thousands of pages wide: that comparison was gigabytes)."""
    rows, max_blocks = table.shape
    low, high = int(table.min()), int(table.max())
    span = high - low + 1
    keys = (torch.arange(rows).unsqueeze(1) * span + (table - low)).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)  # stable: the first of equal pages in a row comes first
    in_range = (page >= low) & (page <= high) & (req >= 0) & (req < rows)
    query = torch.where(in_range, req * span + (page - low), 0)
    at = torch.searchsorted(sorted_keys, query).clamp(max=keys.numel() - 1)
    return order[at] % max_blocks, in_range & (sorted_keys[at] == query)


def write_slot_mapping(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    *,
    rho: int,
    bs: int,
    S: int,
    W: int,
    r: int,
) -> torch.Tensor:
    """Write side, [T] int64: position ``p`` completes state ``c = p // rho``
    when ``(p + 1) % rho == 0``; rank ``r`` writes it to ``slot_of_state`` only
    when it owns ``c`` (and the page is in its row), else ``-1``."""
    if rho < 1:
        raise ValueError(f"rho={rho}: only compressed layers (rho >= 1) have a compressed cache")
    p = _as_int64(positions)
    c = p // rho
    writes = (p >= 0) & ((p + 1) % rho == 0) & (owner_of_state(c, S, W) == r)
    return slot_of_state(block_table, torch.where(writes, c, -1), bs, S, W, req=token_to_req)


def filter_index_reference(
    topk: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    is_valid_token: torch.Tensor,
    *,
    bs: int,
    S: int,
    W: int,
    r: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read side as sets, not compacted: ``(owned [T, K] bool, slots [T, K] int64)``.

    ``owned[t, k]``: rank ``r`` reads ``topk[t, k]`` (valid token, id >= 0,
    owned by ``r``, page inside the row); ``slots`` holds its slot there and
    ``-1`` elsewhere. At ``W = 1`` with the DCP1 block table this is the DCP1
    baseline.
    """
    ids = topk.to(torch.int64)
    req = token_to_req.to(torch.int64).unsqueeze(1).expand_as(ids)
    mine = is_valid_token.unsqueeze(1) & (ids >= 0) & (owner_of_state(ids, S, W) == r)
    slots = slot_of_state(block_table, torch.where(mine, ids, -1), bs, S, W, req=req)
    owned = mine & (slots >= 0)
    return owned, torch.where(owned, slots, torch.full_like(slots, -1))
