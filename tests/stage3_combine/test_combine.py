"""Stage 3: the LSE combine alone, on synthetic partials, on real groups.

Every rank builds the same global partials ``[W, T, H, D]`` from the seed,
combines its own, and checks its heads against the float64 oracle merge;
both backends must agree. The rows cover every empty-row flavour and LSE
gaps that overflow without max-subtraction. The head dim is part of every
case, so an implementation can say before launch that it cannot run one.
"""

from __future__ import annotations

import math

import pytest
import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.checks.cases import own_heads
from dcpcheck.compare import (
    Expected,
    MismatchError,
    assert_close,
    assert_lse_close,
    assert_outputs,
    format_context,
    out_amplitude_summable_in,
)
from dcpcheck.oracle.attention import EMPTY_LSE, merge_partials
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.common import (
    combine_unavailable_reason,
    combine_with_lse,
    padded_view,
    transposed_view,
)

# Every case combines synthetic_partials, whose rows 5 and 6 hold LSEs near 150.
pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("combine"), pytest.mark.scenario("lse_near_150")]

NUM_TOKENS = 40
FLT_MAX = torch.finfo(torch.float32).max
# Every form of an empty row's LSE kernels write (the empty band, section 3 of
# docs/CONTRACT.md): -inf, the sentinel -1e30, FlashInfer SM120's -1e29, the
# sentinel after a base change (-1e30 ln 2), and -FLT_MAX.
EMPTY_FORMS = (float("-inf"), EMPTY_LSE, -1e29, EMPTY_LSE * math.log(2.0), -FLT_MAX)
# Real LSEs far below any other: ten times above the band's bound, and what a
# finite -5e4 mask leaves. They carry mass.
NEAR_BAND_LSE = -1e27
FINITE_MASK_LSE = -3e4
HEAD_DIM = 64  # the main cases: a power of two, as vLLM's kernels need (tl.arange bound)
ODD_HEAD_DIM = 72  # not a power of two: a kernel's column mask is exercised


