"""vLLM's ag_rs arithmetic on the stage-3 partials, at three seeds (docs/vllm.md,
known defect 5). ag_rs cannot run under the Triton interpreter, so its
arithmetic is emulated on CPU as vLLM 0.33.0 does it: each rank's term
``out_r * b^(lse_r - L)``, its weight computed in fp32 as
``CorrectAttnCPOutKernel.kernel`` computes it, is stored to the 16-bit output
dtype, and the reduce-scatter sums the terms in that dtype in rank order.
The cancelling case (test_combine_cancelling.py) must leave the "out"
tolerance on every element at every seed, and the drawn partials of
test_combine.py must stay inside it at every seed, against the exact merge
and against that merge rounded once (what ``a2a`` returns).
"""

from __future__ import annotations

import math

import pytest
import torch

from dcpcheck.compare import MismatchError, assert_close, out_amplitude_summable_in
from dcpcheck.oracle.attention import merge_partials
from dcpcheck.scenarios.partials import CANCELLING_HEADS, HEAD_DIM, cancelling_partials, synthetic_partials

SEEDS = (0, 1, 2)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def ag_rs_16bit(outs: torch.Tensor, lses: torch.Tensor, *, lse_base: float) -> torch.Tensor:
    """outs [W, T, H, D] 16-bit, lses [W, T, H] fp32 -> [T, H, D] as vLLM 0.33.0's
    cp_lse_ag_out_rs computes it (dcp.py: CorrectAttnCPOutKernel.kernel, then
    reduce_scatter in the output dtype), every head kept."""
    exp, log = (torch.exp, torch.log) if lse_base == math.e else (torch.exp2, torch.log2)
    lses = lses.float()
    lse = torch.where(torch.isnan(lses) | (lses == math.inf), -math.inf, lses)
    lse_max = lse.amax(0)
    lse_max = torch.where(lse_max == -math.inf, 0.0, lse_max)
    merged_lse = log(exp(lse - lse_max).sum(0)) + lse_max
    exponent = lses - merged_lse  # the kernel loads the rank's own LSE again, unfiltered
    exponent = torch.where(torch.isnan(exponent) | (exponent == math.inf), -math.inf, exponent)
    factor = exp(exponent)[..., None]
    terms = torch.where(factor == 0, 0.0, outs.float() * factor).to(outs.dtype)
    total = terms[0]
    for term in terms[1:]:  # a 16-bit add: the exact sum of two 16-bit values, rounded to the dtype
        total = total + term
    return total


def _vs_merges(outs, lses, *, lse_base):
    """(emulated ag_rs, exact merge, exact merge rounded once to the dtype)."""
    exact, _ = merge_partials(outs, lses, lse_base=lse_base)
    return ag_rs_16bit(outs, lses, lse_base=lse_base), exact, exact.to(outs.dtype)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [4, 8])
def test_cancelling_partials_leave_the_out_tolerance_on_every_element(world, dtype, seed):
    outs, lses = cancelling_partials(torch.Generator().manual_seed(seed), world, CANCELLING_HEADS, dtype, HEAD_DIM, 2.0)
    ag_rs, exact, rounded_once = _vs_merges(outs, lses, lse_base=2.0)
    assert not ag_rs.any(), "the rounded terms sum to exactly 0"
    every_element = r"(\d+) of \1 elements out of tolerance"
    with pytest.raises(MismatchError, match=every_element):
        assert_close(ag_rs, exact, what="emulated ag_rs vs oracle merge")
    with pytest.raises(MismatchError, match=every_element):
        assert_close(ag_rs, rounded_once, what="emulated ag_rs vs a2a")
    assert_close(rounded_once, exact, what="a merge rounded once vs oracle merge")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lse_base", [2.0, math.e], ids=["2", "e"])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_drawn_partials_stay_within_the_out_tolerance(world, dtype, lse_base, seed):
    for num_heads in (8, 8 * world):  # test_combine.py's heads, and the port's
        outs, lses = synthetic_partials(torch.Generator().manual_seed(seed), world, num_heads, dtype, HEAD_DIM)
        numbers = outs[~torch.isnan(outs)]
        assert numbers.abs().max() <= out_amplitude_summable_in(dtype, world)
        ag_rs, exact, rounded_once = _vs_merges(outs, lses, lse_base=lse_base)
        assert_close(ag_rs, exact, what="emulated ag_rs vs oracle merge")
        assert_close(ag_rs, rounded_once, what="emulated ag_rs vs a2a")
        assert_close(rounded_once, ag_rs, what="a2a vs emulated ag_rs")
