"""The port's DCP attention layer: what a model layer calls every step.

A layer composes the implementation's capabilities (so a variant of one
capability changes every layer built from it): it writes the step's KV
through the sharded write path, then routes rows:

* SWA-only layers (rho 0): the window is replicated, so every rank attends
  its own heads locally, with no collective;
* prefill rows, when the stage-9 gather is enabled: every rank's compressed
  pages of the prefill requests are gathered and the rank's heads attend
  over them;
* every other row (decode, spec decode, CUDA-graph padding, and prefill
  without the gather): one stage 1 filter, then stage 3 (q gather over
  heads, partial attention, LSE combine) in sub-chunks of at most
  ``prefill_token_chunk`` rows.

Per-step metadata is built once per step and KV layout by :meth:`plan_step`
and shared by every layer of that layout, like vLLM's attention metadata;
it holds the stage-9 geometry, so the geometry is computed once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .prefill import DCP_PREFILL_TOKEN_CHUNK, PrefillGeometry


def layout_key(layout) -> tuple[int, int, int, int]:
    return (layout.rho, layout.bs, layout.interleave, layout.world_size)


def validate_layout(layout, world_size: int) -> None:
    """Raise ValueError unless ``layout`` (rho, bs, interleave, world_size) is
    one the port can run on a group of ``world_size`` ranks."""
    rho, bs, interleave, layout_world = layout_key(layout)
    if rho < 0:
        raise ValueError(f"KV layout rho={rho}: accepted 0 (SWA only) or >= 1 (compress ratio)")
    if rho >= 1 and (bs < 1 or interleave < 1 or bs % interleave):
        raise ValueError(
            f"KV layout bs={bs}, S={interleave}: need bs >= 1, S >= 1 and bs % S == 0 "
            f"(S = cp_kv_cache_interleave_size, bs = states per page on one rank)"
        )
    if layout_world != world_size:
        raise ValueError(f"KV layout for W={layout_world} on a DCP group of {world_size} ranks")


@dataclass(frozen=True)
class StepPlan:
    """One step's metadata for the layers of one KV layout (this rank)."""

    layout: tuple[int, int, int, int]
    token_to_req: torch.Tensor  # [T] int32
    is_valid_token: torch.Tensor  # [T] bool
    swa_slots: torch.Tensor  # [T, window] int32: window rows to read, -1 = none
    swa_write_slots: torch.Tensor | None  # [T] int64: where each row's window row goes, -1 = nowhere
    block_table: torch.Tensor | None  # [R, max_blocks] int32, this rank's (rho >= 1)
    comp_write_slots: torch.Tensor | None  # [T] int64: where each row's completed state goes here, -1 = nowhere
    stage3_rows: torch.Tensor  # int64 row indices that go through stage 1 + stage 3
    gather_rows: torch.Tensor  # int64 row indices of prefill rows that go through the stage-9 gather
    gather_row_request: torch.Tensor  # [len(gather_rows)] int32: index into the prefill requests
    gather_block_table: torch.Tensor | None  # this rank's block-table rows of the prefill requests
    geometry: PrefillGeometry | None  # the gather geometry; None when no row is gathered
    # This step's gathered buffer per compressed cache: layers sharing a kv
    # source's cache gather it once per step.
    gathered: dict = field(default_factory=dict, compare=False)


