"""End to end: a step with more prefill requests than the port attends at once.

A fused port walks a step's prefill requests in chunks of a fixed number of
requests (vLLM's ``PREFILL_CHUNK_SIZE``; an implementation that has one
declares it as ``prefill_chunk_size``, the dsv41 adapter reads it from the
tree), and on the stage-3 path each chunk's rows in token sub-chunks. Here
one step carries that many prefill requests and two more, beside a decode,
so the second chunk runs; the 16-token sub-chunks end inside a request. The
gather runs with an interleave of two and of four states at ratio 1, where
an interleave in tokens and one in states agree.
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_trace import check_serving_trace
from dcpcheck.scenarios.trace import RequestSpec
from dcpcheck.stages import STAGE_COMBINE, STAGE_PREFILL
from tests.e2e.common import DSV41_RATIO1_TOPOLOGY

pytestmark = pytest.mark.needs("build_attention")
PREFILL_CHUNK_SIZE = 4  # vLLM 0.33.0's, for implementations that declare none
PROMPT_LENGTHS = (5, 9, 3, 12, 7, 6, 4, 8)  # cycled: the third prompt's rows cross token 16 of its chunk
SUB_CHUNK_TOKENS = 16


def chunk_crossing_requests(chunk_size: int) -> list[RequestSpec]:
    """A short request decoding while ``chunk_size + 2`` prompts are prefilled in one step."""
    decoding = RequestSpec(uid=0, arrival=0, prompt_len=3, decode_steps=2)
    prompts = [
        RequestSpec(uid=1 + i, arrival=1, prompt_len=PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], decode_steps=1)
        for i in range(chunk_size + 2)
    ]
    return [decoding, *prompts]


def check_prefill_chunks(ctx, *, prefill_gather: bool, interleave_tokens: int):
    chunk_size = getattr(ctx.impl, "prefill_chunk_size", PREFILL_CHUNK_SIZE)
    requests = chunk_crossing_requests(chunk_size)
    return check_serving_trace(
        ctx,
        backend="a2a",
        prefill_gather=prefill_gather,
        topology=DSV41_RATIO1_TOPOLOGY,
        interleave_tokens=interleave_tokens,
        prefill_token_chunk=None if prefill_gather else SUB_CHUNK_TOKENS,
        heads_per_rank=1,
        requests=requests,
        token_budget=sum(spec.prompt_len for spec in requests),  # every prompt in its arrival step
    )


@pytest.mark.stage(STAGE_COMBINE)
@pytest.mark.world_sizes(1, 2)
@pytest.mark.scenario("stage3_prefill_trace")
def test_prefill_chunks_stage3(dcp):
    dcp.run(check_prefill_chunks, prefill_gather=False, interleave_tokens=2)


@pytest.mark.stage(STAGE_PREFILL)
@pytest.mark.world_sizes(1, 2, 4)  # the gather's interleave arithmetic past two ranks
@pytest.mark.parametrize("interleave_tokens", [2, 4], ids=lambda tokens: f"I{tokens}")
def test_prefill_chunks_gather(dcp, interleave_tokens):
    dcp.run(check_prefill_chunks, prefill_gather=True, interleave_tokens=interleave_tokens)
