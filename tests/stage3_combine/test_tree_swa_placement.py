"""The sliding-window cache as the tree's KV-cache spec keeps it under DCP
(sharded or replicated) against how the port reads it (replicated: the
window is attended on DCP rank 0). The implementation asks its tree
(``serving_probes``)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


@pytest.mark.scenario("tree_swa_placement")
def test_swa_cache_is_kept_as_the_port_reads_it(dcp):
    dcp.run(check_serving_probe, name="sliding-window cache placement")
