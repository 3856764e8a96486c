"""Stage 3: the LSE combine alone, on synthetic partials, on real groups.

Every rank builds the same global partials ``[W, T, H, D]`` from the seed,
combines its own, and checks its heads against the float64 oracle merge;
both backends must agree. The rows cover every empty-row flavour and LSE
gaps that overflow without max-subtraction
(:func:`dcpcheck.scenarios.partials.synthetic_partials`); the check is
:func:`tests.stage3_combine.common.check_combine_of`. The head dim is part of every
case, so an implementation can say before launch that it cannot run one.
"""

from __future__ import annotations

import pytest

from dcpcheck.scenarios.partials import HEAD_DIM
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.common import check_combine

# Every case combines synthetic_partials, whose rows 5 and 6 hold LSEs near 150.
pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("combine"), pytest.mark.scenario("lse_near_150")]

ODD_HEAD_DIM = 72  # not a power of two: a kernel's column mask is exercised


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lse_base", ["2", "e"])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_matches_oracle_merge(dcp, backend, lse_base, dtype_name):
    dcp.run(check_combine, backend=backend, lse_base=lse_base, dtype_name=dtype_name, num_heads=8, head_dim=HEAD_DIM)


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])  # one and two packed LSE columns in a2a
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_non_power_of_two_head_dim(dcp, backend, dtype_name):
    dcp.run(check_combine, backend=backend, lse_base="2", dtype_name=dtype_name, num_heads=8, head_dim=ODD_HEAD_DIM)


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize(
    "backend, lse_base, dtype_name",
    [("ag_rs", "2", "fp32"), ("ag_rs", "e", "fp32"), ("a2a", "2", "fp32"), ("a2a", "e", "fp32"), ("a2a", "2", "bf16")],
)
def test_combine_given_views(dcp, backend, lse_base, dtype_name):
    """Partials as engines hand them over: the output as the leading D columns
    of a wider buffer, the LSE as the transposed view of a [H, T] buffer
    (FlashMLA returns [b, h, s]); bf16 packs the LSE as two a2a columns."""
    dcp.run(
        check_combine,
        backend=backend,
        lse_base=lse_base,
        dtype_name=dtype_name,
        num_heads=8,
        head_dim=HEAD_DIM,
        views=True,
    )


@pytest.mark.world_sizes(1)
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_single_rank_returns_inputs(dcp, backend):
    dcp.run(check_combine, backend=backend, lse_base="2", dtype_name="bf16", num_heads=8, head_dim=HEAD_DIM)


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_one_head_per_rank(dcp, backend):
    """H = W: every rank keeps one head (H_loc = 1) at every world size, not
    only at W = 8 with H = 8; bf16 packs the LSE as two a2a columns."""
    dcp.run(
        check_combine, backend=backend, lse_base="2", dtype_name="bf16", num_heads=dcp.world_size, head_dim=HEAD_DIM
    )


@pytest.mark.world_sizes(2, 4, 8)
@pytest.mark.parametrize("num_heads", [12, 6])
def test_combine_head_counts(dcp, num_heads):
    """H = 12 splits over W = 2, 4; H = 6 over W = 4, 8 and H = 12 over W = 8
    must raise a ValueError that says what is accepted."""
    dcp.run(check_combine, backend="a2a", lse_base="e", dtype_name="bf16", num_heads=num_heads, head_dim=HEAD_DIM)
