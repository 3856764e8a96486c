"""The stage-3 check on real shards (its cases: ``test_sharded_attention.py``;
``test_sink_schemes.py`` runs it on re-arranged ports): per-rank partial
attention over the stage-1 slots of a realistic batch, combined, equals DCP1
attention for the rank's heads.

Every rank builds the same batch and attention inputs from the seed, writes
its own compressed cache through its block table, takes its candidates from
the stage-1 oracle (so a stage-1 bug cannot fail these tests), and checks:
the head gather; its partial against the float64 oracle over its own
candidates (window on rank 0 only, the sink as the implementation's declared
``sink_scheme`` folds it); the combined output and LSE, with the sink folded
after the merge under ``after_merge``, against DCP1 twice (the float64 oracle
and the implementation's own W = 1 path); ``ag_rs == a2a``; and
``dcp_attention`` chunked == unchunked == gather + partial + combine.

The sinks are fixed, not drawn: every head's sink holds a third to a half of
its rows' mass, so a sink left out of the LSE, or folded twice, moves every
head's merged output by at least 9 bf16 tolerances (measured over W 2, 4, 8,
seeds 0 to 4 and these layouts), whatever the seed.
"""

from __future__ import annotations

import dataclasses

import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.checks.cases import own_heads
from dcpcheck.checks.stage1 import column_slice, stage1_slots
from dcpcheck.compare import Expected, MismatchError, assert_close, assert_lse_close, assert_outputs, format_context
from dcpcheck.group import DcpGroup
from dcpcheck.impls.conventions import conventions_of
from dcpcheck.oracle import attention as oracle
from dcpcheck.scenarios.attention import build_attention_inputs, comp_cache_for
from dcpcheck.scenarios.batch import KvLayout, build_step_batch, dcp1_block_table, rank_block_table
from tests.stage3_combine.common import padded_view, transposed_view

RHO = 4
TOP_K = 16
NUM_HEADS = 8  # one head per rank at W = 8 only; test_sharded_attention_one_head_per_rank has H = W
HEAD_DIM = 64
WINDOW = 8
TOKEN_CHUNK = 5  # splits the batch into uneven sub-chunks
# Natural-log sinks per head, against rows whose logits' mass is about e^3.7
# (H < 8 heads take the first H).
SINKS = torch.tensor([2.5, 2.75, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5])


