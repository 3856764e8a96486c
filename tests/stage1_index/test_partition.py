"""Stage 1 on W ranks: the ranks' filtered top-k partitions the DCP1 set, and
what a rank reads is where it (and only it) writes (the checks are in
:mod:`dcpcheck.checks.partition`).
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.partition import check_partition
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("filter_index", "slot_mapping")]
SHORT_TABLE = pytest.mark.scenario("short_table")  # table_slack < 0


# (S, bs, K, rho, table_slack, num_decodes): every S with two page sizes, K
# never a multiple of 16, short tables (slack < 0) in half the cases, and
# batches of 72 tokens (num_decodes=50: more than one 64-token block) in three.
CASES = [
    pytest.param(1, 1, 37, 4, 2, 4, id="S1-bs1-K37-rho4"),
    pytest.param(1, 16, 100, 128, -1, 50, id="S1-bs16-K100-rho128-short_table-T72", marks=SHORT_TABLE),
    pytest.param(2, 2, 61, 128, 0, 4, id="S2-bs2-K61-rho128"),
    pytest.param(2, 6, 131, 4, -1, 4, id="S2-bs6-K131-rho4-short_table", marks=SHORT_TABLE),
    pytest.param(16, 16, 45, 4, 2, 50, id="S16-bs16-K45-rho4-T72"),
    pytest.param(16, 64, 300, 4, -2, 4, id="S16-bs64-K300-rho4-short_table", marks=SHORT_TABLE),
    pytest.param(64, 64, 1, 4, 2, 4, id="S64-bs64-K1-rho4"),
    pytest.param(64, 128, 200, 128, -1, 50, id="S64-bs128-K200-rho128-short_table-T72", marks=SHORT_TABLE),
]


@pytest.mark.parametrize("S, bs, K, rho, table_slack, num_decodes", CASES)
def test_partition(dcp, S, bs, K, rho, table_slack, num_decodes):
    dcp.run(check_partition, S=S, bs=bs, K=K, rho=rho, table_slack=table_slack, num_decodes=num_decodes)


# Two cases without cut pages (their write side is a known vLLM defect) and
# with a batch past one kernel block.
VIEW_CASES = [CASES[0], CASES[4]]


@pytest.mark.parametrize("S, bs, K, rho, table_slack, num_decodes", VIEW_CASES)
def test_partition_given_views(dcp, S, bs, K, rho, table_slack, num_decodes):
    """Top-k and block tables as engines hand them over: column slices of
    wider buffers (row stride above the width)."""
    dcp.run(check_partition, S=S, bs=bs, K=K, rho=rho, table_slack=table_slack, num_decodes=num_decodes, views=True)
