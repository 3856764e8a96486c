"""Stage 3: a 16-bit combine of partials whose weighted terms cancel.

A merge run in fp32 and rounded once is within one ulp of the exact merge; one
that rounds each term to the 16-bit dtype (vLLM's ``ag_rs``: docs/vllm.md,
known defect 5) returns exactly 0, outside the "out" tolerance on every
element. How the partials are built:
:func:`dcpcheck.scenarios.partials.cancelling_partials`.
"""

from __future__ import annotations

import pytest

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.scenarios.partials import CANCELLING_HEADS, HEAD_DIM, cancelling_partials
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.common import check_combine_of

pytestmark = [
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.needs("combine"),
    pytest.mark.scenario("cancelling_terms"),
    pytest.mark.world_sizes(4, 8),  # three cancelling ranks and at least one more
]


def check_cancelling_combine(ctx, *, backend, lse_base, dtype_name, num_heads, head_dim):
    outs, lses = cancelling_partials(
        ctx.generator(), ctx.world_size, num_heads, DTYPES[dtype_name], head_dim, LSE_BASES[lse_base]
    )
    return check_combine_of(ctx, outs, lses, backend=backend, lse_base=lse_base, dtype_name=dtype_name)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_cancelling_terms(dcp, backend, dtype_name):
    dcp.run(
        check_cancelling_combine,
        backend=backend,
        lse_base="2",
        dtype_name=dtype_name,
        num_heads=CANCELLING_HEADS,
        head_dim=HEAD_DIM,
    )
