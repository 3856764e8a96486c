"""Stage-9 mutants: the prefill gather (geometry, buffer, id remap) and the
non-gather prefill path in sub-chunks.

Each buggy copy below is the port's function of the same name in
:mod:`dcpcheck.port.prefill` (or ``dcp_attention`` of
:mod:`dcpcheck.port.attention`) with one line changed (marked ``# BUG``).
"""

from __future__ import annotations

import torch

from dcpcheck.port import triton_env  # noqa: F401  (first: sets TRITON_INTERPRET before triton loads)

import triton
import triton.language as tl

from dcpcheck.mutants.base import Mutant, Swap
from dcpcheck.port import attention, prefill
from dcpcheck.port.attention import gather_heads, partial_attention
from dcpcheck.port.combine import combine
from dcpcheck.port.prefill import PrefillGeometry, _local_pages
from dcpcheck.stages import STAGE_PREFILL


class PrefillMutant(Mutant):
    stage = STAGE_PREFILL
    home = "tests/stage9_prefill"


def _prefill_geometry_no_minimum(seq_lens: torch.Tensor, *, rho: int, bs: int, world_size: int) -> PrefillGeometry:
    states = seq_lens.to(torch.int64) // rho
    states_per_virtual_block = bs * world_size
    pages = (states + states_per_virtual_block - 1) // states_per_virtual_block  # BUG: no one-page minimum
    bases = world_size * (torch.cumsum(pages, 0) - pages)
    return PrefillGeometry(pages=pages, bases=bases, total_pages=world_size * int(pages.sum()))


class PagesWithoutMinimum(PrefillMutant):
    description = "a request with no state yet gets 0 pages (no one-page minimum): its gather moves 0 bytes"
    bug = Swap(prefill, prefill_geometry=_prefill_geometry_no_minimum)


