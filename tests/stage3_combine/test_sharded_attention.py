"""Stage 3 on real shards: per-rank partial attention over the stage-1 slots
of a realistic batch, combined, equals DCP1 attention for the rank's heads.
The cases; what each checks, and why the sinks are fixed:
:func:`tests.stage3_combine.sharded_attention.check_sharded_attention`.
"""

from __future__ import annotations

import pytest

from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.sharded_attention import check_sharded_attention

pytestmark = [
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.needs("gather_heads", "sparse_attention", "partial_attention", "combine", "dcp_attention"),
]


@pytest.mark.parametrize(
    "backend, lse_base, dtype_name, interleave, bs",
    [
        ("ag_rs", "2", "fp32", 1, 4),
        ("a2a", "e", "fp32", 2, 8),
        ("ag_rs", "e", "bf16", 4, 8),
    ],
)
def test_sharded_attention_matches_dcp1(dcp, backend, lse_base, dtype_name, interleave, bs):
    dcp.run(
        check_sharded_attention,
        backend=backend,
        lse_base=lse_base,
        dtype_name=dtype_name,
        interleave=interleave,
        bs=bs,
    )


def test_sharded_attention_one_head_per_rank(dcp):
    """H = W: every rank keeps one head (H_loc = 1) at every world size, not
    only at W = 8; a2a with bf16 packs the LSE as two columns."""
    dcp.run(
        check_sharded_attention,
        backend="a2a",
        lse_base="2",
        dtype_name="bf16",
        interleave=1,
        bs=8,
        num_heads=dcp.world_size,
    )


@pytest.mark.parametrize("backend, lse_base", [("ag_rs", "e"), ("a2a", "2")])
def test_sharded_attention_given_views(dcp, backend, lse_base):
    """q, slots and the partial LSE as strided views, as engines hand them over."""
    dcp.run(
        check_sharded_attention,
        backend=backend,
        lse_base=lse_base,
        dtype_name="fp32",
        interleave=2,
        bs=4,
        views=True,
    )
