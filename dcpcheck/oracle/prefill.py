"""Stage 9 reference: the gathered prefill buffer's geometry and the id remap.

DESIGN.md section 2 (Stage 9). Every rank all-gathers, for each prefill
request ``i``, the first ``pages_i`` pages of every rank's block-table row,
rank-major, so request ``i`` owns pages ``[base_i, base_i + W*pages_i)`` of the
buffer and rank ``r``'s pages of it start at ``base_i + r*pages_i``:

    pages_i = max(1, ceil((L_i // rho) / (bs*W)))
    base_i  = sum_{j<i} W*pages_j
    slot(c) = (base_i + owner*pages_i + vblock) * bs + loff

Plain torch, int64, built on the layout formulas of :mod:`dcpcheck.oracle.layout`
(one home for owner and local index). The embedded port must not import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpcheck.oracle.layout import local_index, owner_of_state


@dataclass(frozen=True)
class GatherGeometry:
    """Where each prefill request's pages lie in the gathered buffer."""

    pages: torch.Tensor  # [R] int64: pages per rank of request i (at least 1)
    bases: torch.Tensor  # [R] int64: first buffer page of request i
    total_pages: int  # buffer pages: sum_i W * pages_i


def gather_geometry(seq_lens: torch.Tensor, *, rho: int, bs: int, W: int) -> GatherGeometry:
    """The geometry of one step's prefill requests of lengths ``seq_lens`` [R]
    (tokens after this step). One page at least, so that no request's gather
    moves 0 bytes."""
    num_states = seq_lens.to(torch.int64) // rho
    states_per_virtual_block = bs * W
    pages = ((num_states + states_per_virtual_block - 1) // states_per_virtual_block).clamp(min=1)
    bases = W * (torch.cumsum(pages, 0) - pages)
    return GatherGeometry(pages, bases, int(W * pages.sum()))


def gathered_slot(
    c: torch.Tensor, req: torch.Tensor, geometry: GatherGeometry, *, bs: int, S: int, W: int
) -> torch.Tensor:
    """Slot of global state ``c`` of prefill request ``req`` (broadcast) in the
    gathered buffer; -1 where ``c < 0``."""
    c, req = torch.broadcast_tensors(c.to(torch.int64), req.to(torch.int64))
    states_per_virtual_block = bs * W
    vblock = c // states_per_virtual_block
    offset = c % states_per_virtual_block
    owner = owner_of_state(offset, S, W)
    local_offset = local_index(offset, S, W)
    page = geometry.bases[req] + owner * geometry.pages[req] + vblock
    return torch.where(c >= 0, page * bs + local_offset, torch.full_like(c, -1))


def remap_reference(
    topk: torch.Tensor,
    token_to_req: torch.Tensor,
    is_valid_token: torch.Tensor,
    geometry: GatherGeometry,
    *,
    bs: int,
    S: int,
    W: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every top-k id of a prefill row -> its slot in the gathered buffer, in
    place (-1 stays -1; invalid tokens get a row of -1).
    -> (slots [T, K] int64, counts [T] int64: the valid ids of each row)."""
    ids = torch.where(is_valid_token[:, None], topk.to(torch.int64), -1)
    slots = gathered_slot(ids, token_to_req.to(torch.int64)[:, None], geometry, bs=bs, S=S, W=W)
    return slots, (ids >= 0).sum(dim=1)


def dense_state_slots(
    topk: torch.Tensor, token_to_req: torch.Tensor, is_valid_token: torch.Tensor, state_offsets: torch.Tensor
) -> torch.Tensor:
    """The DCP1 reading of top-k ids without any paging: rows of a dense array
    holding request ``i``'s state ``c`` at ``state_offsets[i] + c``.
    -> [T, K] int64, -1 where the id is -1 or the token is invalid."""
    ids = topk.to(torch.int64)
    rows = state_offsets.to(torch.int64)[token_to_req.to(torch.int64)][:, None] + ids
    return torch.where(is_valid_token[:, None] & (ids >= 0), rows, torch.full_like(rows, -1))
