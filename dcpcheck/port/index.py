"""Stage 1 of the port: which compressed states a DCP rank reads and writes.

Read side (:func:`filter_index`): a Triton kernel turns the global top-k
state ids of every token into this rank's physical slots, compacted to a
prefix. Write side (:func:`slot_mapping`): a Triton kernel gives the slot
where this rank stores the state a position completes. Both locate a state
with one function, :func:`_locate_state`, written independently of the
suite's oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ownership import owner_and_local
from .triton_env import POSITIONS_PER_PROGRAM, TOKENS_PER_PROGRAM, TOPK_TILE, block_for


@triton.jit
def _locate_state(state, candidate, table_row, rank, world_size, interleave, bs, max_blocks):
    """Where rank ``rank`` keeps compressed ``state``, for reads and writes alike:
    ``(mine, slot)``; ``mine`` = a candidate this rank owns whose page lies
    inside the block table row (``table_row`` points at it)."""
    owner, local = owner_and_local(state, world_size, interleave)
    owned = candidate & (state >= 0) & (owner == rank)
    page = local // bs
    mine = owned & (page < max_blocks)
    physical_page = tl.load(table_row + page, mask=mine, other=0).to(tl.int64)
    return mine, physical_page * bs + local % bs


@triton.jit
def _filter_index_kernel(
    topk_ptr,
    token_to_req_ptr,
    block_table_ptr,
    is_valid_ptr,
    slots_ptr,
    counts_ptr,
    num_tokens,
    top_k,
    max_blocks,
    topk_row_stride,
    block_table_row_stride,
    slots_row_stride,
    bs,
    world_size,
    rank,
    interleave,
    TOKENS: tl.constexpr,
    TILE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS).to(tl.int64)
    row_in = rows < num_tokens
    is_valid = tl.load(is_valid_ptr + rows, mask=row_in, other=0) != 0
    req = tl.load(token_to_req_ptr + rows, mask=row_in, other=0).to(tl.int64)
    topk_rows = topk_ptr + rows[:, None] * topk_row_stride
    slot_rows = slots_ptr + rows[:, None] * slots_row_stride
    table_rows = block_table_ptr + req[:, None] * block_table_row_stride

    # Owned entries of each tile are appended after the ones already kept.
    # A while loop over the runtime top_k, not range(): see triton_env.py.
    count = tl.zeros([TOKENS], dtype=tl.int32)
    k0 = 0
    while k0 < top_k:
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        candidate = in_bounds & is_valid[:, None]
        mine, slot = _locate_state(ids, candidate, table_rows, rank, world_size, interleave, bs, max_blocks)
        keep = mine.to(tl.int32)
        dest = count[:, None] + tl.cumsum(keep, axis=1) - keep
        tl.store(slot_rows + dest.to(tl.int64), slot.to(tl.int32), mask=mine)
        count += tl.sum(keep, axis=1)
        k0 += TILE
    tl.store(counts_ptr + rows, count, mask=row_in)


@triton.jit
def _slot_mapping_kernel(
    positions_ptr,
    token_to_req_ptr,
    block_table_ptr,
    slots_ptr,
    num_tokens,
    max_blocks,
    block_table_row_stride,
    rho,
    bs,
    world_size,
    rank,
    interleave,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_bounds = offsets < num_tokens
    position = tl.load(positions_ptr + offsets, mask=in_bounds, other=-1).to(tl.int64)
    req = tl.load(token_to_req_ptr + offsets, mask=in_bounds, other=0).to(tl.int64)
    completes = in_bounds & (position >= 0) & ((position + 1) % rho == 0)
    table_rows = block_table_ptr + req * block_table_row_stride
    mine, slot = _locate_state(position // rho, completes, table_rows, rank, world_size, interleave, bs, max_blocks)
    tl.store(slots_ptr + offsets, tl.where(mine, slot, -1), mask=in_bounds)


def filter_index(
    topk: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    is_valid_token: torch.Tensor,
    *,
    bs: int,
    world_size: int,
    rank: int,
    interleave: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slots of each token's top-k, compacted: ``(slots [T, K] int32,
    counts [T] int32)``; ``-1`` after the prefix, count 0 for invalid tokens,
    ids whose local page is outside the block table row dropped."""
    # The kernel walks rows by their stride and columns contiguously.
    topk, token_to_req, block_table = topk.contiguous(), token_to_req.contiguous(), block_table.contiguous()
    num_tokens, top_k = topk.shape
    # -1 everywhere first: the kernel writes only the kept prefix.
    slots = torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=topk.device)
    counts = torch.empty((num_tokens,), dtype=torch.int32, device=topk.device)
    if num_tokens == 0:
        return slots, counts
    if top_k == 0:
        return slots, counts.zero_()
    tokens = block_for(num_tokens, TOKENS_PER_PROGRAM)
    _filter_index_kernel[(triton.cdiv(num_tokens, tokens),)](
        topk,
        token_to_req,
        block_table,
        is_valid_token.to(torch.int8),
        slots,
        counts,
        num_tokens,
        top_k,
        block_table.shape[1],
        topk.stride(0),
        block_table.stride(0),
        slots.stride(0),
        bs,
        world_size,
        rank,
        interleave,
        TOKENS=tokens,
        TILE=block_for(top_k, TOPK_TILE),
    )
    return slots, counts


def slot_mapping(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    *,
    rho: int,
    bs: int,
    world_size: int,
    rank: int,
    interleave: int,
) -> torch.Tensor:
    """[T] int64: the slot this rank writes the state completed at each
    position into, or ``-1`` (no state completes there, another rank owns it,
    or its page is outside the block table row)."""
    if rho < 1:
        raise ValueError(f"rho={rho}: only compressed layers (rho >= 1) have a compressed cache")
    positions, token_to_req, block_table = positions.contiguous(), token_to_req.contiguous(), block_table.contiguous()
    slots = torch.empty(positions.shape, dtype=torch.int64, device=positions.device)
    if positions.numel() == 0:
        return slots
    if block_table.shape[1] == 0:
        return slots.fill_(-1)
    block = block_for(positions.numel(), POSITIONS_PER_PROGRAM)
    _slot_mapping_kernel[(triton.cdiv(positions.numel(), block),)](
        positions,
        token_to_req,
        block_table,
        slots,
        positions.numel(),
        block_table.shape[1],
        block_table.stride(0),
        rho,
        bs,
        world_size,
        rank,
        interleave,
        BLOCK=block,
    )
    return slots
