"""End to end: a serving trace whose LSEs are large, as a trained model's are.

Dimension 0 of every q and latent row holds one value, so every logit gains
the same amount: the softmax over the candidates is unchanged and every
base-2 LSE sits near 104, where bf16 holds values 0.5 apart. A port that
narrows its partial LSEs to a 16-bit dtype on the way to the combine then
weights each rank's partial by up to 2^0.25 too much or too little, and the
stage-3 path of a 16-bit layer is off by far more than its ``out``
tolerance in most rows, at every seed; one that keeps them in fp32 is off by
the same few roundings as with small LSEs. The offset would outgrow fp32's
own bound (q·k of 576 computed in fp32), so a layer computing in fp32 skips.
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.checks.serving_trace import HEAD_DIM, check_serving_trace
from dcpcheck.compare import coarser_dtype
from dcpcheck.impls.conventions import conventions_of
from dcpcheck.stages import STAGE_COMBINE
from tests.e2e.common import DSV41_RATIO1_TOPOLOGY, DSV41_REQUESTS, DSV41_TOKEN_BUDGET

pytestmark = pytest.mark.needs("build_attention")
COMMON_COMPONENT = 24.0  # q·k gains 576: a logit of 72 at scale HEAD_DIM**-0.5 = 1/8, a base-2 LSE near 104
assert COMMON_COMPONENT**2 * HEAD_DIM**-0.5 == 72.0


def check_large_lse_trace(ctx):
    return check_serving_trace(
        ctx,
        backend="a2a",
        prefill_gather=False,
        topology=DSV41_RATIO1_TOPOLOGY,
        interleave_tokens=2,
        prefill_token_chunk=16,
        heads_per_rank=1,
        requests=DSV41_REQUESTS,
        token_budget=DSV41_TOKEN_BUDGET,
        common_component=COMMON_COMPONENT,
    )


@pytest.mark.stage(STAGE_COMBINE)
@pytest.mark.world_sizes(2)  # the combine's first W; W = 1 combines nothing
@pytest.mark.scenario("stage3_prefill_trace")
def test_large_lse_trace(dcp):
    if coarser_dtype(torch.float32, conventions_of(dcp.impl).layer_dtype) == torch.float32:
        pytest.skip("large LSEs check a 16-bit layer's combine; this implementation computes the layer in fp32")
    dcp.run(check_large_lse_trace)
