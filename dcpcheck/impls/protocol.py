"""The capabilities an implementation under test may provide.

An implementation is one object; each capability is a method of that name.
A capability that is missing (no attribute, or the attribute is ``None``)
skips the tests that need it, with a reason; it never crashes the run.

Conventions shared by every capability (DESIGN.md section 1):

* ``bs`` is states per page on one rank, ``S`` the interleave
  (``cp_kv_cache_interleave_size``), ``W`` the DCP world size, ``r`` the rank.
* ``-1`` in an index tensor means "no candidate"; slot tensors are int32.
* LSEs are fp32, base 2 unless a ``lse_base`` argument says otherwise; an
  empty row has ``out = 0`` and ``lse = -1e30`` (``-inf`` must work too).
* ``group`` is a :class:`dcpcheck.dist.group.DcpGroup`, which has the vLLM
  ``GroupCoordinator`` surface, so vLLM functions accept it unchanged.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from dcpcheck.stages import STAGE_COMBINE, STAGE_INDEX, STAGE_PREFILL

# capability name -> the stage whose tests need it.
CAPABILITIES: dict[str, int] = {
    "filter_index": STAGE_INDEX,
    "slot_mapping": STAGE_INDEX,
    "gather_heads": STAGE_COMBINE,
    "sparse_attention": STAGE_COMBINE,
    "partial_attention": STAGE_COMBINE,
    "combine": STAGE_COMBINE,
    "dcp_attention": STAGE_COMBINE,
    "prefill_geometry": STAGE_PREFILL,
    "prefill_gather": STAGE_PREFILL,
    "prefill_remap": STAGE_PREFILL,
    "build_attention": STAGE_COMBINE,
}

LSE_BASES = (2.0, math.e)
COMBINE_BACKENDS = ("ag_rs", "a2a")


@runtime_checkable
class DcpImplementation(Protocol):
    """Signatures of all capabilities (an implementation may have a subset)."""

    name: str

    # ---- stage 1: index filtering -------------------------------------
    def filter_index(
        self,
        topk: torch.Tensor,  # [T, K] int32 global state ids, -1 = none
        token_to_req: torch.Tensor,  # [T] int32
        block_table: torch.Tensor,  # [R, max_blocks] int32, this rank's
        is_valid_token: torch.Tensor,  # [T] bool
        *,
        bs: int,
        world_size: int,
        rank: int,
        interleave: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (slots [T, K] int32: owned slots compacted to a prefix, -1 after;
        counts [T] int32). Invalid tokens get count 0; ids whose local page
        falls outside the block table row are dropped."""

    def slot_mapping(
        self,
        positions: torch.Tensor,  # [T] int64 token positions
        token_to_req: torch.Tensor,  # [T] int32
        block_table: torch.Tensor,  # [R, max_blocks] int32, this rank's
        *,
        rho: int,
        bs: int,
        world_size: int,
        rank: int,
        interleave: int,
    ) -> torch.Tensor:
        """-> [T] int64: the slot this rank writes the compressed state
        completed at position p into (state p // rho when (p+1) % rho == 0 and
        this rank owns it), else -1."""

    # ---- stage 3: partial attention + combine ---------------------------
    def gather_heads(self, x: torch.Tensor, group, *, dim: int = 1) -> torch.Tensor:
        """All-gather over heads in TP order: q [T, H_loc, D] -> [T, H, D]
        (dim=1), sinks [H_loc] -> [H] (dim=0)."""

    def sparse_attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        comp_cache: torch.Tensor,  # [N, D] compressed KV rows (key == value)
        comp_slots: torch.Tensor,  # [T, K] int32, -1 = none
        swa_cache: torch.Tensor | None,  # [M, D] window KV rows
        swa_slots: torch.Tensor | None,  # [T, Wn] int32, -1 = none
        sink: torch.Tensor | None,  # [H] fp32 logits
        *,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every row over exactly the given candidates (+ sink).
        -> (out [T, H, D] in q.dtype, lse [T, H] fp32 base 2, sink folded)."""

    def partial_attention(
        self,
        q: torch.Tensor,
        comp_cache: torch.Tensor,
        comp_slots: torch.Tensor,
        swa_cache: torch.Tensor | None,
        swa_slots: torch.Tensor | None,
        sink: torch.Tensor | None,
        *,
        scale: float,
        rank: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One DCP rank's partial: its owned compressed slots, plus the SWA
        window and the sink on rank 0 only."""

    def combine(
        self,
        out: torch.Tensor,  # [T, H, D] partial output, any float dtype
        lse: torch.Tensor,  # [T, H] fp32
        group,
        *,
        backend: str = "ag_rs",
        lse_base: float = 2.0,
        return_lse: bool = False,
    ):
        """LSE-weighted merge across ranks, then keep this rank's heads.
        -> out [T, H_loc, D] (out.dtype), or (out, lse [T, H_loc] fp32 in
        lse_base) when return_lse. W = 1 returns the input unchanged."""

    def dcp_attention(
        self,
        q_local: torch.Tensor,  # [T, H_loc, D]
        sink_local: torch.Tensor | None,  # [H_loc]
        comp_cache: torch.Tensor,
        comp_slots: torch.Tensor,  # this rank's stage-1 output
        swa_cache: torch.Tensor | None,
        swa_slots: torch.Tensor | None,
        group,
        *,
        scale: float,
        backend: str = "ag_rs",
        token_chunk: int | None = None,
    ) -> torch.Tensor:
        """The whole stage-3 path: gather q and sinks, partial attention,
        combine; rows processed in sub-chunks of at most ``token_chunk``
        tokens when given. -> [T, H_loc, D]."""

    # ---- stage 9: prefill via compressed-KV gather ----------------------
    def prefill_geometry(
        self, seq_lens: torch.Tensor, *, rho: int, bs: int, world_size: int
    ):
        """Per-step geometry shared by every layer: an object with
        ``pages`` [R] and ``bases`` [R] int64 tensors and ``total_pages``."""

    def prefill_gather(
        self, comp_cache: torch.Tensor, block_table: torch.Tensor, geometry, group, *, bs: int
    ) -> torch.Tensor:
        """All-gather every prefill request's pages, rank-major per request:
        -> [total_pages * bs, D]."""

    def prefill_remap(
        self,
        topk: torch.Tensor,
        token_to_req: torch.Tensor,
        is_valid_token: torch.Tensor,
        geometry,
        *,
        bs: int,
        world_size: int,
        interleave: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ids -> slots of the gathered buffer (-1 stays -1).
        -> (slots [T, K] int32, counts [T] int32)."""

    # ---- the gate ---------------------------------------------------------
    def build_attention(self, layout, group):
        """Build the DCP attention path for a KV layout. With W > 1 and
        DSV41_DCP_STAGE < 3 it raises NotImplementedError naming the variable,
        before any collective."""
