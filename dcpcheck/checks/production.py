"""One served step at the production profile through an implementation's attention layer.

The step (:func:`dcpcheck.scenarios.production.production_step`) mixes MTP decodes at the far end of
requests past 2^17 tokens (the longest at ``max_model_len``) with a chunked prefill's chunk. The layer is
built as served: ``max_model_len`` (vLLM's block-table rows), and, for an implementation that takes them
(its ``SERVED_OPTIONS``), the checkpoint's ``index_topk`` and a KV pool whose pages sit past 2^31 bytes.
Its output is compared with the float64 oracle over dense per-request states (no paging, no sharding) on
every row, or on spot rows where the step is large.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dcpcheck.checks.cases import checked_layer_output, own_heads
from dcpcheck.compare import assert_close, coarser_dtype
from dcpcheck.impls.conventions import conventions_of
from dcpcheck.oracle import attention as oracle
from dcpcheck.oracle.kv_cache import stored_values
from dcpcheck.oracle.prefill import dense_state_slots
from dcpcheck.scenarios.attention import build_attention_inputs, comp_cache_for
from dcpcheck.scenarios.batch import StepBatch, rank_block_table
from dcpcheck.scenarios.production import BYTE_OFFSET_MARK, PROFILES, ProductionProfile, production_step

ORACLE_ROWS = 64  # more rows than this: the oracle checks every request's first and last row and every 8th


def stored_in_pieces(rows: torch.Tensor, kv_cache_format: str, piece: int = 1 << 16) -> torch.Tensor:
    """:func:`stored_values` of ``rows``, ``piece`` rows at a time: its fp32 temporaries of a served request's
    every token would be gigabytes a rank."""
    stored = torch.empty_like(rows)
    for start in range(0, rows.shape[0], piece):
        stored[start : start + piece] = stored_values(rows[start : start + piece], kv_cache_format)
    return stored


def oracle_rows(roles: tuple[str, ...], token_to_req: torch.Tensor) -> torch.Tensor:
    """Every row of a small step; of a large one each request's first and last row and every 8th."""
    if len(roles) <= ORACLE_ROWS:
        return torch.arange(len(roles))
    reqs = token_to_req.tolist()
    chosen = {t for t in range(0, len(reqs), 8)}
    chosen |= {t for t in range(len(reqs)) if t == 0 or t == len(reqs) - 1 or reqs[t] != reqs[t - 1]}
    chosen |= {t - 1 for t in range(1, len(reqs)) if reqs[t] != reqs[t - 1]}
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def production_inputs(ctx, profile: ProductionProfile, batch: StepBatch, num_heads: int):
    """The attention inputs of ``batch`` as the implementation's layer reads them: rounded through the dtype it
    declares it computes in, and as its caches' record gives them back. -> (inputs, the tolerance's dtype)."""
    declared = conventions_of(ctx.impl)
    inputs = build_attention_inputs(
        batch,
        num_heads=num_heads,
        head_dim=profile.head_dim,
        window=profile.window,
        dtype=profile.dtype,
        seed=ctx.seed + 1,
        device=ctx.device,
    )
    tolerance_dtype = coarser_dtype(profile.dtype, declared.layer_dtype)
    if tolerance_dtype != profile.dtype:
        rounded = {
            name: getattr(inputs, name).to(tolerance_dtype).to(profile.dtype) for name in ("q", "states", "swa_cache")
        }
        inputs = replace(inputs, **rounded)
    if declared.kv_cache_format is not None:
        # What the layer's caches give back, which is what its kernel reads.
        stored = {
            name: stored_in_pieces(getattr(inputs, name), declared.kv_cache_format) for name in ("states", "swa_cache")
        }
        inputs = replace(inputs, **stored)
    return inputs, tolerance_dtype


def production_layer(ctx, profile: ProductionProfile, layout, *, top_k: int, prefill_gather: bool):
    """The implementation's layer built as served: ``max_model_len`` (vLLM's block-table rows), and, for an
    implementation that takes them (its ``SERVED_OPTIONS``), the checkpoint's ``index_topk`` and a KV pool
    whose pages sit past 2^31 bytes."""
    served = getattr(ctx.impl, "SERVED_OPTIONS", ())
    options = {"index_topk": top_k, "kv_pool_offset": BYTE_OFFSET_MARK}
    return ctx.impl.build_attention(
        layout,
        ctx.group,
        backend="a2a",
        prefill_gather=prefill_gather,
        max_model_len=profile.max_model_len,
        **{name: value for name, value in options.items() if name in served},
    )