def _prefill_geometry_pages_from_tokens(
    seq_lens: torch.Tensor, *, rho: int, bs: int, world_size: int
) -> PrefillGeometry:
    states = seq_lens.to(torch.int64)  # BUG: L tokens, not L // rho states
    states_per_virtual_block = bs * world_size
    pages = torch.clamp((states + states_per_virtual_block - 1) // states_per_virtual_block, min=1)
    bases = world_size * (torch.cumsum(pages, 0) - pages)
    return PrefillGeometry(pages=pages, bases=bases, total_pages=world_size * int(pages.sum()))


class PagesFromTokens(PrefillMutant):
    description = "pages_i sized from the request length L in tokens instead of its L // rho states"
    bug = Swap(prefill, prefill_geometry=_prefill_geometry_pages_from_tokens)


def _prefill_gather_block_major(comp_cache, block_table, geometry, group, *, bs):
    world = group.world_size
    local = _local_pages(comp_cache, block_table, geometry, bs)
    gathered = group.all_gather(local, dim=0)
    pages, bases = geometry.pages.to(local.device), geometry.bases.to(local.device)
    num_requests = pages.numel()
    requests = torch.repeat_interleave(torch.arange(num_requests, device=local.device), world * pages)
    within = torch.arange(requests.numel(), device=local.device) - bases[requests]
    owner, vblock = within % world, within // world  # BUG: the buffer laid out block-major, not rank-major
    source = owner * local.shape[0] + bases[requests] // world + vblock
    return gathered[source].reshape(-1, comp_cache.shape[-1])


class GatherBlockMajor(PrefillMutant):
    description = "the gathered buffer interleaves the ranks' pages (block-major) while the remap expects rank-major"
    bug = Swap(prefill, prefill_gather=_prefill_gather_block_major)


@triton.jit
def _prefill_remap_kernel_no_base(
    topk_ptr,
    token_to_req_ptr,
    is_valid_ptr,
    pages_ptr,
    bases_ptr,
    slots_ptr,
    counts_ptr,
    num_tokens,
    top_k,
    topk_row_stride,
    slots_row_stride,
    bs,
    states_per_virtual_block,
    world_size,
    interleave,
    TOKENS: tl.constexpr,
    TILE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS).to(tl.int64)
    row_in = rows < num_tokens
    is_valid = tl.load(is_valid_ptr + rows, mask=row_in, other=0) != 0
    req = tl.load(token_to_req_ptr + rows, mask=row_in & is_valid, other=0).to(tl.int64)
    pages = tl.load(pages_ptr + req, mask=row_in & is_valid, other=1).to(tl.int64)
    bases = tl.load(bases_ptr + req, mask=row_in & is_valid, other=0).to(tl.int64)  # noqa: F841  (unused: the bug)
    topk_rows = topk_ptr + rows[:, None] * topk_row_stride
    slot_rows = slots_ptr + rows[:, None] * slots_row_stride

    count = tl.zeros([TOKENS], dtype=tl.int32)
    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        keep = in_bounds & is_valid[:, None] & (ids >= 0)
        vblock = ids // states_per_virtual_block
        offset = ids % states_per_virtual_block
        owner = (offset // interleave) % world_size
        local_offset = (offset // (interleave * world_size)) * interleave + offset % interleave
        slot = (owner * pages[:, None] + vblock) * bs + local_offset  # BUG: request i's base page is missing
        tl.store(slot_rows + cols[None, :], tl.where(keep, slot, -1).to(tl.int32), mask=in_bounds)
        count += tl.sum(keep.to(tl.int32), axis=1)
    tl.store(counts_ptr + rows, count, mask=row_in)


class MissingRequestBase(PrefillMutant):
    description = "the remap omits base_i: every request's ids land in the first request's pages"
    bug = Swap(prefill, _prefill_remap_kernel=_prefill_remap_kernel_no_base)


@triton.jit
def _prefill_remap_kernel_vblock_offset_swapped(
    topk_ptr,
    token_to_req_ptr,
    is_valid_ptr,
    pages_ptr,
    bases_ptr,
    slots_ptr,
    counts_ptr,
    num_tokens,
    top_k,
    topk_row_stride,
    slots_row_stride,
    bs,
    states_per_virtual_block,
    world_size,
    interleave,
    TOKENS: tl.constexpr,
    TILE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS).to(tl.int64)
    row_in = rows < num_tokens
    is_valid = tl.load(is_valid_ptr + rows, mask=row_in, other=0) != 0
    req = tl.load(token_to_req_ptr + rows, mask=row_in & is_valid, other=0).to(tl.int64)
    pages = tl.load(pages_ptr + req, mask=row_in & is_valid, other=1).to(tl.int64)
    bases = tl.load(bases_ptr + req, mask=row_in & is_valid, other=0).to(tl.int64)
    topk_rows = topk_ptr + rows[:, None] * topk_row_stride
    slot_rows = slots_ptr + rows[:, None] * slots_row_stride

    count = tl.zeros([TOKENS], dtype=tl.int32)
    for k0 in range(0, top_k, TILE):
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        keep = in_bounds & is_valid[:, None] & (ids >= 0)
        vblock = ids // states_per_virtual_block
        offset = ids % states_per_virtual_block
        owner = (offset // interleave) % world_size
        local_offset = (offset // (interleave * world_size)) * interleave + offset % interleave
        slot = (bases[:, None] + owner * pages[:, None] + local_offset) * bs + vblock  # BUG: vblock and offset swapped
        tl.store(slot_rows + cols[None, :], tl.where(keep, slot, -1).to(tl.int32), mask=in_bounds)
        count += tl.sum(keep.to(tl.int32), axis=1)
    tl.store(counts_ptr + rows, count, mask=row_in)


class VblockOffsetSwapped(PrefillMutant):
    description = "the remap swaps virtual block and in-page offset: slot = (base + owner*pages + loff)*bs + vblock"
    bug = Swap(prefill, _prefill_remap_kernel=_prefill_remap_kernel_vblock_offset_swapped)


def _dcp_attention_drops_last_chunk(
    q_local, sink_local, comp_cache, comp_slots, swa_cache, swa_slots, group, *,
    scale, backend="ag_rs", token_chunk=None,
):
    if token_chunk is not None and token_chunk < 1:
        raise ValueError(f"dcp_attention: token_chunk={token_chunk}; accepted: None or >= 1")
    sink = None if sink_local is None else gather_heads(sink_local, group, dim=0)
    num_tokens = q_local.shape[0]
    if num_tokens == 0:
        return q_local.new_empty(q_local.shape)
    step = token_chunk or num_tokens
    outputs = []
    for start in range(0, num_tokens - step + 1, step):  # BUG: a last, shorter sub-chunk is dropped
        rows = slice(start, start + step)
        q = gather_heads(q_local[rows], group, dim=1)
        out, lse = partial_attention(
            q,
            comp_cache,
            comp_slots[rows],
            swa_cache,
            None if swa_slots is None else swa_slots[rows],
            sink,
            scale=scale,
            rank=group.rank_in_group,
        )
        outputs.append(combine(out, lse, group, backend=backend))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


class LastSubChunkDropped(PrefillMutant):
    description = "the non-gather prefill loop stops before a last sub-chunk shorter than the chunk size"
    bug = Swap(attention, dcp_attention=_dcp_attention_drops_last_chunk)
