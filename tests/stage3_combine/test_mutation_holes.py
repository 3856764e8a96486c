"""Stage 3: properties the mutation report found unchecked.

``SentinelGivenWeight`` (``tools/mutation_report.py``) treats only -inf as an
empty partial and merges the -1e30 sentinel as a real LSE. In
:func:`dcpcheck.scenarios.partials.synthetic_partials` every row whose
ranks are all at the sentinel has zero outputs, and a weighted mean of zeros
is zero, so that bug passed. Here the outputs under the sentinel are garbage
(NaN, or random values, as a kernel may leave for a row with no candidate):
DESIGN.md section 1 says an empty row is the identity in the combine, never
weight, so the merge must still be 0 with the empty LSE. The same holds for
every form of the empty band kernels write (-inf, -1e29, -1e30 ln 2,
-FLT_MAX), alone and mixed across the ranks.
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.checks.cases import own_heads
from dcpcheck.compare import assert_close, assert_lse_close
from dcpcheck.oracle.attention import EMPTY_LSE, merge_partials
from dcpcheck.scenarios.partials import EMPTY_FORMS, HEAD_DIM, synthetic_partials
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.common import combine_with_lse

pytestmark = [
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.needs("combine"),
    pytest.mark.scenario("garbage_under_sentinel", "lse_near_150"),  # synthetic_partials' rows 5 and 6
]

NUM_HEADS = 8
NAN_ROW = 0  # synthetic_partials: every rank at the sentinel
GARBAGE_ROW = 8  # a random row, turned into one with every rank at the sentinel
# Random rows turned into rows with every rank in one other form of the empty
# band, and one with every form: an implementation that recognises only one
# constant gives the garbage weight.
GARBAGE_FORM_ROWS = dict(zip(range(15, 15 + len(EMPTY_FORMS)), EMPTY_FORMS))
MIXED_FORMS_ROW = 15 + len(EMPTY_FORMS)


def check_sentinel_gets_no_weight(ctx, *, backend, lse_base, dtype_name, head_dim):
    base = LSE_BASES[lse_base]
    context = ctx.failure_context(backend=backend, lse_base=lse_base, H=NUM_HEADS, D=head_dim)
    outs, lses = synthetic_partials(ctx.generator(), ctx.world_size, NUM_HEADS, DTYPES[dtype_name], head_dim)
    outs[:, NAN_ROW] = float("nan")
    lses[:, GARBAGE_ROW] = EMPTY_LSE  # its random outputs stay
    for row, form in GARBAGE_FORM_ROWS.items():
        lses[:, row] = form
    lses[:, MIXED_FORMS_ROW] = torch.tensor(EMPTY_FORMS)[torch.arange(ctx.world_size) % len(EMPTY_FORMS), None]

    heads = own_heads(ctx, NUM_HEADS)
    report = {"context": context, "offsets": (0, heads.start, 0)}
    merged, merged_lse = combine_with_lse(
        ctx,
        outs[ctx.rank].to(ctx.device),
        lses[ctx.rank].to(ctx.device),
        backend=backend,
        lse_base=base,
        context=context,
    )
    want_out, want_lse = merge_partials(outs, lses, lse_base=base)
    what = "garbage under the sentinel, vs oracle merge"
    stats = assert_close(merged, want_out[:, heads], what=f"combined output, {what}", **report)
    assert_lse_close(merged_lse, want_lse[:, heads], what=f"combined LSE, {what}", **report)
    return stats.as_dict()


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("lse_base", ["2", "e"])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_sentinel_partial_gets_no_weight(dcp, backend, lse_base):
    dcp.run(check_sentinel_gets_no_weight, backend=backend, lse_base=lse_base, dtype_name="fp32", head_dim=HEAD_DIM)
