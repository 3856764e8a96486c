"""End to end: prompt chunks on both sides of the decode threshold.

vLLM routes a request whose step has at most ``decode_threshold`` query
tokens to the decode path, the rest to prefill (``split_decodes_and_prefills``,
``vllm/v1/attention/backends/utils.py``; DeepSeek-V4.1's sparse MLA builder
sets the threshold to 1, ``_init_reorder_batch_threshold(1, ...)`` in
``vllm/models/deepseek_v41/sparse_mla.py``). A prompt chunk of one token is
the edge: a one-token prompt, and the last token of a prompt split over two
steps, sit at the threshold; a two-token prompt is one past it. vllm#54300
(https://github.com/vllm-project/vllm/issues/54300) was a length-routed
prefill bug; here both sides of the shortest routing edge, on the stage-3 path
and the gathered one, at every W, must equal DCP1. The suite's trace names
these chunks prefill (the dsv41 driver takes the step's split from it).
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_trace import check_serving_trace
from dcpcheck.scenarios.trace import RequestSpec
from dcpcheck.stages import STAGE_COMBINE, STAGE_PREFILL
from tests.e2e.common import DSV41_RATIO1_TOPOLOGY

pytestmark = pytest.mark.needs("build_attention")

# Step 0 (budget 16): the one-token prompt, the two-token prompt and 13 of the 14-token one;
# step 1: their decodes beside the 14-token prompt's last token, a one-token prefill chunk.
THRESHOLD_REQUESTS = [
    RequestSpec(uid=0, arrival=0, prompt_len=1, decode_steps=2),
    RequestSpec(uid=1, arrival=0, prompt_len=2, decode_steps=2),
    RequestSpec(uid=2, arrival=0, prompt_len=14, decode_steps=1),
]
THRESHOLD_TOKEN_BUDGET = 16


@pytest.mark.world_sizes(1, 2, 4, 8)
@pytest.mark.parametrize(
    "prefill_gather",
    [
        pytest.param(False, marks=pytest.mark.stage(STAGE_COMBINE), id="stage3_chunked"),
        pytest.param(True, marks=pytest.mark.stage(STAGE_PREFILL), id="gather"),
    ],
)
def test_prompt_chunks_at_the_decode_threshold(dcp, prefill_gather):
    dcp.run(
        check_serving_trace,
        backend="a2a",
        prefill_gather=prefill_gather,
        topology=DSV41_RATIO1_TOPOLOGY,
        interleave_tokens=2,
        prefill_token_chunk=None if prefill_gather else 16,
        heads_per_rank=1,
        requests=THRESHOLD_REQUESTS,
        token_budget=THRESHOLD_TOKEN_BUDGET,
    )
