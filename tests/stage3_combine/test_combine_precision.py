"""Stage 3: the combine's precision in 16-bit dtypes, where it degrades.

A combine that merges in fp32 and rounds once to bf16/fp16 is within one ulp
of the float64 merge of its inputs (compare.py's "out_rounded_once"). One that
sums the W weighted partials in the 16-bit dtype, or rounds the weights
b^(lse_r - L) to it, rounds at the size of the terms: where they cancel, its
error is many ulps of the result. Many rows at W = 4 and 8 (and 2; W = 1
returns the partial, which is its own merge), every rank with weight, so
such rows occur whatever the seed.

Each case records ``combine_precision_ratio``: the worst |error| / bound over
the ranks (<= 1 passes; a round-to-nearest result stays <= 0.5, a truncating
cast such as the Triton interpreter's fp32 -> bf16 below 1).
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.checks.cases import own_heads
from dcpcheck.compare import assert_close, assert_lse_close
from dcpcheck.oracle.attention import merge_partials
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.common import combine_with_lse

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("combine"), pytest.mark.scenario("rounded_once")]

NUM_TOKENS = 128
NUM_HEADS = 8  # T * H = 1024 rows, 64 values each
HEAD_DIM = 64
LSE_SPREAD = 3.0  # partial LSEs in [-3, 3): no rank's weight is negligible


def precision_partials(gen: torch.Generator, world: int, dtype: torch.dtype):
    """-> (outs [W, T, H, D] in dtype, uniform in [-1, 1): the size the
    tolerance's fp32 slack assumes; lses [W, T, H] fp32)."""
    outs = torch.rand(world, NUM_TOKENS, NUM_HEADS, HEAD_DIM, generator=gen) * 2 - 1
    lses = (torch.rand(world, NUM_TOKENS, NUM_HEADS, generator=gen) * 2 - 1) * LSE_SPREAD
    return outs.to(dtype), lses


def check_rounds_once(ctx, *, backend, lse_base, dtype_name):
    dtype, base = DTYPES[dtype_name], LSE_BASES[lse_base]
    context = ctx.failure_context(backend=backend, lse_base=lse_base, dtype=dtype_name, H=NUM_HEADS, D=HEAD_DIM)
    outs, lses = precision_partials(ctx.generator(), ctx.world_size, dtype)
    heads = own_heads(ctx, NUM_HEADS)
    merged, merged_lse = combine_with_lse(
        ctx,
        outs[ctx.rank].to(ctx.device),
        lses[ctx.rank].to(ctx.device),
        backend=backend,
        lse_base=base,
        context=context,
    )
    want_out, want_lse = merge_partials(outs[:, :, heads], lses[:, :, heads], lse_base=base)
    report = {"context": context, "offsets": (0, heads.start, 0)}
    stats = assert_close(
        merged, want_out, what="combined output vs oracle merge, rounded once", quantity="out_rounded_once", **report
    )
    assert_lse_close(merged_lse, want_lse, what="combined LSE vs oracle merge", **report)
    return stats.as_dict()


@pytest.mark.world_sizes(1, 2, 4, 8)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_rounds_once(dcp, request, backend, dtype_name):
    stats = dcp.run(check_rounds_once, backend=backend, lse_base="2", dtype_name=dtype_name)
    # JUnit properties as the dcp fixture records its own (record_property
    # warns under pytest's default junit_family, xunit2, and writes the same).
    request.node.user_properties += [
        ("combine_precision_dtype", dtype_name),
        ("combine_precision_ratio", max(rank["worst_ratio"] for rank in stats)),
    ]
