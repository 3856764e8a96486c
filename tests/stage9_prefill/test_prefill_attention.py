"""Stage 9 in floats: prefill through the implementation's attention layer
equals DCP1 for the rank's heads, on both prefill paths.

DCP1 is checked twice: the float64 oracle over dense per-request states (no
paging, no sharding) and the implementation's own W = 1 layer. The gathered
path attends the rank's local heads over every rank's pages; the non-gather
path runs stage 3 in sub-chunks, which must equal the unsplit run and keep
every all-gathered q block within the chunk (the point of sub-chunking).
A fused implementation (``Conventions.fused_prefill``) calls no prefill
capability from its layer: the KV rows its forward all-gathers are counted.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from dcpcheck.checks.collectives import CountingGroup
from dcpcheck.checks.prefill import HEAD_DIM, oracle_dcp1, port_dcp1, prefill_step, run_layer
from dcpcheck.compare import MismatchError, assert_close
from dcpcheck.impls.conventions import conventions_of, prefill_is_fused
from dcpcheck.oracle.prefill import gather_geometry
from dcpcheck.spies import environment, spy_on_capability, spy_on_collectives
from dcpcheck.stages import STAGE_PREFILL

pytestmark = [
    pytest.mark.stage(STAGE_PREFILL),
    pytest.mark.needs("build_attention", "prefill_geometry", "prefill_gather", "prefill_remap"),
]

DESIGN_PREFILL_TOKEN_CHUNK = 2048  # DESIGN.md: non-gather prefill sub-chunks hold at most this many tokens
SMALL_CHUNK = 7
PREFILL_GATHER_ENV = "DSV41_DCP_PREFILL_GATHER"
V40 = pytest.mark.scenario("v40_ratios")
DSV41_RATIO2 = pytest.mark.scenario("dsv41_ratio2")


@contextmanager
def counting_gathers(ctx, step):
    """-> (the group to build the layer on, a function answering how many
    prefill gathers its forwards made): ``prefill_gather`` calls, or for a
    fused implementation how many times the step's prefill pages were
    all-gathered (None at W = 1: a gather is a copy the port may skip)."""
    if not prefill_is_fused(ctx.impl):
        with spy_on_capability(ctx.impl, "prefill_gather") as gathers:
            yield ctx.group, lambda: len(gathers)
        return
    group = CountingGroup(ctx.group)
    layout = step.batch.layout
    geometry = gather_geometry(step.batch.seq_lens, rho=layout.rho, bs=layout.bs, W=ctx.world_size)
    step_rows = int(geometry.pages.sum()) * layout.bs
    yield group, lambda: None if ctx.world_size == 1 else group.gathered_kv_rows / step_rows


def one_head_per_rank(dcp) -> int:
    """H = W, unless the implementation's layer needs another head count per rank."""
    declared = conventions_of(dcp.impl).local_heads
    if declared and declared != 1:
        pytest.skip(f"the implementation's layer needs {declared} heads per rank (Conventions.local_heads), not 1")
    return dcp.world_size


def check_against_dcp1(ctx, step, out, what: str) -> dict:
    """out vs the float64 oracle and vs the implementation's W = 1 path."""
    oracle_out = oracle_dcp1(step)
    port_out = port_dcp1(ctx, step)
    kwargs = {"context": step.context, "row_labels": step.row_labels, "dtype": step.tolerance_dtype}
    return {
        f"{what} vs float64 DCP1": assert_close(
            out, oracle_out, what=f"{what} vs float64 DCP1 oracle", **kwargs
        ).worst_ratio,
        f"{what} vs W=1": assert_close(
            out, port_out, what=f"{what} vs the implementation's W=1 path", **kwargs
        ).worst_ratio,
    }


