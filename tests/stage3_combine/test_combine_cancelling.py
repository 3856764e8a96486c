"""Stage 3: a 16-bit combine of partials whose weighted terms cancel.

In every (token, head) row three ranks have weighted terms b^(lse_r - L) * out_r
of exactly ``a + 7/16 ulp(a)``, ``b + 7/16 ulp(b)`` and ``-(a + b) + 7/16 ulp(a + b)``
(a, b in (1, 1.375] on a 2^-5 grid, ulp in the output dtype); the other ranks
hold ``out = 0`` with the remaining weight. Which ranks play which part, the
outputs' size (|out| in [6, 8]) and each dimension's sign are drawn from the
seed. The exact merge is ``7/16 (ulp(a) + ulp(b) + ulp(a + b)) = 7/4 ulp(1)``:
0.0137 in bf16, 0.00171 in fp16. A merge run in fp32 and rounded once is
within one ulp of it. One that rounds each term to the 16-bit dtype gets a, b
and -(a + b), every partial sum of which is a 16-bit value (a multiple of
2^-5 below 4): it returns exactly 0 whatever the order of its sum, 1.66
(bf16) and 1.70 (fp16) times the "out" tolerance away, on every element.
This is how vLLM's ``ag_rs`` sums (docs/vllm.md, known defect 5);
``tests/selftest/test_combine_16bit_sum.py`` checks the arithmetic at three
seeds.
"""

from __future__ import annotations

import math

import pytest
import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.test_combine import HEAD_DIM, check_combine_of

pytestmark = [
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.needs("combine"),
    pytest.mark.scenario("cancelling_terms"),
    pytest.mark.world_sizes(4, 8),  # three cancelling ranks and at least one more
]

NUM_TOKENS = 8
NUM_HEADS = 8
TERM_GRID = 2.0**-5  # a, b and a + b on it: every sum of them below 4 is a 16-bit value
TERM_STEPS = 12  # a, b in 1 + TERM_GRID * [1, 12]: a + b in (2, 2.75], so the three weights sum to <= 11/12
ROUNDING_OFFSET = 7 / 16  # of an ulp: each term rounds to its 16-bit neighbour, 1/16 ulp short of a tie
CANCELLING_RANKS = 3


def cancelling_partials(gen: torch.Generator, world: int, num_heads: int, dtype: torch.dtype, head_dim: int, lse_base):
    """-> (outs [W, T, H, D] in dtype, lses [W, T, H] fp32 in ``lse_base``)."""
    rows = (NUM_TOKENS, num_heads)
    a, b = (1 + TERM_GRID * torch.randint(1, TERM_STEPS + 1, (2, *rows), generator=gen, dtype=torch.float64)).unbind()
    rounded = torch.stack([a, b, -(a + b)])
    ulp = torch.finfo(dtype).eps * torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)[:, None, None]
    terms = rounded + ROUNDING_OFFSET * ulp
    # 16-bit outputs of the terms' signs, |out| in [6, 8]: the three weights sum to at most 11/12.
    size = (6 + 2 * torch.rand((CANCELLING_RANKS, *rows), generator=gen, dtype=torch.float64)).to(dtype)
    outs_by_part = torch.sign(rounded) * size.to(torch.float64)
    weights_by_part = terms / outs_by_part
    rest = ((1 - weights_by_part.sum(0)) / (world - CANCELLING_RANKS)).expand(world - CANCELLING_RANKS, *rows)
    outs_by_part = torch.cat([outs_by_part, torch.zeros_like(rest)])
    weights_by_part = torch.cat([weights_by_part, rest])
    # rank_of_part[k, t, h]: the rank playing part k (a, b, -(a + b), then the zero outputs) of row (t, h).
    rank_of_part = torch.argsort(torch.rand((world, *rows), generator=gen), dim=0)
    outs = torch.empty_like(outs_by_part).scatter_(0, rank_of_part, outs_by_part)
    weights = torch.empty_like(weights_by_part).scatter_(0, rank_of_part, weights_by_part)
    signs = torch.where(torch.rand((*rows, head_dim), generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    lses = torch.log(weights) / math.log(lse_base)
    return (outs[..., None] * signs).to(dtype), lses.to(torch.float32)


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
        num_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
    )
