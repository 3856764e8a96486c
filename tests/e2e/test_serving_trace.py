"""End to end: a small DSV4.1-like stack driven through a serving trace.

Layers: SWA only (rho 0), C4A (rho 4, indexer top-k with the short-context
shortcut) twice with one KV layout, and C128A (rho 128, every state); sinks
and a window everywhere. The trace has chunked prefills, decodes, spec-decode
rows, requests joining and finishing (freed pages reused) and padded rows. KV
is written step by step through the implementation's sharded write path.
Every layer's output at every step, for this rank's heads, must equal the
implementation's W = 1 stack and the float64 oracle (which reads dense
per-request states: no paging, no sharding).

Layers do not feed each other: each layer's inputs are drawn from the seed,
so every comparison is one attention against a reference computed from the
same rounded inputs, within the single-op tolerances of dcpcheck.compare.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from dcpcheck.checks.cases import own_heads
from dcpcheck.checks.collectives import CountingGroup
from dcpcheck.checks.stack import RankStack
from dcpcheck.compare import MismatchError, assert_close, coarser_dtype
from dcpcheck.impls.conventions import conventions_of
from dcpcheck.oracle import attention as oracle
from dcpcheck.oracle.prefill import gather_geometry
from dcpcheck.ranks.group import DcpGroup
from dcpcheck.scenarios.layers import LayerSpec, LayerTensors
from dcpcheck.scenarios.trace import RequestSpec, schedule_trace, step_rows
from dcpcheck.spies import spy_on_capability
from dcpcheck.stages import STAGE_COMBINE, STAGE_PREFILL

pytestmark = pytest.mark.needs("build_attention")

NUM_HEADS = 8  # one head per rank at W = 8; test_dsv41_topology_trace has one at every W
HEAD_DIM = 64
WINDOW = 8  # DSV4 uses 128; small keeps the CPU run fast and the window short of most requests
LAYERS = (
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
PAD_TO = 8


def check_serving_trace(
    ctx, *, backend, prefill_gather, layers=LAYERS, prefill_token_chunk=None, heads_per_rank: int | None = None
):
    """``heads_per_rank``: H = heads_per_rank * W (default H = NUM_HEADS); an
    implementation that declares its ``local_heads`` gets those instead."""
    declared = conventions_of(ctx.impl)
    num_heads = (declared.local_heads or heads_per_rank or NUM_HEADS // ctx.world_size) * ctx.world_size
    heads = own_heads(ctx, num_heads)
    steps = schedule_trace(REQUESTS, token_budget=TOKEN_BUDGET, pad_to=PAD_TO)
    tensors = []
    for index, spec in enumerate(layers):
        tensors.append(
            LayerTensors(
                spec,
                REQUESTS,
                num_heads=num_heads,
                head_dim=HEAD_DIM,
                seed=ctx.seed + 7919 * index,
                rounded_to=declared.layer_dtype,
                kv_from=None if spec.kv_source is None else tensors[spec.kv_source],
            )
        )
    # The tolerance is that of the dtype asked for (fp32 here) or of the one the
    # implementation declares it computes in, never that of what it returned.
    tolerance_dtype = coarser_dtype(torch.float32, declared.layer_dtype)
    stack_args = dict(head_dim=HEAD_DIM, window=WINDOW, heads=heads, seed=ctx.seed)
    group = CountingGroup(ctx.group)
    dcp_stack = RankStack(
        ctx.impl,
        group,
        layers,
        REQUESTS,
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
            ctx.impl, DcpGroup.single_rank(ctx.device), layers, REQUESTS, **dcp1_args, prefill_gather=False
        )
    path = "gather" if prefill_gather else "stage 3 sub-chunks"
    worst: dict[str, float] = {}

    # A fused implementation has no prefill_geometry to spy on: its collectives are counted instead.
    fused = not callable(getattr(ctx.impl, "prefill_geometry", None))
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
                    stats = assert_close(
                        actual, expected, what=what, context=context, row_labels=labels, dtype=tolerance_dtype
                    )
                    worst[what] = max(worst.get(what, 0.0), stats.worst_ratio)
            dcp_stack.finish(step.finished)
            if dcp1_stack is not None:
                dcp1_stack.finish(step.finished)

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
# the gather with both.
@pytest.mark.parametrize(
    "backend, prefill_gather",
    [
        pytest.param("ag_rs", False, marks=pytest.mark.stage(STAGE_COMBINE)),
        pytest.param("a2a", False, marks=pytest.mark.stage(STAGE_COMBINE)),
        pytest.param("a2a", True, marks=pytest.mark.stage(STAGE_PREFILL)),
    ],
)
@pytest.mark.scenario("multi_token_interleave")
def test_serving_trace_matches_dcp1(dcp, backend, prefill_gather):
    dcp.run(check_serving_trace, backend=backend, prefill_gather=prefill_gather)


# State a port keeps across the layers of one step (caches keyed on the
# metadata object or on buffer addresses) must hold for every layer order
# vLLM produces. The layers are DSV4.1's compress ratio 1 with a one-token
# interleave, where tokens and states are the same unit.
#
# Two adjacent layers of one KV layout, each its own index source: their
# top-k arrive through the one model-wide top-k buffer, at the same address,
# one after the other.
ADJACENT_INDEX_SOURCES = (
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16),
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16),
)
# Two KV groups (layouts, so two metadata objects) interleaved: A, B, A.
INTERLEAVED_KV_GROUPS = (
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16),
    LayerSpec(rho=1, bs=4, interleave=1, top_k=16),
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16),
)


# Consumer layers reading a kv source's cache (and its top-k), before and after
# a layer of another KV group: the gathered KV is the source's, gathered once.
SHARED_KV_SOURCE = (
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16),
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16, kv_source=0),
    LayerSpec(rho=1, bs=4, interleave=1, top_k=16),
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16, kv_source=0),
)


@pytest.mark.stage(STAGE_PREFILL)
@pytest.mark.parametrize(
    "order",
    [
        pytest.param(
            ADJACENT_INDEX_SOURCES, id="adjacent_index_sources", marks=pytest.mark.scenario("adjacent_index_sources")
        ),
        pytest.param(INTERLEAVED_KV_GROUPS, id="interleaved_kv_groups"),
        pytest.param(
            SHARED_KV_SOURCE, id="shared_kv_source", marks=pytest.mark.scenario("kv_source_after_other_group")
        ),
    ],
)
def test_layer_order_within_a_step(dcp, order):
    dcp.run(check_serving_trace, backend="a2a", prefill_gather=True, layers=order)


# DSV4.1's own topology (compress ratio 1, a one-token interleave): SWA only,
# and two compressed KV groups, through stage 3 with prefill split into
# sub-chunks of 64 tokens (so the DCP_PREFILL_TOKEN_CHUNK loop runs several
# times per request) and through the stage-9 gather. One head per rank
# (H = W) at every world size, unless the implementation declares its own.
DSV41_LAYERS = (
    LayerSpec(rho=0),
    LayerSpec(rho=1, bs=8, interleave=1, top_k=16),
    LayerSpec(rho=1, bs=4, interleave=1, top_k=16),
)


@pytest.mark.parametrize(
    "prefill_gather",
    [
        pytest.param(False, marks=pytest.mark.stage(STAGE_COMBINE), id="stage3_chunked"),
        pytest.param(True, marks=pytest.mark.stage(STAGE_PREFILL), id="gather"),
    ],
)
def test_dsv41_topology_trace(dcp, prefill_gather):
    dcp.run(
        check_serving_trace,
        backend="a2a",
        prefill_gather=prefill_gather,
        layers=DSV41_LAYERS,
        prefill_token_chunk=64,
        heads_per_rank=1,
    )