def is_prefill_request(batch: StepBatch) -> torch.Tensor:
    """[R] bool: the requests with prefill rows in ``batch``."""
    flags = torch.zeros(batch.num_requests, dtype=torch.bool)
    flags[batch.token_to_req[[role == "prefill" for role in batch.row_roles]].long()] = True
    return flags


def assert_matches_oracle(out, batch: StepBatch, inputs, q, swa_slots, heads: slice, *, context, tolerance_dtype):
    """The layer's output ``out`` for this rank's ``heads`` vs the float64 oracle over dense per-request states
    (``inputs``' states and window rows), on :func:`oracle_rows`. ``q``: all heads of the step's rows."""
    rows = oracle_rows(batch.row_roles, batch.token_to_req)
    slots = dense_state_slots(batch.topk, batch.token_to_req, batch.is_valid_token, inputs.state_offsets)
    comp = oracle.compact_candidates(inputs.states, slots[rows])
    swa = oracle.compact_candidates(inputs.swa_cache, swa_slots[rows])
    q_rows = q[rows.to(q.device)][:, heads]
    want, _ = oracle.sparse_attention(q_rows, *comp, *swa, inputs.sink[heads], scale=inputs.scale)
    labels = [f"{role}, request {req}, position {p}" for role, req, p in zip(
        batch.row_roles, batch.token_to_req.tolist(), batch.positions.tolist())]  # fmt: skip
    return assert_close(
        out[rows.to(out.device)].cpu(),
        want,
        what="production step vs float64 oracle",
        context=context,
        row_labels=[labels[t] for t in rows.tolist()],
        offsets=(0, heads.start, 0),
        dtype=tolerance_dtype,
    )


def check_production_step(
    ctx,
    *,
    profile: str,
    rho: int,
    top_k: int,
    local_heads: int,
    prefill_gather: bool,
    interleave_tokens: int = 1,
):
    """The layer's output for this rank's heads vs the float64 oracle, at ``profile`` (a name of
    :data:`~dcpcheck.scenarios.production.PROFILES`). -> the worst comparison."""
    profile = PROFILES[profile]
    layout = profile.kv_layout(rho, ctx.world_size, interleave_tokens)
    batch = production_step(profile, layout, top_k=top_k, seed=ctx.seed)
    num_heads = local_heads * ctx.world_size
    inputs, tolerance_dtype = production_inputs(ctx, profile, batch, num_heads)
    heads = own_heads(ctx, num_heads)
    table = rank_block_table(batch, ctx.rank)
    comp_cache = comp_cache_for(batch, inputs, table, rank=ctx.rank, world_size=ctx.world_size)
    layer = production_layer(ctx, profile, layout, top_k=top_k, prefill_gather=prefill_gather)
    device = ctx.device
    plan = layer.plan_step(
        seq_lens=batch.seq_lens.to(device),
        token_to_req=batch.token_to_req.to(device),
        positions=batch.positions.to(device),
        is_valid_token=batch.is_valid_token.to(device),
        is_prefill_request=is_prefill_request(batch).to(device),
        swa_slots=inputs.swa_slots.to(device),
        block_table=table.to(device),
    )
    out = layer.forward(
        plan,
        q=inputs.q[:, heads].to(device),
        sink=inputs.sink[heads].to(device),
        swa_cache=inputs.swa_cache.to(device),
        comp_cache=comp_cache.to(device),
        topk=batch.topk.to(device),
    )
    out = checked_layer_output(out, inputs.q[:, heads], device)
    context = production_context(ctx, profile, rho=rho, top_k=top_k, num_heads=num_heads, prefill_gather=prefill_gather)
    stats = assert_matches_oracle(
        out, batch, inputs, inputs.q, inputs.swa_slots, heads, context=context, tolerance_dtype=tolerance_dtype
    )
    return {"worst_ratio": stats.worst_ratio, "max_abs_err": stats.max_abs_err}


def production_context(ctx, profile: ProductionProfile, *, rho, top_k, num_heads, prefill_gather) -> dict:
    """A production case in a failure message's words."""
    return {
        "stage": "production",
        "profile": profile.name,
        "W": ctx.world_size,
        "rank": ctx.rank,
        "rho": rho,
        "K": top_k,
        "H": num_heads,
        "D": profile.head_dim,
        "prefill": "gather" if prefill_gather else "stage 3 sub-chunks",
        "max_model_len": profile.max_model_len,
    }
