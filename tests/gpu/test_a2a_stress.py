"""Stage 3 under repeated launches: the combine run back to back, its input
buffers refilled with new partials before each launch and no host
synchronisation between launches, equals the same combines run one at a time
with a synchronisation after each.

FlashInfer#5172 (https://github.com/flashinfer-ai/flashinfer/issues/5172):
a memory-ordering race in the DCP a2a receiver gave wrong results with no
error and no regression test. One launch with a quiet GPU rarely shows such
a race; launches that overlap, each reading buffers the previous one wrote,
do. The serialized runs are the reference, so the check is exact in
expectation and needs no tolerance beyond the combine's own. docs/gpu.md
runs this file under compute-sanitizer too.
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.compare import assert_close, assert_lse_close
from dcpcheck.oracle.attention import EMPTY_LSE
from dcpcheck.scenarios.profiles import PROFILES
from dcpcheck.stages import STAGE_COMBINE
from tests.gpu.common import profile_name, summary

pytestmark = [pytest.mark.gpu, pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("combine")]

LAUNCHES = 64


def partials(ctx, profile: str, num_tokens: int, draw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``draw``-th partial, on the device: out [T, H, D], lse [T, H] fp32, some rows empty."""
    shapes = PROFILES[profile]
    gen = ctx.generator(offset=7000 + 1000 * draw + ctx.rank)
    out = torch.randn(num_tokens, shapes.num_heads, shapes.head_dim, generator=gen).to(shapes.dtype)
    lse = torch.randn(num_tokens, shapes.num_heads, generator=gen) * 4.0
    lse[draw % 5 :: 5] = EMPTY_LSE
    return out.to(ctx.device), lse.to(ctx.device)


def check_repeated_launches(ctx, *, profile, backend, num_tokens):
    impl, group = ctx.impl, ctx.group
    draws = [partials(ctx, profile, num_tokens, draw) for draw in range(LAUNCHES)]
    buffer_out, buffer_lse = (tensor.clone() for tensor in draws[0])
    stressed = []
    torch.cuda.synchronize()
    for out, lse in draws:
        # The same input buffers every launch, refilled on the stream: a receiver
        # that reads before the sender's writes land reads the previous draw.
        buffer_out.copy_(out)
        buffer_lse.copy_(lse)
        merged, merged_lse = impl.combine(buffer_out, buffer_lse, group, backend=backend, return_lse=True)
        stressed.append((merged.clone(), merged_lse.clone()))
    torch.cuda.synchronize()
    stats = {}
    for draw, ((out, lse), (stressed_out, stressed_lse)) in enumerate(zip(draws, stressed)):
        quiet_out, quiet_lse = impl.combine(out, lse, group, backend=backend, return_lse=True)
        torch.cuda.synchronize()
        context = {"stage": STAGE_COMBINE, "W": ctx.world_size, "rank": ctx.rank, "profile": profile,
                   "backend": backend, "T": num_tokens, "launch": draw}  # fmt: skip
        stats[f"output, launch {draw}"] = assert_close(
            stressed_out, quiet_out, what="back-to-back vs one-at-a-time combine output", context=context
        )
        assert_lse_close(stressed_lse, quiet_lse, what="back-to-back vs one-at-a-time combine LSE", context=context)
    return summary(stats)


@pytest.mark.world_sizes(2, 4)  # W = 1 returns its inputs: nothing is exchanged
@pytest.mark.parametrize("num_tokens", [8, 256])
@pytest.mark.parametrize("backend", ["a2a", "ag_rs"])
def test_repeated_combine_launches_equal_serialized_ones(dcp, backend, num_tokens):
    dcp.run(check_repeated_launches, profile=profile_name(dcp, "v4.0"), backend=backend, num_tokens=num_tokens)
