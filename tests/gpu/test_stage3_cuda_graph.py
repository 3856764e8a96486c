"""Stage 3 under CUDA graphs: the combine, captured once per backend, replayed
with new partials copied into its static inputs, equals the eager combine.

Capture fails on any host synchronisation inside the combine (``.item()``,
``.tolist()``, ``.cpu()``, a data-dependent shape), which is what decode
under CUDA graphs needs. Every replay and eager call runs before any check,
so a rank that finds a mismatch never leaves a peer inside a collective.
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.compare import assert_close, assert_lse_close
from dcpcheck.oracle.attention import EMPTY_LSE
from dcpcheck.scenarios.profiles import PROFILES
from dcpcheck.stages import STAGE_COMBINE
from tests.gpu.common import profile_name, summary

# CUDA graphs capture NCCL collectives, never gloo ones: ranks sharing a GPU skip.
pytestmark = [pytest.mark.gpu, pytest.mark.nccl, pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("combine")]

REPLAYS = 3


def random_partials(ctx, profile: str, num_tokens: int, draw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``draw``-th partial (out [T, H, D], lse [T, H] fp32), with
    some empty rows (sentinel and -inf) so replays meet them too."""
    shapes = PROFILES[profile]
    gen = ctx.generator(offset=1000 * draw + ctx.rank)
    out = torch.randn(num_tokens, shapes.num_heads, shapes.head_dim, generator=gen).to(shapes.dtype)
    lse = torch.randn(num_tokens, shapes.num_heads, generator=gen) * 4.0
    lse[::5] = EMPTY_LSE
    lse[1::7, ctx.rank :: ctx.world_size] = float("-inf")
    return out.to(ctx.device), lse.to(ctx.device)


def check_combine_graph_replay(ctx, *, profile, backend, num_tokens):
    impl, group = ctx.impl, ctx.group
    static_out, static_lse = random_partials(ctx, profile, num_tokens, draw=0)

    def combine(out, lse):
        return impl.combine(out, lse, group, backend=backend, return_lse=True)

    # Warm up on a side stream, as capture wants: compiles the kernels and
    # sets up the communicators outside the captured region.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        combine(static_out, static_lse)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            graph_out, graph_lse = combine(static_out, static_lse)
        results = []
        for draw in range(1, REPLAYS + 1):
            out, lse = random_partials(ctx, profile, num_tokens, draw)
            static_out.copy_(out)
            static_lse.copy_(lse)
            graph.replay()
            replayed = (graph_out.clone(), graph_lse.clone())
            results.append((draw, replayed, combine(out, lse)))
        torch.cuda.synchronize()
    finally:
        # destroy_process_group() hangs while a graph that captured NCCL
        # collectives is alive: free it before the rank function returns.
        del graph
        torch.cuda.synchronize()

    stats = {}
    for draw, (replay_out, replay_lse), (eager_out, eager_lse) in results:
        context = {"stage": STAGE_COMBINE, "W": ctx.world_size, "rank": ctx.rank, "profile": profile,
                   "backend": backend, "T": num_tokens, "replay": draw}  # fmt: skip
        stats[f"output, replay {draw}"] = assert_close(
            replay_out, eager_out, what="CUDA-graph replay vs eager combine output", context=context
        )
        assert_lse_close(replay_lse, eager_lse, what="CUDA-graph replay vs eager combine LSE", context=context)
    return summary(stats)


@pytest.mark.world_sizes(2, 4, 8)  # W = 1 returns its inputs: nothing to capture
@pytest.mark.parametrize("num_tokens", [8, 256])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_graph_replay_equals_eager(dcp, backend, num_tokens):
    dcp.run(check_combine_graph_replay, profile=profile_name(dcp, "v4.0"), backend=backend, num_tokens=num_tokens)
