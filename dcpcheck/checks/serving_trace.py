"""The end-to-end check: a small stack of attention layers driven through a
serving trace, on one rank (a rank function: the ranks import it from here).
Its cases are in ``tests/e2e/``: ``test_serving_trace.py`` says what the trace
holds and what each layer's output must equal; ``test_gate.py``,
``test_large_lse.py`` and ``test_prefill_chunks.py`` run it too."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from dcpcheck.checks.cases import own_heads
from dcpcheck.checks.collectives import CountingGroup
from dcpcheck.checks.stack import RankStack
from dcpcheck.compare import MismatchError, assert_close, coarser_dtype
from dcpcheck.group import DcpGroup
from dcpcheck.impls.conventions import conventions_of, prefill_is_fused
from dcpcheck.oracle import attention as oracle
from dcpcheck.oracle.prefill import gather_geometry
from dcpcheck.scenarios.layers import LayerSpec, LayerTensors
from dcpcheck.scenarios.topology import Dsv41Topology
from dcpcheck.scenarios.trace import RequestSpec, schedule_trace, step_rows
from dcpcheck.spies import spy_on_capability

NUM_HEADS = 8  # one head per rank at W = 8; test_dsv41_topology_trace has one at every W
HEAD_DIM = 64
WINDOW = 8  # DSV4 uses 128; small keeps the CPU run fast and the window short of most requests
# DeepSeek-V4.0's shapes (compress ratios 4 and 128), for the generic checks.
V40_LAYERS = (
    LayerSpec(rho=0),
    LayerSpec(rho=4, bs=8, interleave=2, top_k=16),
    LayerSpec(rho=128, bs=2, interleave=1, top_k=4),
    LayerSpec(rho=4, bs=8, interleave=2, top_k=16),  # same layout as layer 1: shares its step metadata
)
REQUESTS = [
    RequestSpec(uid=0, arrival=0, prompt_len=300, decode_steps=2),  # prefilled over two steps
    RequestSpec(uid=1, arrival=0, prompt_len=37, decode_steps=3, tokens_per_decode=3),  # spec decode
    RequestSpec(uid=2, arrival=1, prompt_len=3, decode_steps=3),  # no compressed state until it decodes
    RequestSpec(uid=3, arrival=1, prompt_len=140, decode_steps=1),  # completes a C128A state mid-prefill
    RequestSpec(uid=4, arrival=4, prompt_len=90, decode_steps=1),  # joins after uid 0 left: reuses its pages
]
TOKEN_BUDGET = 160
TOKENS_PER_PAGE = 128  # vLLM's compressed-cache page (FlashInfer's kernel block): 64 states at ratio 2
DSV41_TOP_K = 16
PAD_TO = 8


def check_serving_trace(
    ctx,
    *,
    backend,
    prefill_gather,
    layers=V40_LAYERS,
    topology: Dsv41Topology | None = None,
    interleave_tokens: int = 1,
    requests=REQUESTS,
    token_budget: int = TOKEN_BUDGET,
    prefill_token_chunk=None,
    heads_per_rank: int | None = None,
    kernel_heads: int | None = None,
    common_component: float = 0.0,
    max_model_len: int | None = None,
):
    """``layers``: the stack, or generated from ``topology`` (the layers each
    told its place in it). ``heads_per_rank``: H = heads_per_rank * W (default
    H = NUM_HEADS); an implementation that declares its ``local_heads`` gets those instead.
    ``kernel_heads``: H itself, the heads the attention kernel sees (gathered at W > 1), whatever
    the implementation declares.
    ``common_component``: LayerTensors' (large LSEs). ``max_model_len``: the
    layers' (``build_attention``'s option; None: the implementation's default)."""
    declared = conventions_of(ctx.impl)
    if topology is not None:
        layers = topology.layer_specs(
            interleave_tokens=interleave_tokens, tokens_per_page=TOKENS_PER_PAGE, top_k=DSV41_TOP_K
        )
    num_heads = kernel_heads or (declared.local_heads or heads_per_rank or NUM_HEADS // ctx.world_size) * ctx.world_size
    heads = own_heads(ctx, num_heads)
    steps = schedule_trace(requests, token_budget=token_budget, pad_to=PAD_TO)
    tensors = []
    for index, spec in enumerate(layers):
        tensors.append(
            LayerTensors(
                spec,
                requests,
                num_heads=num_heads,
                head_dim=HEAD_DIM,
                seed=ctx.seed + 7919 * index,
                rounded_to=declared.layer_dtype,
                kv_cache_format=declared.kv_cache_format,
                kv_from=None if spec.kv_source is None else tensors[spec.kv_source],
                topk_from=None if spec.index_source is None else tensors[spec.index_source],
                common_component=common_component,
            )
        )
    # The tolerance is that of the dtype asked for (fp32 here) or of the one the
    # implementation declares it computes in, never that of what it returned.
    tolerance_dtype = coarser_dtype(torch.float32, declared.layer_dtype)
    stack_args = dict(head_dim=HEAD_DIM, window=WINDOW, heads=heads, seed=ctx.seed, topology=topology)
    if max_model_len is not None:
        if max(request.final_len for request in requests) > max_model_len:
            raise ValueError(f"a request longer than max_model_len={max_model_len}: vLLM refuses it")
        stack_args["max_model_len"] = max_model_len
    group = CountingGroup(ctx.group)
    dcp_stack = RankStack(
        ctx.impl,
        group,
        layers,
        requests,
        **stack_args,
        backend=backend,
        prefill_gather=prefill_gather,
        **({} if prefill_token_chunk is None else {"prefill_token_chunk": prefill_token_chunk}),
    )
    # The W=1 stack is one computation of every head, on rank 0, shared with
    # the others (not W copies); an implementation that declares its heads per
    # rank gets a W=1 stack of its own heads on every rank.
    shared_dcp1 = ctx.world_size > 1 and not declared.local_heads
    dcp1_stack = None
    if ctx.rank == 0 or not shared_dcp1:
        dcp1_args = {**stack_args, "heads": slice(0, num_heads)} if shared_dcp1 else stack_args
        dcp1_stack = RankStack(
            ctx.impl, DcpGroup.single_rank(ctx.device), layers, requests, **dcp1_args, prefill_gather=False
        )
    path = "gather" if prefill_gather else "stage 3 sub-chunks"
    worst: dict[str, float] = {}

    # A fused implementation's layer calls no prefill capability: its collectives are counted instead.
    fused = prefill_is_fused(ctx.impl)
    # Every layer of every step is compared before the case fails: one
    # failure (a known defect's, say) hides no other layer's or step's. Where
    # the case runs again with its known defect cured, that run checks every
    # step: this one ends with the first step that fails.
    mismatches: list[MismatchError] = []
    with nullcontext([]) if fused else spy_on_capability(ctx.impl, "prefill_geometry") as geometry_calls:
        for step_index, step in enumerate(steps):
            rows = step_rows(step)
            inputs = [data.step_inputs(rows) for data in tensors]
            gathered_before = group.gathered_kv_rows
            dcp_out = dcp_stack.step(rows, inputs)
            check_kv_gathered_once(
                ctx, layers, rows, prefill_gather, group.gathered_kv_rows - gathered_before, step_index
            )
            dcp1_out = dcp1_stack.step(rows, inputs) if dcp1_stack is not None else None
            if shared_dcp1:
                shape = (len(layers), len(rows.positions), num_heads, HEAD_DIM)
                dcp1_out = share_from_rank0(ctx, dcp1_out, shape, inputs[0].q.dtype)
                dcp1_out = [out[:, heads] for out in dcp1_out]
            labels = tuple(f"{label}, position {p}" for label, p in zip(rows.row_labels, rows.positions.tolist()))
            for index, (spec, data, layer_inputs) in enumerate(zip(layers, tensors, inputs)):
                comp_cache, comp_slots, swa_cache, swa_slots = data.dense_candidates(rows, layer_inputs, WINDOW)
                want, _ = oracle.sparse_attention(
                    layer_inputs.q[:, heads],
                    comp_cache,
                    comp_slots,
                    swa_cache,
                    swa_slots,
                    layer_inputs.sink[heads],
                    scale=HEAD_DIM**-0.5,
                )
                context = {
                    "stage": "e2e",
                    "W": ctx.world_size,
                    "rank": ctx.rank,
                    "H": num_heads,
                    "backend": backend,
                    "prefill": path,
                    "step": step_index,
                    "layer": f"{index} (rho {spec.rho})",
                }
                for what, actual, expected in (
                    ("DCP-W vs float64 oracle", dcp_out[index], want),
                    ("DCP-W vs the implementation's W=1 stack", dcp_out[index], dcp1_out[index]),
                    ("W=1 stack vs float64 oracle", dcp1_out[index], want),
                ):
                    try:
                        stats = assert_close(
                            actual, expected, what=what, context=context, row_labels=labels, dtype=tolerance_dtype
                        )
                    except MismatchError as mismatch:
                        mismatches.append(mismatch)
                        continue
                    worst[what] = max(worst.get(what, 0.0), stats.worst_ratio)
            if mismatches and ctx.case.first_failure_suffices:
                break
            dcp_stack.finish(step.finished)
            if dcp1_stack is not None:
                dcp1_stack.finish(step.finished)

    if mismatches:
        first, *others = map(str, mismatches)
        also = [f"also {line.splitlines()[0]}" for line in others]
        raise MismatchError("\n".join([first, *also]))
    if not fused:
        check_geometry_once_per_step(ctx, layers, steps, prefill_gather, len(geometry_calls))
    return worst


def share_from_rank0(ctx, outputs: list[torch.Tensor] | None, shape: tuple[int, ...], dtype) -> torch.Tensor:
    """Rank 0's per-layer outputs (CPU, ``shape[1:]`` each), on every rank:
    ``[layers, T, H, D]`` on the CPU."""
    if ctx.rank == 0:
        buffer = torch.stack(outputs).to(ctx.device)
    else:
        buffer = torch.empty(shape, dtype=dtype, device=ctx.device)
    return ctx.group.broadcast(buffer, src=0).cpu()


def check_kv_gathered_once(ctx, layers, rows, prefill_gather: bool, gathered_rows: int, step_index: int) -> None:
    """With the gather at W > 1, a step all-gathers each kv source's pages of
    every prefill request exactly once (``pages_i * bs`` rows per request from
    each rank; layers reading another layer's cache add nothing); without
    it, no KV is gathered. At W = 1 a gather is a copy: the port may make it or not."""
    if ctx.world_size == 1:
        return
    prefill = rows.is_prefill_request.bool()
    expected = 0
    if prefill_gather and bool(prefill.any()):
        for spec in layers:
            if spec.compressed and spec.kv_source is None:
                geometry = gather_geometry(rows.seq_lens[prefill], rho=spec.rho, bs=spec.bs, W=ctx.world_size)
                expected += int(geometry.pages.sum()) * spec.bs
    if gathered_rows != expected:
        raise MismatchError(
            f"e2e W={ctx.world_size} rank {ctx.rank} step {step_index}: {gathered_rows} KV rows all-gathered; "
            f"expected {expected} (each kv source's prefill pages once per step, "
            f"{'gather on' if prefill_gather else 'gather off'})"
        )


def check_geometry_once_per_step(ctx, layers, steps, prefill_gather: bool, calls: int) -> None:
    """The gather geometry is computed once per step and KV layout, not per layer."""
    compressed_layouts = len({(spec.rho, spec.bs, spec.interleave) for spec in layers if spec.compressed})
    prefill_steps = sum(any(run.role == "prefill" for run in step.runs) for step in steps)
    expected = compressed_layouts * prefill_steps if prefill_gather else 0
    if calls != expected:
        raise MismatchError(
            f"e2e W={ctx.world_size} rank {ctx.rank}: prefill_geometry called {calls} times over {prefill_steps} "
            f"prefill steps; expected {expected} (once per step for each of {compressed_layouts} KV layouts)"
        )


# Both backends through stage 3 (decode and prefill), and the stage-9 gather
# (whose prefill rows use no combine) with one of them: the stage-9 tests run
# the gather with both. V4.0's shapes: the generic primitives.
