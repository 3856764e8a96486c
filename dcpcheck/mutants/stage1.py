"""Stage-1 mutants: index filtering (read side) and slot mapping (write side).

Each buggy copy below is the port's function of the same name in
:mod:`dcpcheck.port.index` with one line changed (marked ``# BUG``).
``_locate_state`` is shared by the read and the write side, so its bugs
reach both capabilities, as they would in the port.
"""

from __future__ import annotations

from dcpcheck.port import triton_env  # noqa: F401  (first: sets TRITON_INTERPRET before triton loads)

import triton
import triton.language as tl

from dcpcheck.mutants.base import Mutant, Swap
from dcpcheck.port import index
from dcpcheck.port.index import _locate_state
from dcpcheck.stages import STAGE_INDEX


class IndexMutant(Mutant):
    stage = STAGE_INDEX
    home = "tests/stage1_index"


@triton.jit
def _locate_state_owner_mod_w(state, candidate, table_row, rank, world_size, interleave, bs, max_blocks):
    owned = candidate & (state >= 0) & (state % world_size == rank)  # BUG: S ignored
    local = (state // (interleave * world_size)) * interleave + state % interleave
    page = local // bs
    mine = owned & (page < max_blocks)
    physical_page = tl.load(table_row + page, mask=mine, other=0).to(tl.int64)
    return mine, physical_page * bs + local % bs


class OwnerModW(IndexMutant):
    description = "owner(c) computed as c % W instead of (c // S) % W, on the read and the write side"
    bug = Swap(index, _locate_state=_locate_state_owner_mod_w)


@triton.jit
def _locate_state_local_no_interleave(state, candidate, table_row, rank, world_size, interleave, bs, max_blocks):
    owned = candidate & (state >= 0) & ((state // interleave) % world_size == rank)
    local = state // world_size  # BUG: the S = 1 formula
    page = local // bs
    mine = owned & (page < max_blocks)
    physical_page = tl.load(table_row + page, mask=mine, other=0).to(tl.int64)
    return mine, physical_page * bs + local % bs


class LocalIndexNoInterleave(IndexMutant):
    description = "local(c) computed as c // W, without the interleave: (c // (S*W)) * S + c % S"
    bug = Swap(index, _locate_state=_locate_state_local_no_interleave)


@triton.jit
def _locate_state_counts_minus_one(state, candidate, table_row, rank, world_size, interleave, bs, max_blocks):
    owned = candidate & ((state // interleave) % world_size == rank)  # BUG: no state >= 0 guard
    local = (state // (interleave * world_size)) * interleave + state % interleave
    page = local // bs
    mine = owned & (page < max_blocks)
    physical_page = tl.load(table_row + page, mask=mine, other=0).to(tl.int64)
    return mine, physical_page * bs + local % bs


class CountIncludesMinusOne(IndexMutant):
    description = "a -1 top-k entry is not excluded: with S > 1 rank 0 'owns' it, counts it and reads a bogus slot"
    bug = Swap(index, _locate_state=_locate_state_counts_minus_one)


@triton.jit
def _locate_state_no_page_bound(state, candidate, table_row, rank, world_size, interleave, bs, max_blocks):
    owned = candidate & (state >= 0) & ((state // interleave) % world_size == rank)
    local = (state // (interleave * world_size)) * interleave + state % interleave
    page = local // bs
    mine = owned  # BUG: a page past the end of the block-table row is read, not dropped
    physical_page = tl.load(table_row + page, mask=mine, other=0).to(tl.int64)
    return mine, physical_page * bs + local % bs


class OutOfRangePageRead(IndexMutant):
    description = "a state whose page lies past the end of the block-table row is read (next row's page), not dropped"
    bug = Swap(index, _locate_state=_locate_state_no_page_bound)


@triton.jit
def _filter_index_kernel_tile_local_prefix(
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

    count = tl.zeros([TOKENS], dtype=tl.int32)
    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        candidate = in_bounds & is_valid[:, None]
        mine, slot = _locate_state(ids, candidate, table_rows, rank, world_size, interleave, bs, max_blocks)
        keep = mine.to(tl.int32)
        dest = k0 + tl.cumsum(keep, axis=1) - keep  # BUG: compacts within the tile, leaving gaps
        tl.store(slot_rows + dest.to(tl.int64), slot.to(tl.int32), mask=mine)
        count += tl.sum(keep, axis=1)

    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        tail = row_in[:, None] & (cols < top_k)[None, :] & (cols[None, :] >= count[:, None])
        tl.store(slot_rows + cols[None, :], tl.full([TOKENS, TILE], -1, tl.int32), mask=tail)
    tl.store(counts_ptr + rows, count, mask=row_in)


class PrefixGapsAcrossTiles(IndexMutant):
    description = "each top-k tile compacts into its own columns: with K > tile the prefix has gaps and loses ids"
    bug = Swap(index, _filter_index_kernel=_filter_index_kernel_tile_local_prefix)


@triton.jit
def _filter_index_kernel_counts_valid_ids(
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

    count = tl.zeros([TOKENS], dtype=tl.int32)
    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        candidate = in_bounds & is_valid[:, None]
        mine, slot = _locate_state(ids, candidate, table_rows, rank, world_size, interleave, bs, max_blocks)
        keep = mine.to(tl.int32)
        dest = count[:, None] + tl.cumsum(keep, axis=1) - keep
        tl.store(slot_rows + dest.to(tl.int64), slot.to(tl.int32), mask=mine)
        count += tl.sum((candidate & (ids >= 0)).to(tl.int32), axis=1)  # BUG: every valid id, owned or not

    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        tail = row_in[:, None] & (cols < top_k)[None, :] & (cols[None, :] >= count[:, None])
        tl.store(slot_rows + cols[None, :], tl.full([TOKENS, TILE], -1, tl.int32), mask=tail)
    tl.store(counts_ptr + rows, count, mask=row_in)


class CountAllValidIds(IndexMutant):
    description = "count = every valid id of the row (the stage-9 remap's count), not the ids this rank owns"
    bug = Swap(index, _filter_index_kernel=_filter_index_kernel_counts_valid_ids)


@triton.jit
def _filter_index_kernel_padding_filtered(
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
    is_valid = tl.load(is_valid_ptr + rows, mask=row_in, other=0) != 0  # noqa: F841  (unused: the bug)
    req = tl.load(token_to_req_ptr + rows, mask=row_in, other=0).to(tl.int64)
    topk_rows = topk_ptr + rows[:, None] * topk_row_stride
    slot_rows = slots_ptr + rows[:, None] * slots_row_stride
    table_rows = block_table_ptr + req[:, None] * block_table_row_stride

    count = tl.zeros([TOKENS], dtype=tl.int32)
    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        candidate = in_bounds  # BUG: CUDA-graph padding rows are filtered like real ones
        mine, slot = _locate_state(ids, candidate, table_rows, rank, world_size, interleave, bs, max_blocks)
        keep = mine.to(tl.int32)
        dest = count[:, None] + tl.cumsum(keep, axis=1) - keep
        tl.store(slot_rows + dest.to(tl.int64), slot.to(tl.int32), mask=mine)
        count += tl.sum(keep, axis=1)

    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        tail = row_in[:, None] & (cols < top_k)[None, :] & (cols[None, :] >= count[:, None])
        tl.store(slot_rows + cols[None, :], tl.full([TOKENS, TILE], -1, tl.int32), mask=tail)
    tl.store(counts_ptr + rows, count, mask=row_in)


class PaddedRowsNotZeroed(IndexMutant):
    description = "is_valid_token ignored: padding rows get their real-looking ids' slots and a count > 0"
    bug = Swap(index, _filter_index_kernel=_filter_index_kernel_padding_filtered)


@triton.jit
def _slot_mapping_kernel_first_token(
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
    completes = in_bounds & (position >= 0) & (position % rho == 0)  # BUG: first token of the state, not its last
    table_rows = block_table_ptr + req * block_table_row_stride
    mine, slot = _locate_state(position // rho, completes, table_rows, rank, world_size, interleave, bs, max_blocks)
    tl.store(slots_ptr + offsets, tl.where(mine, slot, -1), mask=in_bounds)


class StateWrittenAtFirstToken(IndexMutant):
    description = "write side stores state p // rho at p % rho == 0 (before it is complete) instead of (p+1) % rho == 0"
    bug = Swap(index, _slot_mapping_kernel=_slot_mapping_kernel_first_token)