def check_gathered_prefill(ctx, *, rho, S, bs, K, dtype_name, backend, num_heads=None):
    step = prefill_step(ctx, rho=rho, S=S, bs=bs, top_k=K, dtype_name=dtype_name, backend=backend, num_heads=num_heads)
    with counting_gathers(ctx, step) as (group, gathers):
        layer = ctx.impl.build_attention(
            step.batch.layout, group, prefill_gather=True, backend=backend, max_model_len=step.max_model_len
        )
        out = run_layer(layer, step, ctx.device)
    if gathers() not in (None, 1):
        raise MismatchError(
            f"{step.case}: the gathered path gathered the step's pages {gathers()} times, expected once"
        )
    return check_against_dcp1(ctx, step, out, "gathered prefill")


@pytest.mark.parametrize(
    "rho, S, bs, K, dtype_name, backend",
    [
        pytest.param(4, 1, 2, 16, "fp32", "ag_rs", marks=V40),
        pytest.param(4, 4, 8, 24, "bf16", "ag_rs", marks=V40),
        pytest.param(128, 1, 2, 64, "fp32", "a2a", marks=V40),  # C128A: K covers every state
        # DeepSeek-V4.1's ratios on vLLM's 128-token page, interleaves of 2 and 64 tokens.
        pytest.param(1, 2, 128, 37, "bf16", "a2a", id="I2-S2-bs128-K37-rho1-bf16"),
        pytest.param(1, 64, 128, 200, "fp32", "a2a", id="I64-S64-bs128-K200-rho1-fp32"),
        pytest.param(1, 128, 128, 200, "fp32", "a2a", id="I128-S128-bs128-K200-rho1-fp32"),  # vllm#56715: the page
        pytest.param(2, 1, 64, 130, "bf16", "a2a", id="I2-S1-bs64-K130-rho2-bf16", marks=DSV41_RATIO2),
    ],
)
def test_gathered_prefill_matches_dcp1(dcp, rho, S, bs, K, dtype_name, backend):
    dcp.run(check_gathered_prefill, rho=rho, S=S, bs=bs, K=K, dtype_name=dtype_name, backend=backend)


def test_gathered_prefill_one_head_per_rank(dcp):
    """H = W: every rank attends one head (H_loc = 1) at every world size, not only at W = 8."""
    dcp.run(
        check_gathered_prefill,
        rho=4,
        S=2,
        bs=8,
        K=16,
        dtype_name="fp32",
        backend="a2a",
        num_heads=one_head_per_rank(dcp),
    )


def largest_q_gather(collectives, heads_local: int) -> int:
    """Most token rows in one all-gathered q block [t, H_loc, D]."""
    rows = [
        shapes[-1][0]
        for name, shapes in collectives.calls
        if name == "all_gather_into_tensor" and shapes and shapes[-1][1:] == (heads_local, HEAD_DIM)
    ]
    return max(rows, default=0)


def run_counting_q_gathers(ctx, layer, step, *, bound: int):
    """One forward -> (output, most token rows in one all-gathered q block);
    fails when that exceeds ``bound`` (sub-chunking is what bounds it)."""
    with spy_on_collectives() as collectives:
        out = run_layer(layer, step, ctx.device)
    largest = largest_q_gather(collectives, step.heads.stop - step.heads.start)
    if largest > bound:
        raise MismatchError(
            f"{step.case}: an all-gathered q block holds {largest} tokens, more than the sub-chunk of {bound}"
        )
    return out, largest


