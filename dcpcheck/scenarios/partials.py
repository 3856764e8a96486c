"""Stage-3 partials: every rank's (out [W, T, H, D], lse [W, T, H]) before the
combine, built alike on every rank from a generator. ``synthetic_partials``
(random rows plus one row per empty-row flavour and LSE gap) feeds the
stage-3 combine checks; ``cancelling_partials`` (16-bit weighted terms that
cancel) the cancelling-terms case; the self-test of vLLM's 16-bit sum
(``tests/selftest/checks/test_combine_16bit_sum.py``) checks both."""

from __future__ import annotations

import math

import torch

from dcpcheck.compare import out_amplitude_summable_in
from dcpcheck.oracle.attention import EMPTY_LSE

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
HEAD_DIM = 64  # the stage-3 cases' own: a power of two, as vLLM's kernels need (tl.arange bound)


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


CANCELLING_TOKENS = 8
CANCELLING_HEADS = 8  # the cancelling case's heads
TERM_GRID = 2.0**-5  # a, b and a + b on it: every sum of them below 4 is a 16-bit value
TERM_STEPS = 12  # a, b in 1 + TERM_GRID * [1, 12]: a + b in (2, 2.75], so the three weights sum to <= 11/12
ROUNDING_OFFSET = 7 / 16  # of an ulp: each term rounds to its 16-bit neighbour, 1/16 ulp short of a tie
CANCELLING_RANKS = 3


def cancelling_partials(gen: torch.Generator, world: int, num_heads: int, dtype: torch.dtype, head_dim: int, lse_base):
    """-> (outs [W, T, H, D] in dtype, lses [W, T, H] fp32 in ``lse_base``).

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
    ``tests/selftest/checks/test_combine_16bit_sum.py`` checks the arithmetic at three
    seeds.
    """
    rows = (CANCELLING_TOKENS, num_heads)
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
