"""Stage 1 at the realistic profiles (CUDA): the stage-1 partition checks of
``tests/stage1_index`` on a decode step of top-k 512, 64 states per page (32
at DeepSeek-V4.1's ratio 2) and up to 256 rows (the filter kernel at the tile
counts it meets in serving), at V4.0's compress ratios and at V4.1's."""

from __future__ import annotations

import pytest

from dcpcheck.checks.partition import check_partition
from dcpcheck.scenarios.profiles import profile_for
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.gpu, pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("filter_index", "slot_mapping")]


# -1: the longest request's newest page is cut
@pytest.mark.parametrize(
    "model, rho, table_slack",
    [
        ("v4.0", 4, 2),
        pytest.param("v4.0", 128, -1, marks=pytest.mark.scenario("short_table")),
        ("v4.1", 1, 2),
        ("v4.1", 2, 2),
    ],
)
def test_realistic_partition(dcp, model, rho, table_slack):
    shapes = profile_for(dcp.device_type, model)
    dcp.run(
        check_partition, S=shapes.interleave, bs=shapes.states_per_page(rho), K=shapes.top_k, rho=rho,
        table_slack=table_slack, num_decodes=shapes.num_decodes(rho),
    )  # fmt: skip
