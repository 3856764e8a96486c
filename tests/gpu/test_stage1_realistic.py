"""Stage 1 at the realistic profile (CUDA): the stage-1 partition checks of
``tests/stage1_index`` on a decode step of top-k 512, 64 states per page and
up to 256 rows (the filter kernel at the tile counts it meets in serving)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.partition import check_partition
from dcpcheck.scenarios.profiles import profile_for
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.gpu, pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("filter_index", "slot_mapping")]


# -1: the longest request's newest page is cut
@pytest.mark.parametrize("rho, table_slack", [(4, 2), pytest.param(128, -1, marks=pytest.mark.scenario("short_table"))])
def test_realistic_partition(dcp, rho, table_slack):
    shapes = profile_for(dcp.device_type)
    dcp.run(
        check_partition, S=shapes.interleave, bs=shapes.bs, K=shapes.top_k, rho=rho,
        table_slack=table_slack, num_decodes=shapes.num_decodes(rho),
    )  # fmt: skip
