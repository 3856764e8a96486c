"""One prefill step on this rank, its DCP1 references, and running the
implementation's attention layer over it (the stage-9 tests and the GPU
stage-9 test)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from dcpcheck.case_terms import DTYPES
from dcpcheck.checks.cases import checked_layer_output, own_heads
from dcpcheck.compare import coarser_dtype, format_context
from dcpcheck.group import DcpGroup
from dcpcheck.impls.conventions import conventions_of
from dcpcheck.oracle import attention as oracle
from dcpcheck.oracle.kv_cache import stored_values
from dcpcheck.oracle.prefill import dense_state_slots
from dcpcheck.scenarios.attention import AttentionInputs, build_attention_inputs, comp_cache_for
from dcpcheck.scenarios.batch import KvLayout, StepBatch, dcp1_block_table, rank_block_table
from dcpcheck.scenarios.trace import PREFILL_REQUESTS, build_prefill_batch
from dcpcheck.stages import STAGE_PREFILL

NUM_HEADS = 8  # the default head count: one head per rank at W = 8 (num_heads=W gives one at every W)
HEAD_DIM = 64
WINDOW = 8


def max_model_len_of(width: int, layout: KvLayout) -> int:
    """The ``max_model_len`` whose block-table row (vLLM's: max_model_len / W, in pages) is ``width`` pages."""
    return width * layout.bs * layout.rho * layout.world_size


@dataclass
class PrefillStep:
    """One prefill step as this rank sees it (tensors on the rank's device)."""

    batch: StepBatch
    inputs: AttentionInputs
    heads: slice
    block_table: torch.Tensor
    comp_cache: torch.Tensor
    context: dict  # what failure messages name: stage, W, rank, case parameters
    # The dtype asked for, or the implementation's declared layer_dtype if coarser; None: the output's.
    tolerance_dtype: torch.dtype | None = None

    @property
    def case(self) -> str:
        return format_context(self.context)

    @cached_property
    def max_model_len(self) -> int:
        """The layer's ``max_model_len`` (``build_attention``'s option): vLLM sizes a rank's block-table row
        for max_model_len / W, so this is the widest row the case hands any rank (its spare columns
        included) in tokens, times W."""
        layout = self.batch.layout
        return max_model_len_of(
            max(rank_block_table(self.batch, rank).shape[1] for rank in range(layout.world_size)), layout
        )

    @property
    def row_labels(self) -> tuple[str, ...]:
        kinds = [PREFILL_REQUESTS[req] for req in self.batch.token_to_req.tolist()]
        return tuple(
            f"{label}, request {req} ({kind}), position {p}"
            for label, req, kind, p in zip(
                self.batch.row_labels, self.batch.token_to_req.tolist(), kinds, self.batch.positions.tolist()
            )
        )


def prefill_step(
    ctx, *, rho, S, bs, top_k, dtype_name="fp32", long_chunk=None, num_heads=None, **context
) -> PrefillStep:
    """``num_heads`` None: NUM_HEADS, or the heads per rank the implementation
    declares times W. q, the states and the window are rounded to its declared
    layer dtype, as its layer rounds them, and the states and the window through
    its declared cache record."""
    declared = conventions_of(ctx.impl)
    if num_heads is None:
        num_heads = declared.local_heads * ctx.world_size if declared.local_heads else NUM_HEADS
    layout = KvLayout(rho=rho, bs=bs, interleave=S, world_size=ctx.world_size)
    batch = build_prefill_batch(layout, top_k=top_k, seed=ctx.seed, long_chunk=long_chunk)
    dtype = DTYPES[dtype_name]
    inputs = build_attention_inputs(
        batch, num_heads=num_heads, head_dim=HEAD_DIM, window=WINDOW, dtype=dtype, seed=ctx.seed + 1
    )
    tolerance_dtype = coarser_dtype(dtype, declared.layer_dtype)
    if tolerance_dtype != dtype:
        inputs = replace(
            inputs,
            **{name: getattr(inputs, name).to(tolerance_dtype).to(dtype) for name in ("q", "states", "swa_cache")},
        )
    if declared.kv_cache_format is not None:
        # What the layer's caches give back, which is what its kernel reads.
        stored = {
            name: stored_values(getattr(inputs, name), declared.kv_cache_format) for name in ("states", "swa_cache")
        }
        inputs = replace(inputs, **stored)
    table = rank_block_table(batch, ctx.rank)
    cache = comp_cache_for(batch, inputs, table, rank=ctx.rank, world_size=ctx.world_size)
    full_context = {
        "stage": STAGE_PREFILL,
        "W": ctx.world_size,
        "rank": ctx.rank,
        "rho": rho,
        "S": S,
        "bs": bs,
        "K": top_k,
        "dtype": dtype_name,
        "H": num_heads,
        **context,
    }
    return PrefillStep(
        batch,
        inputs,
        own_heads(ctx, num_heads),
        table.to(ctx.device),
        cache.to(ctx.device),
        full_context,
        tolerance_dtype,
    )


def run_layer(
    layer, step: PrefillStep, device, *, block_table=None, comp_cache=None, heads=None, on_device=False
) -> torch.Tensor:
    """One forward of ``layer`` over the step, every request a prefill request
    (the padding rows are not prefill rows). -> [T, H_loc, D], on the CPU
    unless ``on_device`` (compare realistic sizes where they were made)."""
    batch, inputs = step.batch, step.inputs
    heads = step.heads if heads is None else heads
    plan = layer.plan_step(
        seq_lens=batch.seq_lens.to(device),
        token_to_req=batch.token_to_req.to(device),
        positions=batch.positions.to(device),
        is_valid_token=batch.is_valid_token.to(device),
        is_prefill_request=torch.ones(batch.num_requests, dtype=torch.bool, device=device),
        swa_slots=inputs.swa_slots.to(device),
        block_table=step.block_table if block_table is None else block_table,
    )
    out = layer.forward(
        plan,
        q=inputs.q[:, heads].to(device),
        sink=inputs.sink[heads].to(device),
        swa_cache=inputs.swa_cache.to(device),
        comp_cache=step.comp_cache if comp_cache is None else comp_cache,
        topk=batch.topk.to(device),
    )
    out = checked_layer_output(out, inputs.q[:, heads], device)
    return out if on_device else out.cpu()


def oracle_dcp1(step: PrefillStep) -> torch.Tensor:
    """Float64 DCP1 attention of the rank's heads, over dense per-request states
    (no paging, no sharding): [T, H_loc, D]."""
    batch, inputs = step.batch, step.inputs
    comp_slots = dense_state_slots(batch.topk, batch.token_to_req, batch.is_valid_token, inputs.state_offsets)
    out, _ = oracle.sparse_attention(
        inputs.q[:, step.heads],
        inputs.states,
        comp_slots,
        inputs.swa_cache,
        inputs.swa_slots,
        inputs.sink[step.heads],
        scale=inputs.scale,
    )
    return out


def port_dcp1(ctx, step: PrefillStep, *, on_device=False) -> torch.Tensor:
    """The implementation's own W = 1 path (its default prefill path) on one
    rank holding every state, for this rank's heads: [T, H_loc, D] (where
    :func:`run_layer` puts it)."""
    layout = KvLayout(
        rho=step.batch.layout.rho, bs=step.batch.layout.bs, interleave=step.batch.layout.interleave, world_size=1
    )
    table = dcp1_block_table(step.batch)
    cache = comp_cache_for(step.batch, step.inputs, table, rank=0, world_size=1)
    layer = ctx.impl.build_attention(
        layout,
        DcpGroup.single_rank(ctx.device),
        prefill_gather=False,
        max_model_len=max_model_len_of(table.shape[1], layout),
    )
    return run_layer(
        layer, step, ctx.device, block_table=table.to(ctx.device), comp_cache=cache.to(ctx.device), on_device=on_device
    )
