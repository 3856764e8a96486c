"""The combine launch context the port keeps on each layer (``_cp_ctx``,
handed to vLLM's ``cp_lse_ag_out_rs`` every step) against this host's Triton:
can it launch the compiled combine kernel a second time? Asked where kernels
are compiled (a GPU); the implementation asks its tree (``serving_probes``)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


@pytest.mark.scenario("tree_combine_context")
def test_combine_launch_context_launches_again(dcp):
    dcp.run(check_serving_probe, name="combine launch context")