class DcpAttentionLayer:
    """One attention layer on one DCP rank; built by ``build_attention``."""

    def __init__(
        self,
        impl,
        layout,
        group,
        *,
        backend: str = "ag_rs",
        prefill_gather: bool = False,
        prefill_token_chunk: int | None = DCP_PREFILL_TOKEN_CHUNK,
        scale: float | None = None,
    ):
        if prefill_token_chunk is not None and prefill_token_chunk < 1:
            raise ValueError(f"prefill_token_chunk={prefill_token_chunk}; accepted: None or >= 1")
        self.impl = impl
        self.group = group
        self.rho, self.bs, self.interleave, self.world_size = layout_key(layout)
        self.backend = backend
        self.prefill_gather = prefill_gather
        self.prefill_token_chunk = prefill_token_chunk
        self.scale = scale

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return (self.rho, self.bs, self.interleave, self.world_size)

    @property
    def compressed(self) -> bool:
        return self.rho >= 1

    def plan_step(
        self,
        *,
        seq_lens: torch.Tensor,
        token_to_req: torch.Tensor,
        positions: torch.Tensor,
        is_valid_token: torch.Tensor,
        is_prefill_request: torch.Tensor,
        swa_slots: torch.Tensor,
        swa_write_slots: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
    ) -> StepPlan:
        """The step's metadata for every layer of this layout: row split,
        write slots, and (gather path) the prefill geometry, computed once."""
        requests = token_to_req.long()
        gathered = is_valid_token & is_prefill_request[requests]
        if not (self.compressed and self.prefill_gather):
            gathered = torch.zeros_like(gathered)
        gather_rows = gathered.nonzero().flatten()
        prefill_requests = is_prefill_request.nonzero().flatten()
        request_index = torch.cumsum(is_prefill_request.long(), 0) - 1  # index among prefill requests
        comp_write_slots = gather_block_table = geometry = None
        if self.compressed:
            comp_write_slots = self.impl.slot_mapping(
                torch.where(is_valid_token, positions, -1),
                token_to_req,
                block_table,
                rho=self.rho,
                bs=self.bs,
                world_size=self.world_size,
                rank=self.group.rank_in_group,
                interleave=self.interleave,
            )
        if gather_rows.numel():
            gather_block_table = block_table[prefill_requests]
            geometry = self.impl.prefill_geometry(
                seq_lens[prefill_requests], rho=self.rho, bs=self.bs, world_size=self.world_size
            )
        return StepPlan(
            layout=self.layout,
            token_to_req=token_to_req,
            is_valid_token=is_valid_token,
            swa_slots=swa_slots,
            swa_write_slots=swa_write_slots,
            block_table=block_table,
            comp_write_slots=comp_write_slots,
            stage3_rows=(~gathered).nonzero().flatten(),
            gather_rows=gather_rows,
            gather_row_request=request_index[requests[gather_rows]].to(torch.int32),
            gather_block_table=gather_block_table,
            geometry=geometry,
        )

    def forward(
        self,
        plan: StepPlan,
        *,
        q: torch.Tensor,
        sink: torch.Tensor | None,
        swa_cache: torch.Tensor,
        comp_cache: torch.Tensor | None = None,
        topk: torch.Tensor | None = None,
        kv: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write then attend. q [T, H_loc, D] and sink [H_loc] are this rank's
        heads; kv [T, D] is each row's window row (written at the plan's
        swa_write_slots) and states [T, D] the compressed state each row's
        position completes (read only there); either may be None when the
        caches already hold them.
        -> [T, H_loc, D] in q.dtype."""
        if plan.layout != self.layout:
            raise ValueError(f"a step plan for layout {plan.layout} given to a layer of layout {self.layout}")
        self._write(plan, swa_cache, comp_cache, kv, states)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if not self.compressed:
            out, _ = self.impl.sparse_attention(
                q, swa_cache[:0], plan.swa_slots[:, :0], swa_cache, plan.swa_slots, sink, scale=scale
            )
            return out
        out = q.new_empty(q.shape)
        if plan.stage3_rows.numel():
            out[plan.stage3_rows] = self._stage3(plan, q, sink, swa_cache, comp_cache, topk, scale)
        if plan.gather_rows.numel():
            out[plan.gather_rows] = self._gathered_prefill(plan, q, sink, swa_cache, comp_cache, topk, scale)
        return out

    def _write(self, plan: StepPlan, swa_cache, comp_cache, kv, states) -> None:
        if kv is not None:
            if plan.swa_write_slots is None:
                raise ValueError("forward got window rows (kv) but the step plan has no swa_write_slots")
            written = plan.swa_write_slots >= 0
            swa_cache[plan.swa_write_slots[written]] = kv[written].to(swa_cache.dtype)
        if states is not None and self.compressed:
            written = plan.comp_write_slots >= 0
            comp_cache[plan.comp_write_slots[written]] = states[written].to(comp_cache.dtype)

    def _stage3(self, plan, q, sink, swa_cache, comp_cache, topk, scale):
        """One stage 1 filter of the rows on this rank, then the stage-3 path
        in sub-chunks (which bound the gathered q and the partials)."""
        rows = plan.stage3_rows
        comp_slots, _ = self.impl.filter_index(
            topk[rows],
            plan.token_to_req[rows],
            plan.block_table,
            plan.is_valid_token[rows],
            bs=self.bs,
            world_size=self.world_size,
            rank=self.group.rank_in_group,
            interleave=self.interleave,
        )
        return self.impl.dcp_attention(
            q[rows],
            sink,
            comp_cache,
            comp_slots,
            swa_cache,
            plan.swa_slots[rows],
            self.group,
            scale=scale,
            backend=self.backend,
            token_chunk=self.prefill_token_chunk,
        )

    def _gathered_prefill(self, plan, q, sink, swa_cache, comp_cache, topk, scale):
        """Every rank's pages of the prefill requests, then this rank's heads
        over them: the whole attention of those heads, no combine."""
        rows = plan.gather_rows
        gathered = plan.gathered.get(comp_cache.data_ptr())
        if gathered is None:
            gathered = self.impl.prefill_gather(
                comp_cache, plan.gather_block_table, plan.geometry, self.group, bs=self.bs
            )
            plan.gathered[comp_cache.data_ptr()] = gathered
        slots, _ = self.impl.prefill_remap(
            topk[rows],
            plan.gather_row_request,
            plan.is_valid_token[rows],
            plan.geometry,
            bs=self.bs,
            world_size=self.world_size,
            interleave=self.interleave,
        )
        out, _ = self.impl.sparse_attention(
            q[rows], gathered, slots, swa_cache, plan.swa_slots[rows], sink, scale=scale
        )
        return out