def check_sharded_attention(ctx, *, backend, lse_base, dtype_name, interleave, bs, views=False, num_heads=NUM_HEADS):
    """``views``: q, the slots and the partial LSE are handed over as strided
    views (q as the leading columns of a wider buffer, slots as column slices,
    the LSE as the transposed view of a [H, T] buffer); every check holds."""
    dtype, base, device, impl = DTYPES[dtype_name], LSE_BASES[lse_base], ctx.device, ctx.impl
    W, rank = ctx.world_size, ctx.rank
    layout = KvLayout(rho=RHO, bs=bs, interleave=interleave, world_size=W)
    batch = build_step_batch(layout, top_k=TOP_K, seed=ctx.seed)
    inputs = build_attention_inputs(
        batch, num_heads=num_heads, head_dim=HEAD_DIM, window=WINDOW, dtype=dtype, seed=ctx.seed + 1
    )
    inputs = dataclasses.replace(inputs, sink=SINKS[:num_heads].clone())
    scheme = conventions_of(impl).sink_scheme
    heads = own_heads(ctx, num_heads)
    context = ctx.failure_context(
        backend=backend,
        lse_base=lse_base,
        dtype=dtype_name,
        S=interleave,
        bs=bs,
        H=num_heads,
        views=views,
        sinks=scheme,
    )
    where = format_context(context)
    num_tokens, heads_local = batch.num_tokens, heads.stop - heads.start
    labels = batch.row_labels
    worst = {}  # what -> worst |err| / allowed, returned for the summary

    def check(actual, expected, what, *, lse=False, all_heads=False):
        compare = assert_lse_close if lse else assert_close
        offsets = None if all_heads else (0, heads.start, 0)  # report global head ids
        stats = compare(actual, expected, what=what, context=context, row_labels=labels, offsets=offsets)
        worst[what] = stats.worst_ratio

    def outputs(capability, result, *expected):
        return assert_outputs(capability, result, expected, device=device, context=where)

    out_type = Expected("out", (num_tokens, num_heads, HEAD_DIM), dtype)
    lse_type = Expected("lse", (num_tokens, num_heads), torch.float32)
    local_type = Expected("out", (num_tokens, heads_local, HEAD_DIM), dtype)

    table = rank_block_table(batch, rank)
    slots = stage1_slots(batch, table, world_size=W, rank=rank).to(device)
    comp_cache = comp_cache_for(batch, inputs, table, rank=rank, world_size=W).to(device)
    swa_cache, swa_slots = inputs.swa_cache.to(device), inputs.swa_slots.to(device)
    # A rank's heads of q, as a view of the full q on the device (on CPU a .to() keeps the view anyway).
    q_local, sink_local = inputs.q.to(device)[:, heads], inputs.sink.to(device)[heads]
    if views:
        slots, swa_slots = column_slice(slots, device), column_slice(swa_slots, device)

    # 1. The head gather restores every head in TP order, exactly.
    q = outputs(
        "gather_heads",
        impl.gather_heads(q_local, ctx.group, dim=1),
        Expected("q", (num_tokens, num_heads, HEAD_DIM), dtype),
    )
    sink = outputs(
        "gather_heads",
        impl.gather_heads(sink_local, ctx.group, dim=0),
        Expected("sinks", (num_heads,), inputs.sink.dtype),
    )
    for name, got, want in (("q", q, inputs.q), ("sinks", sink, inputs.sink)):
        if got.shape != want.shape or not torch.equal(got.cpu(), want):
            raise MismatchError(
                f"gather_heads of {name}: {tuple(got.shape)} is not the TP-order "
                f"concatenation {tuple(want.shape)} of every rank's heads ({context})"
            )

    # 2. The partial covers exactly this rank's candidates; the window on rank 0
    # only, the sink as the declared scheme folds it.
    if views:
        q = padded_view(q, device)
    out, lse = outputs(
        "partial_attention",
        impl.partial_attention(
            q, comp_cache, slots, swa_cache, swa_slots, sink, scale=inputs.scale, rank=rank, world_size=W
        ),
        out_type,
        lse_type,
    )
    on_rank0 = rank == 0
    want_out, want_lse = oracle.sparse_attention(
        inputs.q,
        comp_cache,
        slots,
        inputs.swa_cache if on_rank0 else None,
        inputs.swa_slots if on_rank0 else None,
        oracle.partial_sink(inputs.sink, scheme=scheme, rank=rank, world_size=W),
        scale=inputs.scale,
    )
    check(out, want_out, f"partial output vs oracle over this rank's candidates (sink scheme {scheme})", all_heads=True)
    check(lse, want_lse, f"partial LSE (base 2) vs oracle (sink scheme {scheme})", lse=True, all_heads=True)

    # 3. Combined, with both backends, in the requested base, and the sink
    # folded after the merge where the scheme does: DCP1 for this rank's heads.
    dcp1_table = dcp1_block_table(batch)
    dcp1_cache = comp_cache_for(batch, inputs, dcp1_table, rank=0, world_size=1)
    dcp1_slots = stage1_slots(batch, dcp1_table, world_size=1, rank=0)
    dcp1_out, dcp1_lse = oracle.sparse_attention(
        inputs.q,
        dcp1_cache,
        dcp1_slots,
        inputs.swa_cache,
        inputs.swa_slots,
        inputs.sink,
        scale=inputs.scale,
        lse_base=base,
    )
    partial_lse = oracle.convert_lse_base(lse, from_base=2.0, to_base=base).float().to(device)
    if views:
        partial_lse = transposed_view(partial_lse, device)
    merged, merged_lse = outputs(
        "combine",
        impl.combine(out, partial_lse, ctx.group, backend=backend, lse_base=base, return_lse=True),
        local_type,
        Expected("lse", (num_tokens, heads_local), torch.float32),
    )
    end_out, end_lse = oracle.finish_merge(merged, merged_lse, sink_local, scheme=scheme, lse_base=base)
    end_out, end_lse = end_out.to(dtype), end_lse.float()  # rounded as an implementation returns them
    ending = "combined" if scheme != "after_merge" else "combined, then the sink folded,"
    check(end_out, dcp1_out[:, heads], f"{ending} output vs float64 DCP1 oracle")
    check(end_lse, dcp1_lse[:, heads], f"{ending} LSE vs float64 DCP1 oracle", lse=True)
    other = "a2a" if backend == "ag_rs" else "ag_rs"
    other_out, other_lse = outputs(
        "combine",
        impl.combine(out, partial_lse, ctx.group, backend=other, lse_base=base, return_lse=True),
        local_type,
        Expected("lse", (num_tokens, heads_local), torch.float32),
    )
    check(other_out, merged, f"{other} vs {backend} output")
    check(other_lse, merged_lse, f"{other} vs {backend} LSE", lse=True)

    # 4. The implementation's own DCP1 paths (W = 1: every candidate, window and
    # sink here): sparse attention called directly, and dcp_attention.
    dcp1_slots_here = column_slice(dcp1_slots, device) if views else dcp1_slots.to(device)
    sparse_out, sparse_lse = outputs(
        "sparse_attention",
        impl.sparse_attention(
            inputs.q.to(device), dcp1_cache.to(device), dcp1_slots_here, swa_cache, swa_slots, sink, scale=inputs.scale
        ),
        out_type,
        lse_type,
    )
    check(sparse_out, dcp1_out, "sparse_attention over every candidate vs float64 DCP1 oracle", all_heads=True)
    sparse_lse_in_base = oracle.convert_lse_base(sparse_lse, from_base=2.0, to_base=base)
    check(
        sparse_lse_in_base, dcp1_lse, "sparse_attention LSE (base 2) vs float64 DCP1 oracle", lse=True, all_heads=True
    )
    single_rank = DcpGroup.single_rank(device)
    port_dcp1 = impl.dcp_attention(
        inputs.q.to(device),
        inputs.sink.to(device),
        dcp1_cache.to(device),
        dcp1_slots_here,
        swa_cache,
        swa_slots,
        single_rank,
        scale=inputs.scale,
    )
    check(end_out, port_dcp1[:, heads], f"{ending} output vs the implementation's W=1 path")

    # 5. The whole path, unchunked and in sub-chunks, equals the steps above.
    for token_chunk in (None, TOKEN_CHUNK):
        whole = impl.dcp_attention(
            padded_view(q_local, device) if views else q_local,
            sink_local,
            comp_cache,
            slots,
            swa_cache,
            swa_slots,
            ctx.group,
            scale=inputs.scale,
            backend=backend,
            token_chunk=token_chunk,
        )
        outputs(f"dcp_attention(token_chunk={token_chunk})", whole, local_type)
        check(whole, end_out, f"dcp_attention(token_chunk={token_chunk}) vs gather + partial + combine")
    return {"worst_ratio": max(worst.values()), "worst_check": max(worst, key=worst.get)}