def check_sub_chunks(ctx, step, chunk: int | None, backend: str) -> dict:
    """The non-gather path in sub-chunks of ``chunk`` tokens (None: the
    implementation's default, DESIGN_PREFILL_TOKEN_CHUNK) keeps every
    all-gathered q block within the chunk, and equals the unsplit path and DCP1."""
    options = {} if chunk is None else {"prefill_token_chunk": chunk}
    bound = chunk or DESIGN_PREFILL_TOKEN_CHUNK
    if step.batch.num_tokens <= bound:
        raise ValueError(f"{step.case}: {step.batch.num_tokens} rows fit one sub-chunk of {bound}: nothing is split")
    options["max_model_len"] = step.max_model_len
    chunked = ctx.impl.build_attention(step.batch.layout, ctx.group, prefill_gather=False, backend=backend, **options)
    unsplit = ctx.impl.build_attention(
        step.batch.layout,
        ctx.group,
        prefill_gather=False,
        backend=backend,
        prefill_token_chunk=None,
        max_model_len=step.max_model_len,
    )
    out, largest = run_counting_q_gathers(ctx, chunked, step, bound=bound)
    whole = run_layer(unsplit, step, ctx.device)
    what = f"prefill in sub-chunks of {bound}"
    worst = {
        "chunked vs unsplit": assert_close(
            out,
            whole,
            what=f"{what} vs unsplit",
            context=step.context,
            row_labels=step.row_labels,
            dtype=step.tolerance_dtype,
        ).worst_ratio
    }
    worst.update(check_against_dcp1(ctx, step, out, what))
    return {"largest_q_gather": largest, **worst}


def check_small_chunks(ctx, *, rho, backend, num_heads=None):
    step = prefill_step(ctx, rho=rho, S=2, bs=4, top_k=16, sub_chunk=SMALL_CHUNK, backend=backend, num_heads=num_heads)
    return check_sub_chunks(ctx, step, SMALL_CHUNK, backend)


@pytest.mark.parametrize("rho, backend", [pytest.param(4, "ag_rs", marks=V40), pytest.param(1, "a2a", id="rho1-a2a")])
def test_small_sub_chunks_match_unsplit_and_dcp1(dcp, rho, backend):
    dcp.run(check_small_chunks, rho=rho, backend=backend)


def test_small_sub_chunks_one_head_per_rank(dcp):
    """H = W: the non-gather path with one head per rank (H_loc = 1) at every
    world size; a2a, the backend the V4.0 case above does not run."""
    dcp.run(check_small_chunks, rho=4, backend="a2a", num_heads=one_head_per_rank(dcp))


def check_default_chunks(ctx, *, backend):
    step = prefill_step(
        ctx, rho=4, S=2, bs=4, top_k=16, long_chunk=DESIGN_PREFILL_TOKEN_CHUNK + 57, sub_chunk="default"
    )
    return check_sub_chunks(ctx, step, None, backend)


@pytest.mark.world_sizes(2)  # W > 1 to see the q gathers; one size: 2k rows cost interpreter time per rank
@pytest.mark.scenario("v40_ratios")
def test_default_sub_chunks_match_unsplit_and_dcp1(dcp):
    dcp.run(check_default_chunks, backend="ag_rs")


def check_gather_switch(ctx, *, backend):
    """DSV41_DCP_PREFILL_GATHER=1 at build time selects the gathered path;
    unset or 0 the non-gather one; both give the same output."""
    step = prefill_step(ctx, rho=1, S=1, bs=4, top_k=16)
    outputs = {}
    for value, gathers_expected in (("1", True), ("0", False), (None, False)):
        with counting_gathers(ctx, step) as (group, gathers):
            with environment(PREFILL_GATHER_ENV, value):
                layer = ctx.impl.build_attention(
                    step.batch.layout, group, backend=backend, max_model_len=step.max_model_len
                )
            outputs[value] = run_layer(layer, step, ctx.device)
        if gathers() is not None and bool(gathers()) != gathers_expected:
            raise MismatchError(
                f"{step.case}: {PREFILL_GATHER_ENV}={value}: the step's pages gathered {gathers()} times; "
                f"expected {'the gathered path' if gathers_expected else 'no gather'}"
            )
    assert_close(
        outputs["1"],
        outputs["0"],
        what=f"{PREFILL_GATHER_ENV}=1 vs 0",
        context=step.context,
        row_labels=step.row_labels,
        dtype=step.tolerance_dtype,
    )


@pytest.mark.world_sizes(2)
def test_prefill_gather_env_selects_the_path(dcp):
    dcp.run(check_gather_switch, backend="a2a")