def synthetic_partials(gen: torch.Generator, world: int, num_heads: int, dtype: torch.dtype, head_dim: int):
    """-> (outs [W, T, H, D] in dtype, lses [W, T, H] fp32): random rows plus one
    row per edge case (rows 0 to 7 and 9 to 14), in the LSE units of whatever
    base the caller combines in. 16-bit outputs are uniform within the
    amplitude at which no sum of the W weighted partials in the 16-bit dtype,
    in any order, leaves the "out" tolerance (compare.py's
    out_amplitude_summable_in): a combine that sums in 16 bits (vLLM's ag_rs)
    passes them whatever the seed, and test_combine_cancelling.py is built to
    fail it. fp32 outputs are normal: row 6 shows vLLM's fp32 weight rounding
    where its merged |out| passes about 1 (docs/vllm.md, known defect 4)."""
    shape = (world, NUM_TOKENS, num_heads)
    if dtype == torch.float32:
        outs = torch.randn(*shape, head_dim, generator=gen)
    else:
        outs = (torch.rand(*shape, head_dim, generator=gen) * 2 - 1) * out_amplitude_summable_in(dtype, world)
    lses = torch.randn(*shape, generator=gen) * 3.0
    nan, neg_inf = float("nan"), float("-inf")
    ranks = torch.arange(world)

    def set_row(row, lse_by_rank, nan_out=None):
        lses[:, row] = lse_by_rank[:, None]
        if nan_out is not None:
            outs[nan_out, row] = nan

    set_row(0, torch.full((world,), EMPTY_LSE))  # every rank empty, sentinel
    outs[:, 0] = 0.0
    set_row(1, torch.full((world,), neg_inf), nan_out=ranks >= 0)  # every rank -inf, NaN out
    set_row(2, torch.where(ranks == 0, 1.5, EMPTY_LSE))  # only rank 0 has mass
    outs[1:, 2] = 0.0
    set_row(3, torch.where(ranks == world - 1, -2.0, neg_inf), nan_out=ranks != world - 1)
    set_row(4, torch.where(ranks % 2 == 0, neg_inf, 0.5 * ranks), nan_out=(ranks % 2 == 0) & (ranks > 0))
    lses[0, 4] = 0.25  # rank 0 keeps mass, so no row is empty at W = 2 by accident
    # One rank dominates by 120 at an LSE whose power overflows fp32 in base 2 and e.
    set_row(5, torch.where(ranks == world // 2, 150.0, 30.0))
    set_row(6, -150.0 + 0.5 * ranks)  # underflows fp32 without max-subtraction
    set_row(7, torch.where(ranks == 0, EMPTY_LSE, 100.0 + ranks))
    # Rows 9 to 11: every rank empty, in another form of the band than row 0's.
    for row, form in zip((9, 10, 11), (-1e29, EMPTY_LSE * math.log(2.0), -FLT_MAX)):
        set_row(row, torch.full((world,), form))
        outs[:, row] = 0.0
    # Row 12: every form on some rank, the last rank with mass.
    forms = torch.tensor(EMPTY_FORMS)[ranks % len(EMPTY_FORMS)]
    set_row(12, torch.where(ranks == world - 1, 0.7, forms))
    # Rows 13 and 14: one rank with a real LSE near the band, the others empty.
    set_row(13, torch.where(ranks == 0, NEAR_BAND_LSE, forms))
    set_row(14, torch.where(ranks == world - 1, FINITE_MASK_LSE, forms))
    return outs.to(dtype), lses


def check_combine(ctx, *, backend, lse_base, dtype_name, num_heads, head_dim, views=False):
    """:func:`check_combine_of` on :func:`synthetic_partials`."""
    outs, lses = synthetic_partials(ctx.generator(), ctx.world_size, num_heads, DTYPES[dtype_name], head_dim)
    return check_combine_of(ctx, outs, lses, backend=backend, lse_base=lse_base, dtype_name=dtype_name, views=views)


def check_combine_of(ctx, outs, lses, *, backend, lse_base, dtype_name, views=False):
    """One rank, given every rank's partials (outs [W, T, H, D], lses [W, T, H]):
    its backend's result vs the oracle merge (out and LSE of its heads),
    return_lse=False vs True, and the other backend, unless the
    implementation says that one cannot run here. ``views``: the partial
    output is the leading columns of a wider buffer and the LSE the
    transposed view of a [H, T] buffer, as engines hand them over."""
    base = LSE_BASES[lse_base]
    _, num_tokens, num_heads, head_dim = outs.shape
    context = ctx.failure_context(
        backend=backend, lse_base=lse_base, dtype=dtype_name, H=num_heads, D=head_dim, views=views
    )
    if views:
        out, lse = padded_view(outs[ctx.rank], ctx.device), transposed_view(lses[ctx.rank], ctx.device)
    else:
        out, lse = outs[ctx.rank].to(ctx.device), lses[ctx.rank].to(ctx.device)

    if num_heads % ctx.world_size:
        with pytest.raises(ValueError, match=rf"H={num_heads}.*W={ctx.world_size}.*accepted"):
            ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=base)
        return {}

    heads = own_heads(ctx, num_heads)
    if ctx.world_size == 1:
        merged, merged_lse = combine_with_lse(ctx, out, lse, backend=backend, lse_base=base, context=context)
        if merged is not out or merged_lse is not lse:
            raise MismatchError(f"W=1 combine must return its inputs unchanged ({context})")
        if ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=base) is not out:
            raise MismatchError(f"W=1 combine without return_lse must return out itself ({context})")
        return {}

    report = {"context": context, "offsets": (0, heads.start, 0)}  # global head ids in messages
    want_out, want_lse = merge_partials(outs, lses, lse_base=base)
    merged, merged_lse = combine_with_lse(ctx, out, lse, backend=backend, lse_base=base, context=context)
    stats = assert_close(merged, want_out[:, heads], what="combined output vs oracle merge", **report)
    assert_lse_close(merged_lse, want_lse[:, heads], what="combined LSE vs oracle merge", **report)

    only_out = assert_outputs(
        "combine(return_lse=False)",
        ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=base),
        [Expected("out", (num_tokens, heads.stop - heads.start, head_dim), outs.dtype)],
        device=ctx.device,
        context=format_context(context),
    )
    assert_close(only_out, merged, what="combine(return_lse=False) vs return_lse=True", **report)

    other = "a2a" if backend == "ag_rs" else "ag_rs"
    # The same answer on every rank (it depends on the case only), so no rank
    # skips a collective its peers enter.
    other_unavailable = combine_unavailable_reason(ctx, other)
    if other_unavailable:
        return {**stats.as_dict(), "cross_check": f"{other} vs {backend} skipped: {other_unavailable}"}
    other_out, other_lse = combine_with_lse(
        ctx,
        out,
        lse,
        backend=other,
        lse_base=base,
        context=context,
        capability=f"combine(backend={other!r}, return_lse=True)",
    )
    assert_close(other_out, merged, what=f"{other} vs {backend} output", **report)
    assert_lse_close(other_lse, merged_lse, what=f"{other} vs {backend} LSE", **report)
    return {**stats.as_dict(), "cross_check": f"{other} vs {backend}"}


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lse_base", ["2", "e"])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_matches_oracle_merge(dcp, backend, lse_base, dtype_name):
    dcp.run(check_combine, backend=backend, lse_base=lse_base, dtype_name=dtype_name, num_heads=8, head_dim=HEAD_DIM)


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])  # one and two packed LSE columns in a2a
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_non_power_of_two_head_dim(dcp, backend, dtype_name):
    dcp.run(check_combine, backend=backend, lse_base="2", dtype_name=dtype_name, num_heads=8, head_dim=ODD_HEAD_DIM)


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize(
    "backend, lse_base, dtype_name",
    [("ag_rs", "2", "fp32"), ("ag_rs", "e", "fp32"), ("a2a", "2", "fp32"), ("a2a", "e", "fp32"), ("a2a", "2", "bf16")],
)
def test_combine_given_views(dcp, backend, lse_base, dtype_name):
    """Partials as engines hand them over: the output as the leading D columns
    of a wider buffer, the LSE as the transposed view of a [H, T] buffer
    (FlashMLA returns [b, h, s]); bf16 packs the LSE as two a2a columns."""
    dcp.run(
        check_combine,
        backend=backend,
        lse_base=lse_base,
        dtype_name=dtype_name,
        num_heads=8,
        head_dim=HEAD_DIM,
        views=True,
    )


@pytest.mark.world_sizes(1)
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_single_rank_returns_inputs(dcp, backend):
    dcp.run(check_combine, backend=backend, lse_base="2", dtype_name="bf16", num_heads=8, head_dim=HEAD_DIM)


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_one_head_per_rank(dcp, backend):
    """H = W: every rank keeps one head (H_loc = 1) at every world size, not
    only at W = 8 with H = 8; bf16 packs the LSE as two a2a columns."""
    dcp.run(
        check_combine, backend=backend, lse_base="2", dtype_name="bf16", num_heads=dcp.world_size, head_dim=HEAD_DIM
    )


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("num_heads", [12, 6])
def test_combine_head_counts(dcp, num_heads):
    """H = 12 splits over W = 2, 4; H = 6 over W = 4, 8 and H = 12 over W = 8
    must raise a ValueError that says what is accepted."""
    dcp.run(check_combine, backend="a2a", lse_base="e", dtype_name="bf16", num_heads=num_heads, head_dim=HEAD_DIM)
