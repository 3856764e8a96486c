"""Stage 9 of the port: prefill through a gather of the compressed KV.

Instead of gathering q over heads and combining partials, every rank
all-gathers the compressed pages of each prefill request (its own and its
peers') into one buffer and attends its local heads over it. The buffer is
rank-major per request: request ``i`` holds pages ``[base_i, base_i +
W*pages_i)`` and rank ``r``'s first ``pages_i`` block-table pages of it start
at ``base_i + r*pages_i``. :func:`prefill_remap` (a Triton kernel) turns global
top-k state ids into slots of that buffer.

The other prefill path runs through stage 3 in sub-chunks of at most
:data:`DCP_PREFILL_TOKEN_CHUNK` tokens, which bounds the gathered q and the
partials.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .ownership import owner_and_local
from .triton_env import TOKENS_PER_PROGRAM, TOPK_TILE, block_for

# Most prefill tokens one stage-3 sub-chunk carries (the non-gather path).
DCP_PREFILL_TOKEN_CHUNK = 2048


@dataclass(frozen=True)
class PrefillGeometry:
    """One step's gathered-buffer geometry, shared by every layer of a layout."""

    pages: torch.Tensor  # [R] int64: pages each rank contributes for prefill request i (>= 1)
    bases: torch.Tensor  # [R] int64: first buffer page of request i
    total_pages: int  # sum_i W * pages_i


def prefill_geometry(seq_lens: torch.Tensor, *, rho: int, bs: int, world_size: int) -> PrefillGeometry:
    """Geometry for the prefill requests of one step, ``seq_lens`` [R] being
    their lengths in tokens after the step. A request gets at least one page
    even with no state yet, so its share of the gather is never empty."""
    states = seq_lens.to(torch.int64) // rho
    states_per_virtual_block = bs * world_size
    pages = torch.clamp((states + states_per_virtual_block - 1) // states_per_virtual_block, min=1)
    bases = world_size * (torch.cumsum(pages, 0) - pages)
    return PrefillGeometry(pages=pages, bases=bases, total_pages=world_size * int(pages.sum()))


def _local_pages(
    comp_cache: torch.Tensor, block_table: torch.Tensor, geometry: PrefillGeometry, bs: int
) -> torch.Tensor:
    """This rank's first ``pages_i`` pages of every request, request after
    request: [sum_i pages_i, bs, D]. Columns past the row's end (a request this
    rank holds fewer pages of) send zeros: no id maps there."""
    device = block_table.device
    pages = geometry.pages.to(device)
    num_requests, width = block_table.shape
    requests = torch.repeat_interleave(torch.arange(num_requests, device=device), pages)
    columns = torch.arange(requests.numel(), device=device) - (torch.cumsum(pages, 0) - pages)[requests]
    in_row = columns < width
    cache_pages = comp_cache.view(-1, bs, comp_cache.shape[-1])
    if width == 0:
        return cache_pages.new_zeros((requests.numel(),) + tuple(cache_pages.shape[1:]))
    physical = block_table[requests, columns.clamp(max=width - 1)].long()
    return torch.where(in_row[:, None, None], cache_pages[physical], 0.0)


def prefill_gather(
    comp_cache: torch.Tensor, block_table: torch.Tensor, geometry: PrefillGeometry, group, *, bs: int
) -> torch.Tensor:
    """All-gather every prefill request's pages from every rank, rank-major per
    request: -> [total_pages * bs, D]. ``block_table`` holds this rank's rows of
    the prefill requests, in the geometry's order. One collective for all
    requests; the rank-major order per request is restored by a page shuffle."""
    world = group.world_size
    local = _local_pages(comp_cache, block_table, geometry, bs)
    gathered = group.all_gather(local, dim=0)  # [W * P, bs, D]: rank r's P pages r-th
    pages, bases = geometry.pages.to(local.device), geometry.bases.to(local.device)
    num_requests = pages.numel()
    requests = torch.repeat_interleave(torch.arange(num_requests, device=local.device), world * pages)
    within = torch.arange(requests.numel(), device=local.device) - bases[requests]
    owner, vblock = within // pages[requests], within % pages[requests]
    source = owner * local.shape[0] + bases[requests] // world + vblock
    return gathered[source].reshape(-1, comp_cache.shape[-1])


@triton.jit
def _prefill_remap_kernel(
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
    k0 = 0  # a while loop over the runtime top_k, not range(): see triton_env.py
    while k0 < top_k:
        cols = k0 + tl.arange(0, TILE).to(tl.int64)
        in_bounds = row_in[:, None] & (cols < top_k)[None, :]
        ids = tl.load(topk_rows + cols[None, :], mask=in_bounds, other=-1).to(tl.int64)
        keep = in_bounds & is_valid[:, None] & (ids >= 0)
        # A virtual block is bs states on every rank: the buffer's page unit per rank.
        vblock = ids // states_per_virtual_block
        offset = ids % states_per_virtual_block
        owner, local_offset = owner_and_local(offset, world_size, interleave)
        slot = (bases[:, None] + owner * pages[:, None] + vblock) * bs + local_offset
        tl.store(slot_rows + cols[None, :], tl.where(keep, slot, -1).to(tl.int32), mask=in_bounds)
        count += tl.sum(keep.to(tl.int32), axis=1)
        k0 += TILE
    tl.store(counts_ptr + rows, count, mask=row_in)


def prefill_remap(
    topk: torch.Tensor,
    token_to_req: torch.Tensor,
    is_valid_token: torch.Tensor,
    geometry: PrefillGeometry,
    *,
    bs: int,
    world_size: int,
    interleave: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k ids of prefill rows -> slots of the gathered buffer, in
    place: ``(slots [T, K] int32, counts [T] int32)``. ``token_to_req`` indexes
    the geometry's requests; -1 stays -1; invalid tokens get -1 and count 0."""
    num_tokens, top_k = topk.shape
    slots = torch.empty((num_tokens, top_k), dtype=torch.int32, device=topk.device)
    counts = torch.zeros((num_tokens,), dtype=torch.int32, device=topk.device)
    if num_tokens == 0 or top_k == 0:
        return slots, counts
    tokens = block_for(num_tokens, TOKENS_PER_PROGRAM)
    _prefill_remap_kernel[(triton.cdiv(num_tokens, tokens),)](
        topk,
        token_to_req,
        is_valid_token.to(torch.int8),
        geometry.pages.to(topk.device),
        geometry.bases.to(topk.device),
        slots,
        counts,
        num_tokens,
        top_k,
        topk.stride(0),
        slots.stride(0),
        bs,
        bs * world_size,
        world_size,
        interleave,
        TOKENS=tokens,
        TILE=block_for(top_k, TOPK_TILE),
    )
    return slots, counts
